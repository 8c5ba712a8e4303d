"""Tracking never decides a run's outcome (`labml_zero/finetune/tracking.py`): the
bounded sender against an app that is not there, and a fine-tune whose app is
stopped in the middle of the run, which must still exit 0 within seconds of its
last step with one warning line and its records complete on disk. A fine-tune
that fails or is interrupted ends in the app too, with its status and the lines
it printed, and with the exit status it has without the app."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from labml.internal.app import SimpleAppTrackDataSource

from labml_zero.app.client import app_url_if_running
from labml_zero.app.server import AppConfig
from labml_zero.finetune.job import FAIL_AT_STEP_ENV
from labml_zero.finetune.tracking import MAX_PENDING, BoundedSender
from labml_zero.finetune import tracking
from labml_zero.launch import Interrupted
from labml_zero.launch.supervisor import GRACE_S
from tests.distributed import run_distributed, skip_job_without_gpus
from tests.test_app import (app, free_port, get_json, series,  # noqa: F401
                            subprocess_env)
from tests.test_finetune import SMALL, closed_port_url, finetune, run_dirs, tracked

REPO = Path(__file__).resolve().parents[2]


def test_a_lost_app_is_one_warning_and_nothing_waits(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(tracking, "LOST_AFTER_S", 1.0)
    monkeypatch.setattr(tracking, "MAX_BACKOFF_S", 0.2)
    url = closed_port_url()
    sender = BoundedSender(url + "track?run_uuid=x", app_url=url, rank=0,
                           log_dir=tmp_path)
    assert sender.daemon
    sender.start()
    for i in range(3 * MAX_PENDING):
        sender.push_data_source(SimpleAppTrackDataSource({"i": i}))
        time.sleep(0.002)
        assert len(sender.pending) <= MAX_PENDING
    deadline = time.monotonic() + 10
    while not sender.lost:
        assert time.monotonic() < deadline, "the app was never declared lost"
        time.sleep(0.05)
    sender.push_data_source(SimpleAppTrackDataSource({"after": 1}))
    sender.stop()
    started = time.monotonic()
    sender.finish()
    assert time.monotonic() - started < 2
    assert not sender.is_alive() and not sender.pending
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not answer for 1 s" in err, err
    assert str(tmp_path) in err


def test_a_silent_app_at_exit_costs_at_most_the_exit_wait(monkeypatch, capsys,
                                                          tmp_path):
    import socket

    # accepts connections and never answers, like a stopped process's socket
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/api/v1/default/"
        monkeypatch.setattr(tracking, "EXIT_WAIT_S", 1.0)
        sender = BoundedSender(url + "track?run_uuid=x", app_url=url, rank=0,
                               log_dir=tmp_path)
        sender.start()
        sender.push_data_source(SimpleAppTrackDataSource({"status": "done"}))
        sender.stop()
        started = time.monotonic()
        sender.finish()
        assert time.monotonic() - started < 1.5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "last records within 1 s" in err, err


def app_has_points(config: AppConfig) -> bool:
    """Some run in the app has a training loss series."""
    try:
        runs = get_json(config.web_url + "api/v1/runs/null")["runs"]
        return any("loss.train" in series(config, run["run_uuid"]) for run in runs)
    except (OSError, KeyError, ValueError):
        return False


def test_an_app_stopped_mid_run_does_not_hang_or_fail_it(tmp_path: Path):
    skip_job_without_gpus(2)  # SMALL's world size
    config = AppConfig(port=free_port(), data_dir=tmp_path / "data")
    app_log = open(tmp_path / "app.log", "w")
    app = subprocess.Popen(
        [sys.executable, "-m", "labml_zero.app", "--port", str(config.port),
         "--data-dir", str(config.data_dir)],
        cwd=tmp_path, env=subprocess_env(), stdout=app_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while app_url_if_running(config.api_url, timeout_s=1.0) is None:
            assert app.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        steps = 150
        job = subprocess.Popen(
            [sys.executable, "-m", "labml_zero.finetune_neox", *SMALL,
             "--steps", str(steps), "--valid-every", str(steps),
             "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs"),
             "--app-url", config.api_url],
            cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        lines: list[tuple[float, str]] = []

        def read(stream) -> None:
            for line in stream:
                lines.append((time.monotonic(), line))

        readers = [threading.Thread(target=read, args=(s,), daemon=True)
                   for s in (job.stdout, job.stderr)]
        for reader in readers:
            reader.start()
        # the app has the run and some of its points: stop the app, as a
        # machine that suspends or a server that hangs would
        deadline = time.monotonic() + 300
        while not app_has_points(config):
            assert job.poll() is None, "".join(line for _, line in lines)[-3000:]
            assert time.monotonic() < deadline, "the app never had the run's points"
            time.sleep(0.5)
        os.kill(app.pid, signal.SIGSTOP)
        job.wait(timeout=240)
        ended = time.monotonic()
        for reader in readers:
            reader.join(timeout=5)
    finally:
        app.kill()
        app.wait(timeout=20)
        app_log.close()
    text = "".join(line for _, line in lines)
    assert job.returncode == 0, text[-3000:]
    last_step = max(t for t, line in lines if f"Sample after {steps} steps" in line)
    # the rank's exit wait, and the launcher's own teardown
    assert ended - last_step < tracking.EXIT_WAIT_S + 10, ended - last_step
    warnings = [line for _, line in lines if "labml app at" in line]
    assert len(warnings) == 1, warnings
    losses = tracked(run_dirs(tmp_path)[0])["loss.train"]
    assert sorted(losses) == list(range(1, steps + 1))


def test_the_local_log_is_complete_when_the_run_ends(tmp_path, monkeypatch):
    """labml's `log.jsonl` writer is a thread the rank's `os._exit` would cut
    short: `local_log_joined` waits for it. Here the writer is slowed, as on
    a loaded host, and the records are all on disk when the wait returns."""
    from labml.internal.tracker.writers import file

    send = file.FileWriterThread._send

    def slow_send(self, data):
        time.sleep(0.3)
        send(self, data)

    monkeypatch.setattr(file.FileWriterThread, "_send", slow_send)
    log = tmp_path / "log.jsonl"
    writer = file.Writer(log)
    writer.flush()  # a step's records
    writer.finish()  # the run's end: the last records, then 'done'
    assert not log.exists()  # still queued in the writer's thread
    tracking.local_log_joined(10.0)
    assert len(log.read_text().splitlines()) == 2


def test_the_run_page_setup_without_an_app_is_quiet_and_bounded(capsys):
    # An app that is not there: the page thread keeps trying without a word
    # (the sender's warning is the one line) and leaves at exit within its wait.
    page = tracking.RunPageSetup(closed_port_url(), "0123456789abcdef")
    assert page.daemon
    page.start()
    time.sleep(2.5 * tracking.PAGE_POLL_S)
    assert page.is_alive()
    started = time.monotonic()
    page.finish()
    assert time.monotonic() - started < tracking.PAGE_EXIT_WAIT_S + 0.5
    assert not page.is_alive()
    assert capsys.readouterr().err == ""


def labml_set_up_output(ctx, log_dir: str, cwd: str) -> str:
    """What a rank prints while `start_labml` sets its run up, in a fresh
    process (labml keeps its project settings in a process-wide object)."""
    import contextlib
    import io

    from labml_zero.finetune import job
    from labml_zero.finetune.config import FinetuneConfig

    os.chdir(cwd)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tracking.start_labml(FinetuneConfig(log_dir=log_dir), ctx,
                             python_file=job.__file__)
    return printed.getvalue()


def test_labml_finds_the_packages_project_file_and_warns_of_nothing(tmp_path):
    """labml looks for a `.labml.yaml` above the file that first calls it and
    above the job's file, and prints a warning box where it finds none: both
    lookups find the package's own, and setting a run up prints nothing. Run
    from this repository, so that no notice about git is kept out either."""
    from labml.internal.lab import Lab

    from labml_zero.finetune import job

    package = Path(tracking.__file__).resolve().parents[1]
    assert (package / ".labml.yaml").is_file()
    for source in (tracking.__file__, job.__file__):
        configs = Lab(Path(source).resolve()).get_info()["configs"]
        assert configs["config_file_path"] == package
    (printed,) = run_distributed(labml_set_up_output, 1, str(tmp_path / "logs"),
                                 str(REPO))
    assert "LABML WARNING" not in printed and ".labml.yaml" not in printed, printed


# ## A run that fails or is interrupted ends in the app


def test_the_wait_at_a_runs_end_goes_on_through_a_signal():
    """The launcher's `SIGTERM` comes to a rank as `Interrupted` in its main
    thread, often while the rank waits for its last records to reach the app:
    the wait goes on to its deadline, which the signal can only bring nearer,
    and returns without raising (SIGUSR1 stands in for the SIGTERM here)."""
    def interrupted(signum, frame):
        raise Interrupted(signal.SIGTERM)

    previous = signal.signal(signal.SIGUSR1, interrupted)
    waits: list[float] = []
    never = threading.Event()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        started = time.monotonic()
        tracking.ExitWait(1.0).run(lambda s: waits.append(s) or never.wait(s))
        took = time.monotonic() - started
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert len(waits) == 2 and waits[1] < waits[0] <= 1.0, waits
    assert 0.9 < took < 1.5, took
    # after a signal, the launcher kills `GRACE_S` later: the wait ends first
    assert tracking.ENDED_WAIT_S < GRACE_S


def test_the_waits_at_a_runs_end_share_one_deadline(tmp_path, capsys):
    """A failed run's last waits (the local log, the sender, the page's last
    look) with an app that takes requests and never answers: all of them
    together within the one deadline, one warning, nothing raised."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/api/v1/default/"
        sender = BoundedSender(url + "track?run_uuid=x", app_url=url, rank=0,
                               log_dir=tmp_path)
        sender.start()
        page = tracking.RunPageSetup(url, "0123456789abcdef")
        page.start()
        sender.push_data_source(SimpleAppTrackDataSource({"status": "crashed"}))
        sender.stop()
        run = tracking.LabmlRun("x", [sender], page)
        started = time.monotonic()
        run.records_sent(tracking.ExitWait(1.5))
        assert time.monotonic() - started < 2.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not take the run's last records" in err


