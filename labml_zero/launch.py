r"""
---
title: Launching processes
summary: One process per GPU (NCCL) or several CPU processes (gloo), or torchrun;
  a failing, hanging or interrupted rank ends the whole job with one line that says why.
---

# Launching processes

ZeRO runs one process per rank. This page starts them, watches them, and is the
only place that creates or destroys the process group:

* **one host**: `spawn(fn, world_size)` starts `world_size` processes,
  rendezvous on loopback at a free port; with CUDA each process takes GPU `rank`
  and NCCL, without it gloo on CPU;
* **torchrun** (several hosts): the processes already exist and `RANK`,
  `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` say who they are;
  `run_torchrun(fn)` reads them.

Either way `fn(ctx)` receives a `DistContext` with the rank, the world size and the
device, and `ctx.heartbeat()` to call once per step.

The ranks of a ZeRO-3 job move in lockstep: every step is a chain of collectives
that all $N$ ranks must join. So when one rank stops, by an exception, a signal or a
hang, every other rank stops at its next collective, and each of them then reports
an error of its own. The launcher's job is to tell the *first* failure from these
echoes, end every process within a bounded time, and say in one line what happened.
With a report window $w$, a grace period $g$ between `SIGTERM` and `SIGKILL` and a
poll period $p$, the job is over at most

$$t_{\text{end}} \le t_{\text{first failure}} + p + w + g$$

after the first failure, and $p + g$ after an interruption.

## Failure

Each spawned rank catches its own exception and, *before* it closes its
connections, writes a report (type, message, the innermost `file:line` outside
torch, its traceback) into one pipe shared by all ranks. A peer can only see the
failure once the connections close, so the cause is in the pipe before any echo.
Echoes are recognised as well: `torch.distributed.DistError` (a collective that
lost its peer) and errors saying that another rank failed. `spawn` raises
`RankFailed` naming the first rank whose error is not an echo; a rank that died
without a report (a signal, `os._exit`) comes next; an echo is named only if
nothing else is known. Nothing is written to disk, so no error files are left
behind.

## Signals

`SIGINT` (Ctrl-C) and `SIGTERM` to the launcher raise `Interrupted` in it; it then
sends `SIGTERM` to every rank, and `SIGKILL` to any still alive after the grace
period. A rank turns `SIGTERM` into an exception so that `finally` blocks run (a
checkpoint being written removes its temporary directory; the one in place is never
touched), then exits silently. Ranks ignore `SIGINT`: a Ctrl-C in a terminal reaches
every process of the foreground group, and only the launcher should decide. If the
launcher was started with `SIGINT` ignored (`nohup`, a script's background job), it
stays ignored and `SIGTERM` still ends the job. A rank never outlives the launcher:
on Linux it asks the kernel for `SIGKILL` when its parent dies
(`prctl(PR_SET_PDEATHSIG)`), and everywhere a watchdog thread polls the parent's pid.

## Hangs

With `hang_timeout` $T$ set, the launcher watches each rank's heartbeat count. A
rank whose count has not moved for $T$ seconds (after its first beat: loading is
not watched) has stopped; since the others then wait for it in a collective,
they stop too. To name the right one, each rank's watchdog thread publishes where
its main thread is: a rank whose innermost frame is inside `torch.distributed` is
waiting for a peer, so the rank named is one that is *not* waiting, then the one
with the fewest beats.

## Limitations

* On one host every rank must see the same number of GPUs (`CUDA_VISIBLE_DEVICES`).
* Under torchrun each rank watches only its own heartbeat; a rank waiting in a
  collective gives the others $T$ more seconds to be the one that reports. With
  NCCL the host waits outside `torch.distributed` (at `.item()`), so the waiting
  test cannot tell the ranks apart; the one with the fewest beats is named.
* Signals are handled only when `spawn` runs in the main thread (Python's rule).
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds between the launcher's looks at the ranks; also the watchdog's period.
POLL_S = 0.25
# After the first failure, how long the other ranks get to send their reports.
REPORT_WINDOW_S = 2.0
# Between SIGTERM and SIGKILL when the launcher ends the ranks.
GRACE_S = 5.0
# Bytes of "file:line in function" each rank publishes about its main thread.
WHERE_BYTES = 200

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
DIST_DIR = os.path.join(TORCH_DIR, "distributed") + os.sep
REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# What an error says when it only echoes another rank's failure.
ECHO_SIGNS = ("failed on rank", "Connection closed by peer",
              "Connection reset by peer", "Broken pipe")


class RankFailed(RuntimeError):
    """
    ## A rank raised, died or hung

    `str(error)` is the one line for the user (`rank 1 failed: OSError: … (file:line)`);
    `rank` is the rank it names, `traceback` that rank's traceback (empty if it
    died without one) and `others` one line per rank that failed after it.
    """

    def __init__(self, rank: int, cause: str, *, traceback_text: str = "",
                 others: tuple[str, ...] = ()):
        super().__init__(f"rank {rank} {cause}")
        self.rank = rank
        self.traceback = traceback_text
        self.others = others


class Interrupted(KeyboardInterrupt):
    """
    ## `SIGINT` or `SIGTERM` arrived

    A `KeyboardInterrupt`, so code that handles Ctrl-C handles both;
    `exit_status` is the shell's convention, $128 + \\text{signal}$ (130, 143).
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_status = 128 + signum


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


