r"""
---
title: Launching processes
summary: One process per GPU (NCCL) or several CPU processes (gloo), or torchrun;
  a failing, hanging or interrupted rank ends the whole job with one line.
---

# Launching processes

ZeRO runs one process per rank. This page starts them, on one host (`spawn`)
or under torchrun (`run_torchrun`), and is the only place that creates or
destroys the process group. Either way `fn(ctx)` receives a `DistContext`.
How the launcher watches the ranks is [the next page](supervisor.html).
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labml_zero.launch.supervisor import (Heartbeat, RankFailed, Shared, StderrTail,
                                          die_with_parent, end_all, report, self_watch,
                                          shorten, speak_once, supervise,
                                          tell_torchrun, watchdog)

__all__ = ["DistContext", "Heartbeat", "Interrupted", "RankFailed", "spawn",
           "run_torchrun", "under_torchrun", "free_port", "default_backend",
           "ranks_text"]


class Interrupted(KeyboardInterrupt):
    """
    ## `SIGINT`, `SIGTERM` or `SIGHUP` arrived

    A `KeyboardInterrupt`, so code that handles Ctrl-C handles both;
    `exit_status` follows the shell: 128 (tested:
    tests/test_launch.py::test_exit_status) plus the signal's number, so 130
    (tested: tests/test_launch.py::test_exit_status) for `SIGINT`, 143
    (tested: tests/test_launch.py::test_exit_status) for `SIGTERM` and 129
    (tested: tests/test_launch.py::test_exit_status) for `SIGHUP`.
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_status = 128 + signum


# Without a hang watch, how long a collective waits for a peer.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
# With one, the collectives wait this much longer than the watch.
COLLECTIVE_MARGIN_S = 60.0


def collective_timeout(timeout_s: float | None, hang_timeout: float | None) -> float:
    """
    ### The process group's timeout, above the hang watch

    Two clocks can end a job that stopped moving: the launcher's hang watch $T$
    ([the next page](supervisor.html)) and the process group's own timeout, after
    which a collective raises on a rank that waited for a peer. The rank that
    waits is the healthy one; so the process group's timeout is set above the
    hang watch, to $T$ plus `COLLECTIVE_MARGIN_S`, and the watch, which names the
    rank that is *not* waiting, always speaks first. A timeout given explicitly
    must be above $T$ too.
    """
    if hang_timeout is not None and not hang_timeout > 0:
        raise ValueError(f"hang_timeout must be a positive number of seconds, "
                         f"got {hang_timeout}")
    if timeout_s is None:
        return (DEFAULT_COLLECTIVE_TIMEOUT_S if hang_timeout is None
                else hang_timeout + COLLECTIVE_MARGIN_S)
    if hang_timeout is not None and timeout_s <= hang_timeout:
        raise ValueError(f"the collective timeout {timeout_s:g} s must exceed the "
                         f"hang timeout {hang_timeout:g} s, or a rank waiting for "
                         f"a hung peer is blamed for it")
    return timeout_s


# Signals a whole terminal group gets, which spawned ranks leave to the launcher.
HANDED_TO_LAUNCHER = (signal.SIGINT, signal.SIGHUP)


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def report_unless_interrupted(report_failure: Callable[[], int]) -> int:
    """
    #### A failed rank's report, which the launcher may cut short

    `report_failure()` reports this rank's failure and returns its exit
    status. Once a rank fails, the launcher ends the others, so an echo's
    report (its collective failed because the cause's rank went) may be
    interrupted by that `SIGTERM`. The rank then ends quietly with the
    signal's status, as it would have before it failed, instead of letting
    `Interrupted` escape the handler with a second traceback that hides the
    cause's. Once reported, the rank ignores those signals: it is exiting.
    """
    try:
        status = report_failure()
    except Interrupted as stop:
        status = stop.exit_status
    # the rank ends now: a later signal could only interrupt its exit
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    return status


