"""The labml app offline (`labml_zero/app.py`) and the probe runs use before sending
to it (`labml_zero/app_client.py`).

One app server runs for the module on a free port with its data in a temporary
directory. A two-rank labml run (two processes, one uuid) sends a known loss curve
to it; the app's HTTP API must list one run of world size 2 whose merged series is
the ranks' mean, and headless Chromium must draw that series on the run's page with
no file from the network. `LABML_ZERO_UPDATE_FIGURES=1` also writes the screenshot
to `docs_src/figures/labml_app_run.png`, the README's picture of it.
"""

import base64
import http.server
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from labml_zero.app import AppConfig, main
from labml_zero.app_client import (app_url_if_running, check_app_url,
                                   labml_app_settings)

REPO = Path(__file__).resolve().parents[1]
FIGURE = REPO / "docs_src" / "figures" / "labml_app_run.png"
RUN_UUID = "0123456789abcdef0123456789abcdef"
STEPS = 20
WORLD = 2


# The curve rank `rank` tracks; the app shows the mean over ranks. Shared, as
# source, by the test and the run it starts.
LOSS = """
def loss(step, rank):
    return 3.0 * math.exp(-step / 6) + 0.5 + 0.2 * rank
"""
_namespace = {"math": math}
exec(LOSS, _namespace)
loss = _namespace["loss"]


