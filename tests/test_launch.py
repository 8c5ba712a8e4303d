"""The launcher: a failing rank's own cause reaches the caller, echoes of it do not;
a rank that dies or hangs is named; SIGINT and SIGTERM end every rank; no rank
outlives its launcher, even one killed by SIGKILL.

CPU, gloo, 2 ranks. The rank bodies are module-level functions (processes spawn).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labml_zero import launch
from labml_zero.launch import supervisor
from labml_zero.launch.spawn import Signals
from tests.distributed import skip_job_without_gpus

REPO = Path(__file__).resolve().parent.parent


# ## Rank bodies


def agree(ctx: launch.DistContext, out_dir: str) -> None:
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    Path(out_dir, f"rank{ctx.rank}").write_text(str(total.item()))


def exit_early(ctx: launch.DistContext) -> None:
    sys.exit(0 if ctx.rank == 0 else "rank 1 gives up")


def raise_on_rank_1(ctx: launch.DistContext) -> None:
    t = torch.zeros(1)
    dist.all_reduce(t)
    if ctx.rank == 1:
        raise ValueError("distinctive cause 4711")
    # rank 0 waits for a peer that will never come: its error is an echo
    dist.all_reduce(t)


def echo_first(ctx: launch.DistContext) -> None:
    # rank 0's echo reaches the launcher before rank 1's own error
    if ctx.rank == 0:
        raise RuntimeError("save failed on rank 1; see its error")
    time.sleep(0.5)
    raise OSError(28, "No space left on device")


def killed_rank_1(ctx: launch.DistContext) -> None:
    t = torch.zeros(1)
    dist.all_reduce(t)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)


def abort_after_words_on_rank_1(ctx: launch.DistContext) -> None:
    t = torch.zeros(1)
    dist.all_reduce(t)
    if ctx.rank == 1:
        # what a C++ library prints before abort(): straight to file descriptor 2
        os.write(2, b"terminate called after throwing an instance of 'Err'\n"
                    b"  what():  distinctive words 1234\n")
        os.kill(os.getpid(), signal.SIGABRT)
    dist.all_reduce(t)


def sleepy_rank_1(ctx: launch.DistContext) -> None:
    t = torch.zeros(1)
    for step in range(1000):
        if ctx.rank == 1 and step == 2:
            time.sleep(600)
        dist.all_reduce(t)
        ctx.heartbeat(step)


def gil_holding_rank_1(ctx: launch.DistContext) -> None:
    t = torch.zeros(1)
    for step in range(1000):
        if ctx.rank == 1 and step == 2:
            # libc's sleep through a `PyDLL` keeps the GIL: no thread of this
            # rank runs, its watchdog neither
            ctypes.PyDLL(None).sleep(600)
        dist.all_reduce(t)
        ctx.heartbeat(step)


def forever(ctx: launch.DistContext, out_dir: str) -> None:
    t = torch.zeros(1)
    dist.all_reduce(t)
    Path(out_dir, f"pid{ctx.rank}").write_text(str(os.getpid()))
    while True:
        dist.all_reduce(t)
        ctx.heartbeat()
        time.sleep(0.01)


def exit_handler_writes(ctx: launch.DistContext, out_dir: str) -> None:
    import atexit
    path = Path(out_dir) / f"atexit{ctx.rank}"
    atexit.register(path.write_text, "ran")


# ## In process


def test_ranks_run_and_return(tmp_path: Path):
    launch.spawn(agree, 2, str(tmp_path), backend="gloo")
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["3.0", "3.0"]


def test_a_finished_rank_runs_its_exit_handlers_and_skips_the_teardown(
        tmp_path: Path):
    """A rank ends with `os._exit` (no C++ teardown to abort in), after its
    exit handlers ran, as the tracker's last records need."""
    launch.spawn(exit_handler_writes, 2, str(tmp_path), backend="gloo")
    assert [(tmp_path / f"atexit{r}").read_text() for r in (0, 1)] == ["ran", "ran"]


