"""The labml app offline (`labml_zero/app/server.py`) and the probe runs use before
sending to it (`labml_zero/app/client.py`).

One app server runs for the module on a free port with its data in a temporary
directory. Two runs send to it at once, as they would in use:

* a tiny fine-tune, `python -m labml_zero.finetune_neox --app-url ...` on two gloo
  ranks: the app must list it as one run and hold exactly the loss series labml
  wrote to the run's own log, and headless Chromium must draw them on the run's
  page with no file from the network;
* a two-rank labml run with a known, different curve per rank: the app's merged
  series must be the ranks' mean.

`LABML_ZERO_UPDATE_FIGURES=1` also writes the fine-tune's page, as Chromium drew
it, to `docs_src/figures/labml_app_run.png`, the README's picture of the app.
"""

import base64
import gzip
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
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest

from labml_zero.app.client import (DEFAULT_APP_URL, app_url_if_running,
                                   check_app_url, labml_app_settings,
                                   show_run_health)
from labml_zero.app.server import ASSETS, AppConfig, main, static_dir
from labml_zero.neox.family import NEOX
from labml_zero.finetune.tracking import HEALTH_CHARTS, HEALTH_READY
from tests.distributed import skip_job_without_gpus
from tests.test_finetune import tracked

REPO = Path(__file__).resolve().parents[1]
FIGURE = REPO / "docs_src" / "figures" / "labml_app_run.png"
RUN_UUID = "0123456789abcdef0123456789abcdef"
STEPS = 20
WORLD = 2
FINETUNE = ["--world-size", "2", "--batch-size", "2", "--seq-len", "32",
            "--steps", "12", "--valid-every", "4", "--sample-tokens", "0"]


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
    from labml_zero.app.client import app_url_if_running, labml_app_settings
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


class Runs(NamedTuple):
    finetune_uuid: str
    finetune_log: dict[str, dict[int, float]]
    """`{indicator: {step: value}}` from rank 0's labml log."""
    two_rank_uuid: str


# labml's `log.jsonl` as `{indicator: {step: value}}`
labml_log = tracked