def test_the_last_records_do_not_wait_behind_a_paused_request(
        app, tmp_path):  # noqa: F811 (the app fixture)
    """The app pauses before it answers a request; the run's last records,
    queued while one is in its pause, go beside it: the rank may go as soon
    as they are answered, not a pause later."""
    from labml_zero.app.routes import TRACK_PAUSE_S

    uuid = "00ff00ff00ff00ff00ff00ff00ff00ff"
    sender = BoundedSender(f"{app.api_url}track?run_uuid={uuid}&labml_version=0.5.3",
                           app_url=app.api_url, rank=0, log_dir=tmp_path)
    sender.start()
    sender.push_data_source(SimpleAppTrackDataSource({"name": "paused",
                                                      "time": time.time()}))
    # the app has the first request's records: it is in the app's pause
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline
        try:
            get_json(app.web_url + f"api/v1/run/{uuid}")
            break
        except OSError:  # 404 until the request arrives
            time.sleep(0.01)
    sent = time.monotonic()
    sender.push_data_source(SimpleAppTrackDataSource({"time": time.time(), "status": {
        "rank": 0, "status": "completed", "details": None, "time": time.time()}}))
    sender.stop()
    sender.finish(2 * TRACK_PAUSE_S)
    assert time.monotonic() - sent < TRACK_PAUSE_S / 2
    status = get_json(app.web_url + f"api/v1/run/status/{uuid}")["run_status"]
    assert status["status"] == "completed"