def test_failing_rank_cause_not_its_echo(tmp_path: Path, monkeypatch):
    # every process's temporary directory: the launcher's and the ranks'
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(launch.RankFailed) as caught:
        launch.spawn(raise_on_rank_1, 2, backend="gloo")
    error = caught.value
    assert error.rank == 1
    assert str(error).startswith("rank 1 failed: ValueError: distinctive cause 4711")
    assert "tests/test_launch.py:" in str(error) and "raise_on_rank_1" in str(error)
    assert "Traceback" in error.traceback and "4711" in error.traceback
    assert len(str(error).splitlines()) == 1
    # no error files (pytorch-errorfile-*.pickle) or anything else left behind
    assert list(tmp_path.iterdir()) == []


def test_sys_exit_zero_is_success_and_a_message_is_a_failure():
    with pytest.raises(launch.RankFailed) as caught:
        launch.spawn(exit_early, 2, backend="gloo")
    assert str(caught.value).startswith("rank 1 failed: SystemExit: rank 1 gives up")


def test_echo_that_arrives_first_is_not_the_cause(monkeypatch):
    # Rank 1 reports half a second after rank 0's echo; on a loaded test machine
    # its process may wait for a core longer than the launcher's report window,
    # which is sized for a training host. A wider window costs nothing here:
    # the launcher stops waiting as soon as every rank has exited.
    monkeypatch.setattr(supervisor, "REPORT_WINDOW_S", 30.0)
    with pytest.raises(launch.RankFailed) as caught:
        launch.spawn(echo_first, 2, backend="gloo")
    assert str(caught.value).startswith(
        "rank 1 failed: OSError: [Errno 28] No space left on device")
    (echo,) = caught.value.others
    assert echo.startswith("rank 0 then: RuntimeError: save failed on rank 1; see "
                           "its error (tests/test_launch.py:"), echo
    assert echo.endswith(" in echo_first)"), echo


def test_killed_rank_is_named():
    start = time.monotonic()
    with pytest.raises(launch.RankFailed) as caught:
        launch.spawn(killed_rank_1, 2, backend="gloo")
    assert str(caught.value).startswith("rank 1 died (signal SIGKILL), printing "
                                        "nothing: killed from outside")
    assert "out-of-memory killer" in str(caught.value)
    assert time.monotonic() - start < 60


def test_a_rank_killed_by_a_signal_is_named_with_its_last_stderr_lines(capfd):
    with pytest.raises(launch.RankFailed) as caught:
        launch.spawn(abort_after_words_on_rank_1, 2, backend="gloo")
    message = str(caught.value)
    assert message.startswith("rank 1 died (signal SIGABRT); its last words on "
                              "stderr: terminate called after throwing"), message
    assert message.endswith("what(): distinctive words 1234"), message
    assert "\n" not in message
    # and the words still reached the launcher's stderr as they were written
    assert "distinctive words 1234" in capfd.readouterr().err


@pytest.mark.parametrize("body, place, tail", [
    # steps 0 and 1 done: the message names the last step, as the rank did
    (sleepy_rank_1, "at tests/test_launch.py:", "in sleepy_rank_1"),
    # its watchdog cannot publish either; SIGTERM waits for the GIL, so the
    # rank ends at SIGKILL, a grace later
    (gil_holding_rank_1, "last seen at ",
     "(its threads stopped too: its main thread holds the GIL, or the "
     "process is stopped)"),
])
def test_hanging_rank_is_named_within_the_timeout(body, place, tail):
    start = time.monotonic()
    with pytest.raises(launch.RankFailed) as caught:
        launch.spawn(body, 2, backend="gloo", hang_timeout=2.0)
    message = str(caught.value)
    assert message.startswith("rank 1 stopped making progress: no heartbeat for 2 s "
                              "after step 1, " + place), message
    assert message.endswith(tail), message
    # spawn of two ranks, two beats, then the timeout and the end of both ranks
    assert time.monotonic() - start < 60