@pytest.fixture(scope="module")
def runs(app: AppConfig, tmp_path_factory) -> Runs:
    """All processes at once, as under torchrun; each exits once labml has sent."""
    skip_job_without_gpus(WORLD)
    tmp = tmp_path_factory.mktemp("runs")
    script = tmp / "tiny_run.py"
    script.write_text(TINY_RUN)
    commands = {
        "finetune": [sys.executable, "-m", "labml_zero.finetune_neox", *FINETUNE,
                     "--out", str(tmp / "out"), "--log-dir", str(tmp / "logs"),
                     "--app-url", app.api_url],
        **{f"rank {rank}": [sys.executable, str(script), app.api_url, RUN_UUID,
                            str(rank), str(WORLD)] for rank in range(WORLD)},
    }
    procs = {name: subprocess.Popen(cmd, cwd=tmp, env=subprocess_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
             for name, cmd in commands.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}:\n{out[-3000:]}"
    run_dirs = sorted((tmp / "logs" / NEOX.experiment).iterdir())
    # labml's directories are `<uuid>.<rank>`.
    assert [d.suffix for d in run_dirs] == [".0", ".1"], run_dirs
    return Runs(finetune_uuid=run_dirs[0].stem, finetune_log=labml_log(run_dirs[0]),
                two_rank_uuid=RUN_UUID)


def series(app: AppConfig, run_uuid: str) -> dict[str, dict[int, float]]:
    """`{indicator: {step: value}}` as the app serves it to its page."""
    reply = get_json(app.web_url + f"api/v1/metrics/{run_uuid}", {"get_all": True})
    out = {}
    for s in reply["series"]:
        # base64 float32 arrays.
        steps = np.frombuffer(base64.b64decode(s["step"]), dtype=np.float32)
        values = np.frombuffer(base64.b64decode(s["value"]), dtype=np.float32)
        out[s["name"]] = dict(zip(steps.astype(int).tolist(), values.tolist()))
    return out


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
        get_bytes(app.web_url + "vendor/../server.py")
    assert e.value.code == 404


def test_the_bundled_files_are_the_versions_the_page_loads():
    # labml-app's index.html names each CDN file's version in its URL; the copy
    # in app/assets must be that version, or the page would run against another.
    urls = re.findall(r'(?:src|href)="(https?://[^"]+)"',
                      (static_dir() / "index.html").read_text())

    def version(pattern: str) -> str:
        found = [m.group(1) for u in urls if (m := re.search(pattern, u))]
        assert len(found) == 1, (pattern, urls)
        return found[0]

    def banner(path: str) -> str:
        return gzip.decompress((ASSETS / path).read_bytes())[:300].decode()

    bootstrap = version(r"/bootstrap@([^/]+)/")
    assert f"Bootstrap v{bootstrap} " in banner("css/bootstrap.min.css.gz")
    font_awesome = version(r"/font-awesome/([^/]+)/")
    assert f"Font Awesome Free {font_awesome} " in banner(
        "css/fontawesome.min.css.gz")
    d3_major = version(r"/d3\.v(\d+)\.")
    assert re.search(rf"d3js\.org v{d3_major}\.\d+\.\d+ ", banner(
        "js/d3.v6.min.js.gz"))


def test_the_app_answers_the_probe_with_404_and_json(app):
    # The probe's request, a run no one made: the app's 404 with a JSON body,
    # and no run appears.
    before = get_json(app.web_url + "api/v1/runs/null")["runs"]
    with pytest.raises(urllib.error.HTTPError) as e:
        get_bytes(app.web_url + "api/v1/run/status/labmlzeroprobe")
    assert e.value.code == 404
    assert "json" in e.value.headers["content-type"]
    assert json.loads(e.value.read()) == {}
    assert get_json(app.web_url + "api/v1/runs/null")["runs"] == before


def test_the_finetune_is_one_run_with_its_logged_losses(app, runs):
    listed = [r for r in get_json(app.web_url + "api/v1/runs/null")["runs"]
              if r["run_uuid"].startswith(runs.finetune_uuid)]
    assert [(r["run_uuid"], r["name"], r["world_size"]) for r in listed] == \
        [(runs.finetune_uuid, NEOX.experiment, WORLD)]
    assert listed[0]["run_status"]["status"] == "completed"
    run = get_json(app.web_url + f"api/v1/run/{runs.finetune_uuid}")
    assert any(c["key"] == "finetune" for c in run["configs"]), run["configs"]

    sent = series(app, runs.finetune_uuid)
    for name in ("loss.train", "loss.valid"):
        logged = runs.finetune_log[name]
        assert sorted(sent[name]) == sorted(logged), name
        for step, value in logged.items():
            assert sent[name][step] == pytest.approx(value, rel=1e-6), (name, step)
    assert sorted(sent["loss.train"]) == list(range(1, 13))
    assert sorted(sent["loss.valid"]) == [0, 4, 8, 12]


def test_two_ranks_are_one_run_with_the_mean_loss(app, runs):
    api = app.web_url + "api/v1/"
    listed = [r for r in get_json(api + "runs/null")["runs"]
              if r["run_uuid"].startswith(RUN_UUID)]
    assert [(r["run_uuid"], r["world_size"]) for r in listed] == [(RUN_UUID, WORLD)]
    run = get_json(api + f"run/{RUN_UUID}")
    assert run["name"] == "labml_zero app test"
    assert run["other_rank_run_uuids"] == {"0": RUN_UUID, "1": f"{RUN_UUID}_1"}

    merged = series(app, RUN_UUID)
    assert list(merged) == ["loss.train"]
    assert sorted(merged["loss.train"]) == list(range(STEPS))
    for step, value in merged["loss.train"].items():
        mean = sum(loss(step, r) for r in range(WORLD)) / WORLD
        assert value == pytest.approx(mean, rel=1e-5)
    # Each rank's own series is there too.
    rank1 = series(app, f"{RUN_UUID}_1")["loss.train"]
    assert rank1 == pytest.approx({s: loss(s, 1) for s in range(STEPS)}, rel=1e-5)


def test_a_token_the_app_does_not_know_is_filed_under_default(app):
    # labml-app would answer `invalid_token`, and labml would retry that forever.
    uuid = "fedcba9876543210fedcba9876543210"
    reply = get_json(f"{app.web_url}api/v1/no-such-token/track?run_uuid={uuid}"
                     f"&labml_version=0.5.3", [{"name": "stray", "time": time.time()}])
    assert reply["errors"] == []
    runs = get_json(app.web_url + "api/v1/runs/null")["runs"]
    assert uuid in [r["run_uuid"] for r in runs]


def test_a_runs_last_request_is_answered_at_once(app):
    """labml-app answers a `track` request after its pause; the one with the
    run's status, its last, at once: a rank that waits for that answer before
    it exits has it within the launcher's grace period
    (tests/finetune/test_tracking.py)."""
    from labml_zero.app.routes import TRACK_PAUSE_S

    uuid = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
    url = f"{app.api_url}track?run_uuid={uuid}&labml_version=0.5.3"

    def answered_after(body: list) -> float:
        started = time.monotonic()
        assert get_json(url, body)["errors"] == []
        return time.monotonic() - started

    paused = answered_after([{"name": "paused", "time": time.time()}])
    last = answered_after([{"time": time.time(), "status": {
        "rank": 0, "status": "completed", "details": None, "time": time.time()}}])
    assert paused >= TRACK_PAUSE_S and last < 1.0, (paused, last)
    status = get_json(app.web_url + f"api/v1/run/status/{uuid}")["run_status"]
    assert status["status"] == "completed"


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


def test_the_run_page_draws_the_loss_chart(app, runs, tmp_path):
    page = app.web_url + f"run/{runs.finetune_uuid}"

    def segments(dom: str) -> list[int]:
        """Each drawn line's cubic segments, fewest first: d3's curve is one
        move, then one segment per further point."""
        if '<svg id="chart"' not in dom:
            return []
        chart = dom[dom.index('<svg id="chart"'):]
        chart = chart[:chart.index("</svg>")]
        lines = re.findall(r'<path class="unsmoothed-line[^"]*"[^>]*\sd="([^"]+)"', chart)
        return sorted(d.count("C") for d in lines)

    # 12 training and 4 validation losses
    expected = [3, 11]
    # The page fetches its series after the first paint and draws each as it
    # arrives; on a loaded machine the dump can come before the second, so
    # the page gets up to four looks.
    for attempt in range(4):
        dom = chromium(page, tmp_path / f"dom{attempt}", "--dump-dom").stdout
        if segments(dom) == expected:
            break
    assert '<svg id="chart"' in dom, dom[-3000:]
    assert segments(dom) == expected, dom[-3000:]
    assert "loss.train" in dom and "loss.valid" in dom

    png = tmp_path / "run.png"
    proc = chromium(page, tmp_path / "shot", f"--screenshot={png}")
    assert png.is_file(), proc.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(data) < 300_000
    if os.environ.get("LABML_ZERO_UPDATE_FIGURES") == "1":
        FIGURE.write_bytes(data)


def drawn_charts(dom: str) -> dict[str, list[str]]:
    """`{title: [d of each unsmoothed line]}` for every chart the page drew; a
    chart's title is the last known one between it and the chart before."""
    titles = ["Metrics", *HEALTH_CHARTS]
    out, start = {}, 0
    for match in re.finditer(r'<svg id="chart"', dom):
        before = dom[start:match.start()]
        found = [(before.rfind(f">{t}<"), t) for t in titles if f">{t}<" in before]
        chart = dom[match.start():dom.index("</svg>", match.start())]
        out[max(found)[1] if found else None] = re.findall(
            r'<path class="unsmoothed-line[^"]*"[^>]*\sd="([^"]+)"', chart)
        start = match.end()
    return out


def test_the_run_page_shows_run_health(app, runs, tmp_path):
    uuid, api = runs.finetune_uuid, app.web_url + "api/v1/"
    names = [s["name"] for s in get_json(api + f"metrics/{uuid}",
                                         {"get_all": False})["series"]]
    # each health chart draws its own series, by name, of the run's final list
    charts = {m["name"]: [n for n, p in zip(names,
                                             m["preferences"]["series_preferences"])
                          if p == 1]
              for m in get_json(api + f"custom_metrics/{uuid}")["metrics"]}
    expected = {t: list(s) for t, s in HEALTH_CHARTS.items() if set(s) & set(names)}
    assert charts == expected
    # MFU only where the device's peak is known (GPUs); the loss scale in fp16
    assert ("MFU" in charts) == ("mfu" in runs.finetune_log)
    assert {"learning rate", "gradient norm", "tokens per second",
            "peak memory (GiB)"} <= set(charts)
    run = get_json(api + f"run/{uuid}")
    keys = [c["key"] for c in run["configs"]]
    assert sorted(run["selected_configs"]) == sorted(keys) and "finetune" in keys

    page = app.web_url + f"run/{uuid}"
    for attempt in range(3):
        dom = chromium(page, tmp_path / f"dom{attempt}", "--dump-dom").stdout
        drawn = drawn_charts(dom)
        if len(drawn) == 1 + len(expected):
            break
    assert sorted(drawn, key=str) == sorted(["Metrics", *expected]), drawn.keys()
    # d3's curve: one move, then one cubic segment per further point
    assert sorted(d.count("C") for d in drawn["Metrics"]) == [3, 11]
    for title in expected:
        assert [d.count("C") for d in drawn[title]] == [11], title
    # the configurations card lists the run's configuration
    assert "Default configurations" not in dom
    assert '<span class="key">finetune</span>' in dom
    # the output card: the lines the terminal showed, not labml's set-up notices
    stdout = "".join(get_json(api + f"logs/stdout/{uuid}", {})["pages"].values())
    for line in ("GPT-NeoX: 2 layers", "step 4: loss.valid", "step 12: loss.valid"):
        assert line in stdout, (line, stdout[-2000:])
    assert "LABML WARNING" not in stdout and ".labml.yaml" not in stdout
    # the card shows the output's last lines
    card = dom[dom.index(">Standard Output<"):dom.index(">Standard Error<")]
    assert "step 12: loss.valid" in card and "loss.train:" in card, card[-2000:]


def test_a_run_not_yet_in_the_app_gets_no_charts(app):
    uuid = "00112233445566778899aabbccddeeff"
    assert not show_run_health(app.api_url, uuid, HEALTH_CHARTS,
                               ready=HEALTH_READY)
    assert get_json(app.web_url + f"api/v1/custom_metrics/{uuid}")["metrics"] == []


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


def test_probe_gives_up_on_a_trickling_server_after_its_timeout():
    """A server that sends a byte a second never lets a read time out: the
    probe's timeout bounds the whole request, or a run would wait on it (and
    its other ranks with it) for as long as the server trickles."""
    stop = threading.Event()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)

        def trickle():
            connection, _ = s.accept()
            with connection:
                while not stop.wait(0.2):
                    connection.sendall(b"H")

        threading.Thread(target=trickle, daemon=True).start()
        url = f"http://127.0.0.1:{s.getsockname()[1]}/api/v1/default/"
        start = time.monotonic()
        assert app_url_if_running(url, timeout_s=0.5) is None
        assert time.monotonic() - start < 1.5
        stop.set()


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


