"""The labml app under load: `CLIENTS` runs track into one app at once, on
loopback only, bounded in count (`PACKETS` packets of `POINTS` points each) and
in time. No point is lost (up to labml-app's series length, beyond which it
merges old points by design), and the app's memory stays bounded. Each client sends
what labml's `app` writer sends, one request after another as labml's sender
does; the figures (points per second held, the app's resident memory) are
printed for the README."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from labml_zero.app.client import app_url_if_running
from labml_zero.app.server import AppConfig
from tests.test_app import free_port, series, subprocess_env

CLIENTS = 32
PACKETS = 4
POINTS = 250
# Each track request waits labml-app's fixed pause; with every client sending at
# once the whole load takes about PACKETS pauses, far below this.
DEADLINE_S = 240
# The app's resident memory may grow by at most this while it holds the runs.
GROWTH_BOUND = 256 * 2**20


def resident(pid: int) -> tuple[int, int]:
    """`(VmRSS, VmHWM)` of a process, in bytes."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines())
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def post(url: str, body: list) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        assert not json.loads(response.read()).get("errors")


def client(api_url: str, index: int, failures: list) -> None:
    uuid = f"{index:032x}"
    url = f"{api_url}track?run_uuid={uuid}&labml_version=0.5.3"
    try:
        post(url, [{"name": f"load {index}", "time": time.time()}])
        for packet in range(PACKETS):
            steps = list(range(packet * POINTS, (packet + 1) * POINTS))
            post(url, [{"track": {"loss.train": {
                "step": steps, "value": [index + s / 1e4 for s in steps]}},
                "time": time.time()}])
        post(url, [{"status": {"rank": 0, "status": "completed", "details": None,
                               "time": time.time()}}])
    except Exception as e:  # reported by the test, from the main thread
        failures.append(f"client {index}: {type(e).__name__}: {e}")


def test_clients_at_once_lose_no_point_and_memory_stays_bounded(tmp_path,
                                                               monkeypatch):
    # labml-app's settings read the server's address at import
    monkeypatch.setenv("LABML_APP_SERVER_IP", "127.0.0.1")
    monkeypatch.setenv("LABML_APP_SERVER_PORT", "0")
    import labml_app.db  # noqa: F401  (before analyses, as the app imports them)
    from labml_app.analyses.series import MAX_BUFFER_LENGTH

    # a run's series stays below the length the app would merge points at
    assert PACKETS * POINTS <= MAX_BUFFER_LENGTH
    config = AppConfig(port=free_port(), data_dir=tmp_path / "data")
    assert config.host == "127.0.0.1"
    log = open(tmp_path / "app.log", "w")
    app = subprocess.Popen(
        [sys.executable, "-m", "labml_zero.app", "--port", str(config.port),
         "--data-dir", str(config.data_dir)],
        env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while app_url_if_running(config.api_url, timeout_s=1.0) is None:
            assert app.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        before, _ = resident(app.pid)
        failures: list[str] = []
        threads = [threading.Thread(target=client, args=(config.api_url, i, failures),
                                    daemon=True) for i in range(CLIENTS)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, started + DEADLINE_S - time.monotonic()))
        elapsed = time.monotonic() - started
        assert not any(t.is_alive() for t in threads), "clients ran past the deadline"
        assert not failures, failures
        after, peak = resident(app.pid)
        for index in range(CLIENTS):
            held = series(config, f"{index:032x}")["loss.train"]
            assert sorted(held) == list(range(PACKETS * POINTS)), index
        points = CLIENTS * PACKETS * POINTS
        print(f"\napp load: {CLIENTS} clients, {points} points in {elapsed:.1f} s: "
              f"{points / elapsed:.0f} points/s held; app resident "
              f"{before / 2**20:.0f} -> {after / 2**20:.0f} MiB, "
              f"peak {peak / 2**20:.0f} MiB")
        assert after - before < GROWTH_BOUND
    finally:
        app.terminate()
        app.wait(timeout=20)
        log.close()
    assert "Traceback" not in (tmp_path / "app.log").read_text()