def test_exit_status():
    for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143),
                           (signal.SIGHUP, 129)):
        stop = launch.Interrupted(signum)
        assert isinstance(stop, KeyboardInterrupt)
        assert stop.exit_status == 128 + signum == status


def test_a_report_cut_short_by_the_launcher_ends_quietly():
    # an echo's report, interrupted by the SIGTERM that ends the ranks, gives
    # that signal's status instead of a second traceback; then the rank,
    # which is exiting, ignores the signals
    from labml_zero.launch.spawn import report_unless_interrupted

    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        def cut_short() -> int:
            raise launch.Interrupted(signal.SIGTERM)

        assert report_unless_interrupted(cut_short) == 143
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in signums)
        assert report_unless_interrupted(lambda: 1) == 1
        with pytest.raises(ValueError, match="not an interruption"):
            report_unless_interrupted(lambda: (_ for _ in ()).throw(
                ValueError("not an interruption")))
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_collectives_wait_longer_than_the_hang_watch():
    # a healthy rank waiting in a collective for a hung peer must not time out
    # (and be named) before the watch names the hung one
    from labml_zero.finetune.config import FinetuneConfig
    from labml_zero.launch.spawn import (COLLECTIVE_MARGIN_S,
                                         DEFAULT_COLLECTIVE_TIMEOUT_S,
                                         collective_timeout)

    default = FinetuneConfig().hang_timeout
    assert 60 <= default <= 300  # minutes, not ten
    assert collective_timeout(None, default) == default + COLLECTIVE_MARGIN_S
    assert collective_timeout(None, None) == DEFAULT_COLLECTIVE_TIMEOUT_S
    assert collective_timeout(30.0, 10.0) == 30.0
    with pytest.raises(ValueError, match="must exceed the hang timeout 10 s"):
        launch.spawn(agree, 2, "unused", backend="gloo", timeout_s=10.0,
                     hang_timeout=10.0)


def test_bad_hang_timeout_is_refused():
    with pytest.raises(ValueError, match="hang_timeout must be a positive"):
        launch.spawn(agree, 2, "unused", backend="gloo", hang_timeout=0)


# ## The launcher as a process, with signals