def test_the_default_port_is_labmls():
    # `labml app-server` (labml's own command for labml-app) listens on a default
    # port; our app and the URL runs send to use the same.
    port = AppConfig().port
    assert urllib.parse.urlsplit(DEFAULT_APP_URL).port == port
    usage = subprocess.run(
        [sys.executable, "-c", "import sys; from labml.cli import main; "
         "sys.argv = ['labml', 'app-server', '--help']; main()"],
        capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Port to run the server on\s+\(default:\s*(\d+)\)", usage)
    assert found and int(found.group(1)) == port, usage


def test_labmls_sender_retries_forever_10r_seconds_apart(monkeypatch):
    # Why the probe exists: labml's `app` writer sends from a non-daemon thread
    # that retries a failed send until it succeeds, sleeping 10 r s before retry r.
    from labml.internal import app as sender
    from labml.internal.app import AppTracker, SimpleAppTrackDataSource

    tracker = AppTracker("http://127.0.0.1:9/track?", {"run_uuid": "x"})
    tracker._check()
    thread = tracker.thread
    assert not thread.daemon
    outcomes = iter([False] * 5 + [True])
    monkeypatch.setattr(thread, "_process", lambda packets: next(outcomes))
    slept = []
    monkeypatch.setattr(sender, "time", SimpleNamespace(sleep=slept.append))
    thread.push_data_source(SimpleAppTrackDataSource({"status": "x"}))
    thread.is_stopped = True  # return once the queue is sent
    thread.run()
    retries = slept[:5]
    assert retries == [10 * r for r in range(1, 6)]


def test_settings_for_labml():
    assert labml_app_settings("http://h:1/api/v1/default") == {
        "app_url": "http://h:1/api/v1/default/", "app_open_browser": False}


def test_bad_flags_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--port", "0"])
    assert e.value.code == 2
    assert "port must be in 1..65535, got 0" in capsys.readouterr().err