def app_run(config: AppConfig, uuid: str) -> tuple[dict, str]:
    """The app's merged status of a run (every rank's) and the lines of its
    output card."""
    status = get_json(config.web_url + f"api/v1/run/status/{uuid}")["run_status"]
    pages = get_json(config.web_url + f"api/v1/logs/stdout/{uuid}", {})["pages"]
    return status, "".join(pages.values())


def test_a_failed_run_ends_in_the_app_crashed_with_its_lines(
        app, tmp_path):  # noqa: F811 (the app fixture)
    result = finetune(tmp_path, "--steps", "8", "--valid-every", "2",
                      "--sample-tokens", "0", "--app-url", app.api_url,
                      env={FAIL_AT_STEP_ENV: "1:3"})
    # the exit status and the last line a run without the app has
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(
        "python -m labml_zero.finetune_neox: error: rank 1 failed: RuntimeError: "
        "injected failure on rank 1 after step 3")
    uuid = run_dirs(tmp_path)[0].name.split(".")[0]
    status, stdout = app_run(app, uuid)
    # every rank's end reached the app, rank 0's in the runs list
    assert status["status"] == "crashed", status
    listed = {r["run_uuid"]: r for r in get_json(app.web_url + "api/v1/runs/null")
              ["runs"]}
    assert listed[uuid]["run_status"]["status"] == "crashed"
    rank1 = get_json(app.web_url + f"api/v1/run/status/{uuid}_1")["run_status"]
    assert "injected failure on rank 1 after step 3" in rank1["details"], rank1
    # the lines it printed up to the failure
    for line in ("GPT-NeoX: 2 layers", "step 2: loss.valid"):
        assert line in stdout, (line, stdout[-2000:])
    assert "step 4: loss.valid" not in stdout