class Heartbeat:
    """
    ## A rank's progress count

    `counts[slot]` is in memory the watcher reads: a shared array on one host (the
    launcher is another process), a plain list under torchrun (the watcher is a
    thread of this process). Only this rank writes its slot.
    """

    def __init__(self, counts: Any, slot: int):
        self.counts = counts
        self.slot = slot

    def beat(self) -> None:
        self.counts[self.slot] += 1

    def count(self) -> int:
        return self.counts[self.slot]


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

    def heartbeat(self) -> None:
        """Say that this rank made progress (call it once per step)."""
        if self.progress is not None:
            self.progress.beat()


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


# ## What a rank says about itself


def short_path(path: str) -> str:
    """A source path relative to this repository when it is inside it."""
    return path[len(REPO_DIR):] if path.startswith(REPO_DIR) else path


def location(frames: list[tuple[str, int, str]]) -> str:
    """
    #### The innermost `file:line in function` outside torch

    `frames` run outermost first. Torch's own frames rarely say what the job was
    doing; the innermost frame of ours (or the user's) does.
    """
    ours = [f for f in frames if not f[0].startswith(TORCH_DIR)] or frames
    if not ours:
        return ""
    path, line, name = ours[-1]
    return f"{short_path(path)}:{line} in {name}"


def is_echo(error: BaseException) -> bool:
    """An error that only reports that another rank failed (see Failure above)."""
    seen = error
    while seen is not None:
        if isinstance(seen, dist.DistError) or any(
                sign in str(seen) for sign in ECHO_SIGNS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def report(rank: int, error: BaseException) -> dict:
    """Plain strings only: the exception itself may not pickle."""
    frames = [(f.filename, f.lineno or 0, f.name)
              for f in traceback.extract_tb(error.__traceback__)]
    message = " ".join(str(error).split()) or "(no message)"
    where = location(frames)
    return {"rank": rank, "echo": is_echo(error),
            "line": f"{type(error).__name__}: {message}"
                    + (f" ({where})" if where else ""),
            "traceback": "".join(traceback.format_exception(error))}


def main_thread_where() -> tuple[str, bool]:
    """
    #### Where the main thread is, and whether it waits for a peer

    `sys._current_frames` is the documented way to see another thread's stack.
    """
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "", False
    waiting = frame.f_code.co_filename.startswith(DIST_DIR)
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return location(frames[::-1]), waiting


# ## Staying tied to the parent


def die_with_parent(parent_pid: int) -> None:
    """
    #### `SIGKILL` this process when its parent dies (Linux)

    `PR_SET_PDEATHSIG` (1) is kept across the rest of this process's life; if the
    parent died before the call, the signal will never come, hence the check.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


@dataclass
class Shared:
    """
    ## What the launcher and its ranks share

    * `reports`: the pipe of failure reports, one writer at a time (a lock), so a
      report is whole and ordered by when it was written.
    * `beats`: the heartbeat count of each rank.
    * `waiting`: 1 while a rank's main thread is inside `torch.distributed`.
    * `where`: `WHERE_BYTES` per rank, its main thread's location.
    """

    parent_pid: int
    reports: Any
    beats: Any
    waiting: Any
    where: Any

    @classmethod
    def create(cls, context: Any, world_size: int) -> "Shared":
        return cls(os.getpid(), context.SimpleQueue(),
                   context.Array("q", world_size, lock=False),
                   context.Array("b", world_size, lock=False),
                   context.Array("c", world_size * WHERE_BYTES, lock=False))

    def publish(self, rank: int) -> None:
        where, waiting = main_thread_where()
        data = where.encode()[:WHERE_BYTES].ljust(WHERE_BYTES, b"\0")
        self.where[rank * WHERE_BYTES:(rank + 1) * WHERE_BYTES] = data
        self.waiting[rank] = int(waiting)

    def where_of(self, rank: int) -> str:
        data = self.where[rank * WHERE_BYTES:(rank + 1) * WHERE_BYTES]
        return data.rstrip(b"\0").decode(errors="replace")


def watchdog(shared: Shared, rank: int) -> None:
    """A rank's thread: end the rank if the launcher is gone; say where it is."""
    while True:
        if os.getppid() != shared.parent_pid:
            os._exit(1)
        shared.publish(rank)
        time.sleep(POLL_S)


# ## One spawned rank


def _worker(rank: int, fn: Callable[..., Any], world_size: int, backend: str,
            port: int, timeout_s: float, args: tuple, shared: Shared) -> None:
    die_with_parent(shared.parent_pid)
    # The launcher handles Ctrl-C for the whole job (see Signals above).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
                   progress=Heartbeat(shared.beats, rank))
        fn(ctx, *args)
        dist.destroy_process_group()
    except Interrupted as stop:
        status = stop.exit_status
    except BaseException as error:
        # Reported before this process closes its connections: before any echo.
        shared.reports.put(report(rank, error))
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown after a failure: gloo may abort in it.
    if status:
        os._exit(status)