JOB = """
import sys
from labml_zero import launch
from tests.test_launch import forever
try:
    launch.spawn(forever, 2, sys.argv[1], backend="gloo")
except KeyboardInterrupt as e:
    print("interrupted", file=sys.stderr)
    sys.exit(e.exit_status)
"""


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def start_job(tmp: Path, *, ignore_sigint: bool = False,
              new_session: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """The launcher in its own process, once both ranks are training."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def dispositions() -> None:
        # the launcher keeps a signal its parent ignored ignored (as under
        # nohup, which a test runner may be started with): each test starts
        # it from the default ones, or with SIGINT ignored
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    job = subprocess.Popen([sys.executable, "-c", JOB, str(tmp)], env=env,
                           stderr=subprocess.PIPE, text=True,
                           preexec_fn=dispositions,
                           start_new_session=new_session)
    deadline = time.monotonic() + 90
    while not all((tmp / f"pid{r}").exists() for r in (0, 1)):
        if time.monotonic() > deadline or job.poll() is not None:
            job.kill()
            raise AssertionError(f"ranks did not start: {job.communicate()[1]}")
        time.sleep(0.1)
    time.sleep(0.2)  # the pid is written before the file is closed
    return job, [int((tmp / f"pid{r}").read_text()) for r in (0, 1)]


def wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until every pid is gone; fails (killing them) after `timeout`."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start > timeout:
            for pid in filter(alive, pids):
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"ranks still alive after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


# How long a signalled launcher may take to end: the supervisor's bound, a poll
# and the grace before SIGKILL, with slack for a loaded host (a CI machine
# running other tests beside it), which still fails a launcher that hangs.
def signalled_end_s() -> float:
    from labml_zero.launch.supervisor import GRACE_S, POLL_S
    return 3 * (POLL_S + GRACE_S) + 10


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130),
                                            (signal.SIGTERM, 143),
                                            (signal.SIGHUP, 129)])
def test_signal_ends_every_rank(tmp_path: Path, signum: int, status: int):
    job, ranks = start_job(tmp_path)
    try:
        job.send_signal(signum)
        _, stderr = job.communicate(timeout=signalled_end_s())
        assert job.returncode == status
        assert stderr.strip() == "interrupted"  # no traceback from anyone
        wait_gone(ranks, 1)
    finally:
        job.kill()
        wait_gone(ranks, 10)


def test_a_hangup_of_the_whole_group_ends_the_job_like_sigterm(tmp_path: Path):
    # a closed terminal sends SIGHUP to every process of its group, ranks too:
    # they leave it to the launcher, which ends them and says one word
    job, ranks = start_job(tmp_path, new_session=True)
    try:
        os.killpg(job.pid, signal.SIGHUP)
        _, stderr = job.communicate(timeout=signalled_end_s())
        assert job.returncode == 129
        assert stderr.strip() == "interrupted"
        wait_gone(ranks, 1)
    finally:
        job.kill()
        wait_gone(ranks, 10)


def test_ignored_sigint_stays_ignored_and_sigterm_ends_all(tmp_path: Path):
    job, ranks = start_job(tmp_path, ignore_sigint=True)
    try:
        job.send_signal(signal.SIGINT)
        time.sleep(1)
        assert job.poll() is None and all(alive(p) for p in ranks)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=signalled_end_s())
        assert job.returncode == 143 and stderr.strip() == "interrupted"
        wait_gone(ranks, 1)
    finally:
        job.kill()
        wait_gone(ranks, 10)


def test_ranks_die_with_a_killed_launcher(tmp_path: Path):
    job, ranks = start_job(tmp_path)
    try:
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=10)
        assert wait_gone(ranks, 10) < 10
    finally:
        job.kill()
        wait_gone(ranks, 10)


# ## The fine-tune's launcher


def test_fine_tune_stops_on_sigterm_and_leaves_only_whole_checkpoints(
        tmp_path: Path):
    skip_job_without_gpus(2)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    checkpoints = tmp_path / "out" / "checkpoints"
    job = subprocess.Popen(
        [sys.executable, "-m", "labml_zero.finetune_neox", "--world-size", "2",
         "--batch-size", "2", "--seq-len", "32", "--steps", "100000",
         "--valid-every", "100000", "--checkpoint-every", "2", "--sample-tokens",
         "0", "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 120
        while not (checkpoints / "step-000002").is_dir():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
        # stopped while it trains or writes the next checkpoint
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=10)
        assert job.returncode == 143
        assert stderr.strip().splitlines()[-1] == (
            "python -m labml_zero.finetune_neox: interrupted")
        assert "Traceback" not in stderr
        names = sorted(p.name for p in checkpoints.iterdir())
        assert names and all(n.startswith("step-") for n in names), names
        assert all((checkpoints / n / "manifest.json").is_file() for n in names)
    finally:
        job.kill()
        job.wait()
        shutil.rmtree(tmp_path / "out", ignore_errors=True)  # about 90 MB each


# ## Under torchrun

TORCHRUN_BODY = """
import sys
from labml_zero import launch
from tests import test_launch
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
launch.run_torchrun(getattr(test_launch, sys.argv[1]), backend="gloo",
                    hang_timeout=timeout)
"""


def torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    body = tmp / "body.py"
    body.write_text(TORCHRUN_BODY)
    # torchrun keeps a log directory per run in the temporary directory
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp)}
    return subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone",
         "--nproc-per-node", "2", str(body), *args],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=120)


def test_torchrun_rank_prints_its_cause_and_the_echo_one_line(tmp_path: Path):
    result = torchrun(tmp_path, "raise_on_rank_1")
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    cause = [x for x in lines if x.startswith("rank 1 failed: ")]
    assert len(cause) == 1 and cause[0].startswith(
        "rank 1 failed: ValueError: distinctive cause 4711 (tests/test_launch.py:")
    # rank 0 either saw the peer go (one line, no traceback) or was ended quietly
    assert not any(x.startswith("rank 0 failed") for x in lines)
    # and rank 0's own traceback is not printed, only rank 1's (and torchrun's)
    assert "work.wait()" not in result.stderr.split("ChildFailedError")[0]
    # torchrun's own summary calls rank 1 the root cause, not its echo on rank 0
    root = result.stderr.split("Root Cause")[1]
    assert re.search(r"rank\s*:\s*1\b", root) and "4711" in root, root


def test_torchrun_hang_is_named_by_the_rank_that_stopped(tmp_path: Path):
    start = time.monotonic()
    result = torchrun(tmp_path, "sleepy_rank_1", "2")
    assert result.returncode != 0
    hung = [x for x in result.stderr.splitlines() if "stopped making progress" in x]
    assert len(hung) == 1, result.stderr[-3000:]
    assert hung[0].startswith("rank 1 stopped making progress: no heartbeat for 2 s "
                              "after step 1, at tests/test_launch.py:")
    assert hung[0].endswith(" in sleepy_rank_1")
    assert time.monotonic() - start < 90


def test_torchrun_names_the_peer_that_hung_holding_the_gil(tmp_path: Path):
    # rank 1's watchdog cannot run, so rank 0, waiting in the collective, is
    # the one that speaks: it says it waited, not that it stopped
    result = torchrun(tmp_path, "gil_holding_rank_1", "2")
    assert result.returncode != 0
    lines = [x for x in result.stderr.splitlines()
             if x.startswith("rank 0 waited 4 s in a collective after step 1, at ")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].endswith(", for a peer that stopped without a word (its main "
                             "thread may hold the GIL)")
    assert "stopped making progress" not in result.stderr


def test_a_hang_watchdog_stays_silent_while_its_rank_reports(capsys, monkeypatch):
    """
    The race behind a flaky torchrun hang: rank 0's collective fails because
    rank 1 stopped, and while rank 0's main thread reports that, its own
    watchdog's deadline passes. Whoever speaks first holds `speak_once`; the
    watchdog that comes second returns without a word (and without exiting).
    """
    import threading

    from labml_zero.launch import supervisor

    monkeypatch.setattr(supervisor, "_SPEAKING", threading.Lock())
    monkeypatch.setattr(supervisor, "POLL_S", 0.01)
    exits = []
    monkeypatch.setattr(supervisor.os, "_exit", exits.append)
    assert supervisor.speak_once()  # the main thread is reporting
    progress = supervisor.Heartbeat([1], 0)  # one beat, then nothing
    watch = threading.Thread(target=supervisor.self_watch,
                             args=(progress, 0, 0.05), daemon=True)
    watch.start()
    watch.join(5)
    assert not watch.is_alive() and exits == []
    assert "stopped making progress" not in capsys.readouterr().err
    # the second voice of a main thread waits at most `wait_s`, then gives up
    assert supervisor.speak_once(wait_s=0.05) is False


class _StartsSlowly:
    """A rank whose start takes long enough for a signal to arrive meanwhile."""

    def __init__(self, signum: int):
        self.signum = signum

    def start(self) -> None:
        os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_a_rank_starts_is_raised_once_it_is_listed(signum: int):
    # Ignoring the signal meanwhile (so that the rank inherits it ignored)
    # would lose it: the job would train on after a Ctrl-C.
    started: list = []
    rank = _StartsSlowly(signum)
    with pytest.raises(launch.Interrupted) as stop, Signals() as signals:
        signals.start(rank, started)
    assert stop.value.exit_status == 128 + signum and started == [rank]


def test_a_signal_ignored_at_launch_stays_ignored_while_a_rank_starts():
    started: list = []
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Signals() as signals:
            signals.start(_StartsSlowly(signal.SIGHUP), started)
    finally:
        signal.signal(signal.SIGHUP, saved)
    assert len(started) == 1