def test_an_interrupted_run_ends_in_the_app_interrupted_with_its_lines(
        app, tmp_path):  # noqa: F811 (the app fixture)
    skip_job_without_gpus(2)  # SMALL's world size
    job = subprocess.Popen(
        [sys.executable, "-m", "labml_zero.finetune_neox", *SMALL,
         "--steps", "100000", "--valid-every", "2", "--sample-tokens", "0",
         "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs"),
         "--app-url", app.api_url],
        cwd=tmp_path, env=subprocess_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        # the app has the run and its first lines: interrupt it, as Ctrl-C or
        # a scheduler would
        deadline = time.monotonic() + 120
        while True:
            assert job.poll() is None and time.monotonic() < deadline
            try:
                uuid = run_dirs(tmp_path)[0].name.split(".")[0]
                if "step 2: loss.valid" in app_run(app, uuid)[1]:
                    break
            except (OSError, KeyError, ValueError, AssertionError):
                pass
            time.sleep(0.5)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=GRACE_S + 10)
    finally:
        job.kill()
        job.wait()
    # the exit status and the last line a run without the app has
    assert job.returncode == 143
    assert stderr.strip().splitlines()[-1] == (
        "python -m labml_zero.finetune_neox: interrupted")
    assert "Traceback" not in stderr
    status, stdout = app_run(app, uuid)
    assert status["status"] == "interrupted", status
    listed = {r["run_uuid"]: r for r in get_json(app.web_url + "api/v1/runs/null")
              ["runs"]}
    assert listed[uuid]["run_status"]["status"] == "interrupted"
    assert "GPT-NeoX: 2 layers" in stdout and "step 2: loss.valid" in stdout
    # and in labml's own log of every rank
    for rank, run_dir in run_dirs(tmp_path).items():
        ended = (run_dir / "run_log.jsonl").read_text().splitlines()[-1]
        assert '"status": "interrupted"' in ended, (rank, ended)