class Signals:
    """
    #### `SIGINT` and `SIGTERM` raise `Interrupted` while the job runs

    An inherited ignored `SIGINT` stays ignored (see Signals above). Only the main
    thread may set handlers; elsewhere this does nothing.
    """

    def __enter__(self) -> "Signals":
        self.saved = {}
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.saved[signum] = signal.getsignal(signum)
            if self.saved[signum] is not signal.SIG_IGN:
                signal.signal(signum, _raise_interrupted)
        return self

    def start(self, process: Any) -> None:
        """Start a rank that inherits an ignored `SIGINT` from its first instant."""
        if not self.saved:
            return process.start()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, handler)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


def end_all(processes: list[Any]) -> None:
    """`SIGTERM` every live rank, `SIGKILL` what is left after `GRACE_S`."""
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.join(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:  # a second Ctrl-C: no more grace
            deadline = 0.0
    for process in processes:
        if process.exitcode is None:
            process.kill()
            process.join()


def died(exitcode: int) -> str:
    if exitcode < 0:
        return f"died (signal {signal.Signals(-exitcode).name})"
    return f"died (exit code {exitcode})"


class HangWatch:
    """
    ## The launcher's view of the heartbeats

    It remembers when it last saw each rank's count move, so no clock is shared.
    """

    def __init__(self, world_size: int, timeout: float | None):
        self.timeout = timeout
        self.counts = [0] * world_size
        self.moved_at: list[float | None] = [None] * world_size

    def check(self, shared: Shared, now: float, running: list[bool]
              ) -> RankFailed | None:
        """A rank that is still running and whose count stood still for $T$."""
        for rank, count in enumerate(shared.beats[:len(self.counts)]):
            if count != self.counts[rank]:
                self.counts[rank], self.moved_at[rank] = count, now
        if self.timeout is None or not any(
                run and t is not None and now - t > self.timeout
                for run, t in zip(running, self.moved_at)):
            return None
        # running, not waiting for a peer, fewest beats, the longest still
        rank = min(range(len(self.counts)), key=lambda r: (
            not running[r], shared.waiting[r], self.counts[r],
            self.moved_at[r] or 0.0, r))
        where = shared.where_of(rank)
        return RankFailed(rank, f"stopped making progress: no heartbeat for "
                          f"{self.timeout:g} s after {self.counts[rank]}"
                          + (f", at {where}" if where else ""))


def supervise(processes: list[Any], shared: Shared,
              hang_timeout: float | None) -> RankFailed | None:
    """
    ## Wait for the ranks; the first failure, or `None` if all ended well

    Exits are read before the pipe: a rank writes its report before it exits, so
    an exit with no report in the pipe after it is a death.
    """
    reports: dict[int, dict] = {}
    deaths: dict[int, int] = {}
    first_failure = None
    watch = HangWatch(len(processes), hang_timeout)
    while True:
        multiprocessing.connection.wait(
            [shared.reports._reader]
            + [p.sentinel for p in processes if p.exitcode is None], POLL_S)
        exits = {rank: p.exitcode for rank, p in enumerate(processes)}
        while not shared.reports.empty():
            sent = shared.reports.get()
            reports.setdefault(sent["rank"], sent)
        for rank, code in exits.items():
            if code not in (None, 0) and rank not in reports:
                deaths.setdefault(rank, code)
        now = time.monotonic()
        if (reports or deaths) and first_failure is None:
            first_failure = now
        if all(code is not None for code in exits.values()):
            break
        if first_failure is not None:
            if now - first_failure > REPORT_WINDOW_S:
                break
        elif (hung := watch.check(
                shared, now, [code is None for code in exits.values()])) is not None:
            return hung
    return cause(reports, deaths)


def shorten(line: str, limit: int = 160) -> str:
    return line if len(line) <= limit else line[:limit - 1] + "…"


def cause(reports: dict[int, dict], deaths: dict[int, int]) -> RankFailed | None:
    """A report that is no echo, else a death, else an echo, in arrival order."""
    firsts = [r for r in reports.values() if not r["echo"]]
    if firsts:
        first = firsts[0]
        error = RankFailed(first["rank"], f"failed: {first['line']}",
                           traceback_text=first["traceback"])
    elif deaths:
        rank = next(iter(deaths))
        error = RankFailed(rank, died(deaths[rank]))
    elif reports:
        first = next(iter(reports.values()))
        error = RankFailed(first["rank"], f"failed: {first['line']}",
                           traceback_text=first["traceback"])
    else:
        return None
    error.others = tuple(
        [f"rank {r['rank']} then: {shorten(r['line'])}" for r in reports.values()
         if r["rank"] != error.rank]
        + [f"rank {rank} then {died(code)}" for rank, code in deaths.items()
           if rank != error.rank])
    return error


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300.0,
    hang_timeout: float | None = None,
) -> None:
    """
    ## Run `fn(ctx, *args)` in `world_size` processes on this host

    `fn` must be importable (a module-level function) because the processes are
    started with `spawn`, not `fork` (CUDA cannot be forked). Raises `RankFailed`
    if a rank fails or stops beating for `hang_timeout` seconds, `Interrupted` on
    `SIGINT`/`SIGTERM`; either way every rank has ended when it returns.
    """
    backend = backend or default_backend()
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"world_size {world_size} needs {world_size} GPUs, "
            f"found {torch.cuda.device_count()}"
        )
    if hang_timeout is not None and not hang_timeout > 0:
        raise ValueError(f"hang_timeout must be a positive number of seconds, "
                         f"got {hang_timeout}")
    context = mp.get_context("spawn")
    shared = Shared.create(context, world_size)
    port = free_port()
    processes: list[Any] = []
    with Signals() as signals:
        try:
            for rank in range(world_size):
                process = context.Process(
                    target=_worker, name=f"rank {rank}", args=(
                        rank, fn, world_size, backend, port, timeout_s, args, shared))
                signals.start(process)
                processes.append(process)
            failure = supervise(processes, shared, hang_timeout)
        finally:
            end_all(processes)
            shared.reports.close()
    if failure is not None:
        raise failure