@dataclass(frozen=True)
class DistContext:
    """
    ## Who this process is

    * `rank`, `world_size`: its place in the process group.
    * `local_rank`: its place on this host (the GPU it uses).
    * `device`: `cuda:<local_rank>` or `cpu`.
    * `backend`: `nccl` or `gloo`.
    * `progress`: where `heartbeat()` counts; `None` when nothing watches.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    progress: Heartbeat | None = field(default=None, repr=False, compare=False)

    def heartbeat(self, step: int | None = None) -> None:
        """Say that this rank made progress (call it once per step), after `step`
        when given: a hang is then reported as after that step."""
        if self.progress is not None:
            self.progress.beat(step)


def ranks_text(n: int) -> str:
    """`1 rank`, `2 ranks`: how every message of a job counts its ranks."""
    return "1 rank" if n == 1 else f"{n} ranks"


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(
    rank: int, world_size: int, local_rank: int, *, backend: str, timeout_s: float,
    progress: Heartbeat | None = None,
) -> DistContext:
    """Create the process group for this process and pick its device."""
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return DistContext(rank, world_size, local_rank, device, backend, progress)


# ## One spawned rank


def _worker(rank: int, fn: Callable[..., Any], world_size: int, backend: str,
            port: int, timeout_s: float, args: tuple, shared: Shared,
            stderr: Any) -> None:
    die_with_parent(shared.parent_pid)
    # stderr into the launcher's pipe (see the supervisor's `StderrTail`)
    os.dup2(stderr.fileno(), 2)
    stderr.close()
    # A rank turns `SIGTERM` into an exception so that `finally` blocks run (a
    # checkpoint being written removes its temporary directory; the one in place
    # is never touched), then exits without a word. Ranks ignore `SIGINT` and
    # `SIGHUP`: a Ctrl-C or a hangup reaches every process of the terminal's
    # group, and only the launcher should decide.
    for signum in HANDED_TO_LAUNCHER:
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    threading.Thread(target=watchdog, args=(shared, rank), daemon=True).start()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "gloo":
        # Ranks share the host's cores: an equal share each keeps them from fighting.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    status = 0
    try:
        ctx = init(rank, world_size, rank, backend=backend, timeout_s=timeout_s,
                   progress=Heartbeat(shared.beats, rank, shared.steps))
        fn(ctx, *args)
        dist.destroy_process_group()
    except Interrupted as stop:
        status = stop.exit_status
    except BaseException as error:
        if not (isinstance(error, SystemExit) and error.code in (None, 0)):
            def report_failure() -> int:
                # Reported before this process closes its connections: before
                # any echo.
                shared.send(report(rank, error))
                return 1

            status = report_unless_interrupted(report_failure)
    end_rank(status)


def end_rank(status: int) -> None:
    """
    #### End a rank without the interpreter's C++ teardown

    After a rank's work is done, the C++ objects torch and gloo leave for the
    interpreter's last teardown sometimes abort there, with no Python frame
    left ("terminate called without an active exception"; more often on a
    loaded host), and the launcher would report a finished run as a rank dead
    by `SIGABRT`. So a rank ends itself: after a success it runs its exit
    handlers as a normal exit would (the tracker's last records are sent in
    one), then every rank flushes its output and leaves with `os._exit`, which
    skips that teardown. Threads still running are not joined: the work they
    served (host updates, checkpoint writes) was awaited before `fn` returned.
    """
    if status == 0:
        # `atexit._run_exitfuncs`: CPython's own exit step, not a documented API
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Signals:
    """
    #### `SIGINT`, `SIGTERM` and `SIGHUP` raise `Interrupted` while the job runs

    `SIGINT` (Ctrl-C), `SIGTERM` and `SIGHUP` (the terminal closed, the SSH
    session lost) to the launcher raise `Interrupted` in it; it
    then sends `SIGTERM` to every rank, and `SIGKILL` to any still alive after the
    grace period, so every rank has ended within $p + g$ of the signal (the
    poll period and the grace period of [the supervisor](supervisor.html)). If the
    launcher was started with one of them ignored (`nohup` ignores `SIGHUP`, a
    script's background job `SIGINT`), it stays ignored, and `SIGTERM` still ends the job. Only the main
    thread may set handlers; elsewhere this does nothing.
    """

    def __enter__(self) -> "Signals":
        self.saved = {}
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self.saved[signum] = signal.getsignal(signum)
            if self.saved[signum] is not signal.SIG_IGN:
                signal.signal(signum, _raise_interrupted)
        return self

    def start(self, process: Any, started: list[Any]) -> None:
        """
        Start a rank and list it in `started`. A rank's interpreter takes a
        while to start (the launcher waits for it to read its arguments), and
        a signal then must neither be lost nor cut the start in half, leaving
        a process the launcher does not know: it is kept, and
        raised as `Interrupted` once the rank is listed, so that it is ended
        with the others. The rank ignores `SIGINT` and `SIGHUP` from the first
        line of `_worker` on.
        """
        if not self.saved:
            process.start()
            started.append(process)
            return
        arrived: list[int] = []
        handlers = {s: signal.signal(s, lambda signum, _: arrived.append(signum))
                    for s, saved in self.saved.items() if saved is not signal.SIG_IGN}
        try:
            process.start()
            started.append(process)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        if arrived:
            raise Interrupted(arrived[0])

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


def start_resource_tracker() -> None:
    """
    #### multiprocessing's helper process, started with `SIGHUP` ignored

    The shared lock and arrays need multiprocessing's resource tracker, a
    process in the terminal's group that ignores `SIGINT` and `SIGTERM` but
    would die of a hangup; started here first, it inherits `SIGHUP` ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        return resource_tracker.ensure_running()
    handler = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, handler)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float | None = None,
    hang_timeout: float | None = None,
) -> None:
    """
    ## Run `fn(ctx, *args)` in `world_size` processes on this host

    They rendezvous on loopback at a free port; with CUDA each process takes
    GPU `rank` and NCCL, without it gloo on CPU. `fn` must be importable (a
    module-level function) because the processes are
    started with `spawn`, not `fork` (CUDA cannot be forked). Raises `RankFailed`
    if a rank fails or stops beating for `hang_timeout` seconds, `Interrupted` on
    `SIGINT`/`SIGTERM`; either way every rank has ended when it returns.
    `timeout_s` is the process group's (`collective_timeout` by default). Every
    rank must see the same number of GPUs (`CUDA_VISIBLE_DEVICES`); signals are
    handled only when `spawn` runs in the main thread (Python's rule).
    """
    backend = backend or default_backend()
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"world_size {world_size} needs {world_size} GPUs, "
            f"found {torch.cuda.device_count()}"
        )
    timeout_s = collective_timeout(timeout_s, hang_timeout)
    context = mp.get_context("spawn")
    start_resource_tracker()
    shared = Shared.create(context, world_size)
    port = free_port()
    processes: list[Any] = []
    tails: list[StderrTail] = []
    with Signals() as signals:
        try:
            for rank in range(world_size):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=_worker, name=f"rank {rank}", args=(
                        rank, fn, world_size, backend, port, timeout_s, args, shared,
                        writer))
                signals.start(process, processes)
                writer.close()  # the rank holds the only write end: EOF at its end
                tails.append(StderrTail(os.dup(reader.fileno())))
                reader.close()
            failure = supervise(processes, shared, hang_timeout, tails)
        finally:
            end_all(processes)
            shared.close()
            for tail in tails:  # what the ranks wrote last, before our last line
                tail.thread.join(1.0)
    if failure is not None:
        raise failure