# A labml run as the fine-tune makes one: probe, configure, one uuid for all ranks.
TINY_RUN = textwrap.dedent("""
    import math, sys
    from labml import experiment, lab, tracker
    from labml_zero.app_client import app_url_if_running, labml_app_settings
    %s
    url, uuid, rank, world = sys.argv[1:3] + [int(a) for a in sys.argv[3:5]]
    assert app_url_if_running(url) == url, url
    lab.configure({**labml_app_settings(url), "path": ".", "experiments_path": "."})
    experiment.create(name="labml_zero app test", uuid=uuid, writers={"app"},
                      distributed_rank=rank, distributed_world_size=world)
    with experiment.start():
        for step in range(%d):
            tracker.save(step, {"loss.train": loss(step, rank)})
    """) % (LOSS.strip(), STEPS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def get_json(url: str, body: dict | list | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def get_bytes(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> AppConfig:
    try:
        import labml_app  # noqa: F401
    except ImportError:
        pytest.fail("labml-app is needed: pip install -e '.[test,app]'")
    tmp = tmp_path_factory.mktemp("app")
    config = AppConfig(port=free_port(), data_dir=tmp / "data")
    log = open(tmp / "app.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "labml_zero.app", "--port", str(config.port),
         "--data-dir", str(config.data_dir)],
        cwd=tmp, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while app_url_if_running(config.api_url, timeout_s=1.0) is None:
            assert server.poll() is None, (tmp / "app.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "app did not answer within 60 s"
            time.sleep(0.2)
        yield config
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def two_rank_run(app: AppConfig, tmp_path_factory) -> str:
    """Both ranks run at once, as under torchrun; each exits once labml has sent."""
    tmp = tmp_path_factory.mktemp("run")
    script = tmp / "tiny_run.py"
    script.write_text(TINY_RUN)
    ranks = [subprocess.Popen(
        [sys.executable, str(script), app.api_url, RUN_UUID, str(rank), str(WORLD)],
        cwd=tmp, env=subprocess_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank in range(WORLD)]
    for rank, proc in enumerate(ranks):
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"rank {rank}:\n{out[-3000:]}"
    return RUN_UUID


def test_app_prints_its_urls_and_serves_the_page_without_the_network(app):
    log = (Path(app.data_dir).parent / "app.log").read_text()
    assert f"open {app.web_url}" in log and f"--app-url {app.api_url}" in log
    html = get_bytes(app.web_url + "runs").decode()
    assert "/js/bundle.min.js" in html
    # Every script and style sheet comes from this server.
    assert not re.search(r'(src|href)="(https?:)?//', html), html
    for path in re.findall(r'(?:src|href)="(/vendor/[^"]+)"', html):
        assert len(get_bytes(app.web_url + path.lstrip("/"))) > 10_000, path
    css = get_bytes(app.web_url + "vendor/css/fontawesome.min.css").decode()
    assert "../webfonts/fa-solid-900.woff2" in css
    assert get_bytes(app.web_url + "vendor/webfonts/fa-solid-900.woff2")[:4] == b"wOF2"
    with pytest.raises(urllib.error.HTTPError) as e:
        get_bytes(app.web_url + "vendor/../app.py")
    assert e.value.code == 404


def test_two_ranks_are_one_run_with_the_mean_loss(app, two_rank_run):
    api = app.web_url + "api/v1/"
    runs = [r for r in get_json(api + "runs/null")["runs"]
            if r["run_uuid"].startswith(RUN_UUID)]
    assert [(r["run_uuid"], r["world_size"]) for r in runs] == [(RUN_UUID, WORLD)]
    assert runs[0]["run_status"]["status"] == "completed"

    run = get_json(api + f"run/{two_rank_run}")
    assert run["name"] == "labml_zero app test"
    assert run["other_rank_run_uuids"] == {"0": RUN_UUID, "1": f"{RUN_UUID}_1"}

    series = get_json(api + f"metrics/{two_rank_run}", {"get_all": True})["series"]
    assert [s["name"] for s in series] == ["loss.train"]
    # The app sends series as base64 float32 arrays.
    steps = np.frombuffer(base64.b64decode(series[0]["step"]), dtype=np.float32)
    values = np.frombuffer(base64.b64decode(series[0]["value"]), dtype=np.float32)
    assert steps.tolist() == list(range(STEPS))
    mean = [sum(loss(s, r) for r in range(WORLD)) / WORLD for s in range(STEPS)]
    np.testing.assert_allclose(values, mean, rtol=1e-5)
    # Each rank's own series is there too.
    rank1 = get_json(api + f"metrics/{RUN_UUID}_1", {"get_all": True})["series"][0]
    np.testing.assert_allclose(
        np.frombuffer(base64.b64decode(rank1["value"]), dtype=np.float32),
        [loss(s, 1) for s in range(STEPS)], rtol=1e-5)


def test_a_token_the_app_does_not_know_is_filed_under_default(app):
    # labml-app would answer `invalid_token`, and labml would retry that forever.
    uuid = "fedcba9876543210fedcba9876543210"
    reply = get_json(f"{app.web_url}api/v1/no-such-token/track?run_uuid={uuid}"
                     f"&labml_version=0.5.3", [{"name": "stray", "time": time.time()}])
    assert reply["errors"] == []
    runs = get_json(app.web_url + "api/v1/runs/null")["runs"]
    assert uuid in [r["run_uuid"] for r in runs]


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is needed: apt-get install -y chromium")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1400,1000",
           "--virtual-time-budget=10000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_run_page_draws_the_loss_chart(app, two_rank_run, tmp_path):
    page = app.web_url + f"run/{two_rank_run}"
    # The page loads its data after the first paint; a cold start can miss the
    # budget once, so it gets three tries.
    for attempt in range(3):
        dom = chromium(page, tmp_path / f"dom{attempt}", "--dump-dom").stdout
        if 'class="smoothed-line' in dom:
            break
    chart = dom[dom.index('<svg id="chart"'):]
    line = re.search(r'<path class="unsmoothed-line[^"]*"[^>]*\sd="([^"]+)"', chart)
    assert line, chart[:3000]
    # d3's curve: one move, then one cubic segment per further point.
    assert line.group(1).count("C") == STEPS - 1
    assert "loss.train" in dom

    png = tmp_path / "run.png"
    proc = chromium(page, tmp_path / "shot", f"--screenshot={png}")
    assert png.is_file(), proc.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(data) < 300_000
    if os.environ.get("LABML_ZERO_UPDATE_FIGURES") == "1":
        FIGURE.write_bytes(data)


# ---------------------------------------------------------------- the probe


def test_probe_says_no_to_a_closed_port_at_once():
    url = f"http://127.0.0.1:{free_port()}/api/v1/default/"
    start = time.monotonic()
    assert app_url_if_running(url, timeout_s=2.0) is None
    assert time.monotonic() - start < 1.0


def test_probe_gives_up_on_a_silent_server_after_its_timeout():
    # Accepts connections (the kernel's backlog does) and never answers.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        url = f"http://127.0.0.1:{s.getsockname()[1]}/api/v1/default/"
        start = time.monotonic()
        assert app_url_if_running(url, timeout_s=0.5) is None
        assert time.monotonic() - start < 3.0


def test_probe_says_no_to_a_web_server_that_is_not_a_labml_app(tmp_path):
    (tmp_path / "index.html").write_text("<html>not an app</html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(tmp_path), **k)

        def log_message(self, *a):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/default/"
        assert app_url_if_running(url, timeout_s=2.0) is None
        server.shutdown()


@pytest.mark.parametrize("url, message", [
    ("127.0.0.1:5005/api/v1/default/", "http://"),
    ("http://127.0.0.1:5005/api/v1/default/?x=1", "'?'"),
    ("http://127.0.0.1:5005/", "project path"),
    ("", "non-empty"),
])
def test_bad_app_urls_are_one_line_errors(url, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_app_url(url)


def test_settings_for_labml():
    assert labml_app_settings("http://h:1/api/v1/default") == {
        "app_url": "http://h:1/api/v1/default/", "app_open_browser": False}


def test_bad_flags_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--port", "0"])
    assert e.value.code == 2
    assert "port must be in 1..65535, got 0" in capsys.readouterr().err