# ## Under torchrun


def under_torchrun() -> bool:
    return (
        "RANK" in os.environ
        and "WORLD_SIZE" in os.environ
        and "LOCAL_RANK" in os.environ
    )


def self_watch(progress: Heartbeat, rank: int, timeout: float) -> None:
    """
    #### A torchrun rank's own hang watchdog

    A rank waiting for a peer allows $T$ more seconds, so the rank that stopped
    is the one that speaks first (see Limitations).
    """
    count, moved_at = progress.count(), time.monotonic()
    while True:
        time.sleep(POLL_S)
        now = time.monotonic()
        if progress.count() != count:
            count, moved_at = progress.count(), now
            continue
        where, waiting = main_thread_where()
        if count and now - moved_at > timeout * (2 if waiting else 1):
            print(f"rank {rank} stopped making progress: no heartbeat for "
                  f"{timeout:g} s after {count}" + (f", at {where}" if where else ""),
                  file=sys.stderr, flush=True)
            os._exit(1)


def run_torchrun(
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300.0,
    hang_timeout: float | None = None,
) -> None:
    """
    ## Run `fn(ctx, *args)` in a process started by torchrun

    torchrun is the launcher here: it ends the other ranks when one exits non-zero.
    This rank dies with its node agent, turns `SIGINT`/`SIGTERM` into a silent exit
    ($128 + \\text{signal}$), and on failure prints its traceback and one line
    `rank r failed: …` (an echo: only `rank r stopped: …`), then exits with 1.
    """
    backend = backend or default_backend()
    rank = int(os.environ["RANK"])
    die_with_parent(os.getppid())
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    progress = Heartbeat([0], 0)
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
        sent = report(rank, error)
        if sent["echo"]:  # its traceback would only hide the cause's
            print(f"rank {rank} stopped: another rank failed or is gone: "
                  f"{shorten(sent['line'])}", file=sys.stderr, flush=True)
        else:
            print(f"{sent['traceback']}rank {rank} failed: {sent['line']}",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