# ## Under torchrun


def under_torchrun() -> bool:
    return (
        "RANK" in os.environ
        and "WORLD_SIZE" in os.environ
        and "LOCAL_RANK" in os.environ
    )


def run_torchrun(
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout_s: float | None = None,
    hang_timeout: float | None = None,
) -> None:
    """
    ## Run `fn(ctx, *args)` in a process started by torchrun

    For several hosts: the processes already exist and `RANK`, `WORLD_SIZE`,
    `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` say who they are. torchrun
    is the launcher here: it ends the other ranks when one exits non-zero.
    This rank dies with its node agent, turns `SIGINT`/`SIGTERM` into a silent exit
    (with `Interrupted.exit_status`), and on failure prints its traceback and one line
    `rank r failed: …` (an echo: only `rank r stopped: …`), then exits with 1.
    """
    backend = backend or default_backend()
    timeout_s = collective_timeout(timeout_s, hang_timeout)
    rank = int(os.environ["RANK"])
    die_with_parent(os.getppid())
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupted)
    progress = Heartbeat([0], 0, [-1])
    if hang_timeout is not None:
        threading.Thread(target=self_watch, args=(progress, rank, hang_timeout),
                         daemon=True).start()
    try:
        ctx = init(rank, int(os.environ["WORLD_SIZE"]),
                   int(os.environ["LOCAL_RANK"]), backend=backend,
                   timeout_s=timeout_s, progress=progress)
        fn(ctx, *args)
        dist.destroy_process_group()
    except Interrupted as stop:
        sys.stdout.flush()
        os._exit(stop.exit_status)
    except Exception as error:
        status = report_unless_interrupted(lambda: _torchrun_report(rank, error))
        sys.stdout.flush()
        os._exit(status)


def _torchrun_report(rank: int, error: Exception) -> int:
    """
    #### A torchrun rank's failure: its traceback and one line, or an echo's line

    Returns the exit status, 1.
    """
    if not speak_once(wait_s=30.0):
        # the hang watchdog spoke first and is ending the process
        return 1
    sent = report(rank, error)
    if sent["echo"]:  # its traceback would only hide the cause's
        line = (f"rank {rank} stopped: another rank failed or is gone: "
                f"{shorten(sent['line'])}")
        print(line, file=sys.stderr, flush=True)
    else:
        line = f"rank {rank} failed: {sent['line']}"
        print(f"{sent['traceback']}{line}", file=sys.stderr, flush=True)
    tell_torchrun(line, line if sent["echo"] else sent["traceback"],
                  echo=sent["echo"])
    return 1
