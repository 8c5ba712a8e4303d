r"""
---
title: Watching the ranks
summary: How the launcher tells a rank's own failure from its echoes, names a rank
  that hangs, and ties every rank's life to the launcher's.
---

# Watching the ranks

[The launcher](spawn.html) starts the ranks; this page is how it watches them.
Every step of a ZeRO-3 job is a chain of collectives that all $N_d$ ranks must
join, so when one rank stops, every other rank stops at its next collective and
reports an error of its own, an *echo*. The launcher's job is to tell the first failure
from its echoes, end every process within a bounded time, and say in one line what
happened. With a poll period $t_p$, a report window $t_w$ and a grace period $t_g$
between `SIGTERM` and `SIGKILL`, every rank has ended at most

$$t_{\text{end}} \le t_{\text{first failure}} + t_p + t_w + t_g$$

after the first failure (`POLL_S`, `REPORT_WINDOW_S`, `GRACE_S` below).
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# $p$: how often the launcher wakes to read the pipe, the exits and the heartbeats.
POLL_S = 0.25
# $w$: after the first failure, how long the other ranks get to send their reports.
REPORT_WINDOW_S = 2.0
# $g$: between SIGTERM and SIGKILL when the launcher ends the ranks.
GRACE_S = 5.0
# Bytes of "file:line in function" each rank publishes about its main thread.
WHERE_BYTES = 200
# A rank's watchdog publishes every $p$; silent four times as long, its threads
# do not run at all: its main thread holds the GIL (a C call that keeps it), or
# the process is stopped.
SILENT_S = 4 * POLL_S
# Of each rank's stderr, what the launcher keeps for a death's report.
TAIL_BYTES = 8192
# Lines of it the one-line report quotes.
TAIL_LINES = 3

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
DIST_DIR = os.path.join(TORCH_DIR, "distributed") + os.sep
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))) + os.sep
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


class Heartbeat:
    """
    ## A rank's progress count

    `counts[slot]` is in memory the watcher reads: a shared array on one host (the
    launcher is another process), a plain list under torchrun (the watcher is a
    thread of this process). Only this rank writes its slot. `steps[slot]`, in
    the same kind of memory, is the last step the rank named (-1: none), so a
    hang is reported in the steps a user counts: a job beats more than once a
    step (after a validation or a save too).
    """

    def __init__(self, counts: Any, slot: int, steps: Any = None):
        self.counts = counts
        self.slot = slot
        self.steps = steps

    def beat(self, step: int | None = None) -> None:
        # the step first: a watcher that sees the new count then reads it
        if step is not None and self.steps is not None:
            self.steps[self.slot] = step
        self.counts[self.slot] += 1

    def count(self) -> int:
        return self.counts[self.slot]

    def step(self) -> int | None:
        step = self.steps[self.slot] if self.steps is not None else -1
        return step if step >= 0 else None


def progress_text(count: int, step: int | None) -> str:
    """How far a hung rank got: its last step if it names steps, else its beats."""
    if step is not None:
        return f"after step {step}"
    return f"after {count} heartbeat{'' if count == 1 else 's'}"


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
    """
    An error that only reports that another rank failed, an *echo*.

    Echoes are recognised for the case of two ranks failing together (an
    agreement between ranks that one failed): `torch.distributed.DistError` (a
    collective that lost its peer) and errors saying that another rank failed or
    that the peer closed the connection (`ECHO_SIGNS`).
    """
    seen = error
    while seen is not None:
        if isinstance(seen, dist.DistError) or any(
                sign in str(seen) for sign in ECHO_SIGNS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def report(rank: int, error: BaseException) -> dict:
    """
    ### A rank's report of its own failure

    Each spawned rank catches its own exception and, *before* it closes its
    connections, writes this report (type, message, the innermost `file:line`
    outside torch, its traceback) into one pipe shared by all ranks. A peer can
    only see the failure once those connections close, so the cause is in the
    pipe before any echo. Nothing is written to disk, so no error files are left
    behind. Plain strings only: the exception itself may not pickle.

    An error whose class sets `user_error = True` (a damaged checkpoint, a loss
    that became non-finite) says all there is in its message: it is reported
    without its traceback, and neither the other ranks' same line nor their
    echoes of it are listed, so the user reads one line.
    """
    frames = [(f.filename, f.lineno or 0, f.name)
              for f in traceback.extract_tb(error.__traceback__)]
    message = " ".join(str(error).split()) or "(no message)"
    where = location(frames)
    return {"rank": rank, "echo": is_echo(error),
            "line": f"{type(error).__name__}: {message}"
                    + (f" ({where})" if where else ""),
            "brief": getattr(error, "user_error", False),
            "traceback": ("" if getattr(error, "user_error", False)
                          else "".join(traceback.format_exception(error)))}


def main_thread_where() -> tuple[str, bool]:
    """
    #### Where the main thread is, and whether it waits for a peer

    `sys._current_frames` is the documented way to see another thread's stack.
    A frame inside `torch.distributed` is a wait for a peer; with NCCL the host
    waits outside it (at `.item()`), so this cannot tell the ranks apart there,
    and the one with the fewest beats is named.
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
#
# A rank never outlives its launcher: on Linux it asks the kernel for `SIGKILL`
# when its parent dies (`prctl(PR_SET_PDEATHSIG)`), and everywhere its watchdog
# thread polls the parent's pid, which changes when the parent is gone.


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

    * `reader`, `writer`: the two ends of the pipe of failure reports; `lock` lets
      one rank write at a time, so a report is whole and the pipe is in the order
      the reports were written.
    * `beats`: the heartbeat count of each rank; `steps`: the last step each
      rank named in a heartbeat, -1 before the first.
    * `waiting`: 1 while a rank's main thread is inside `torch.distributed`.
    * `where`: `WHERE_BYTES` per rank, its main thread's location.
    * `published`: how many times each rank's watchdog published the two
      above; while it stands still, they are stale.
    """

    parent_pid: int
    reader: Any
    writer: Any
    lock: Any
    beats: Any
    steps: Any
    waiting: Any
    where: Any
    published: Any

    @classmethod
    def create(cls, context: Any, world_size: int) -> "Shared":
        reader, writer = context.Pipe(duplex=False)
        return cls(os.getpid(), reader, writer, context.Lock(),
                   context.Array("q", world_size, lock=False),
                   context.Array("q", [-1] * world_size, lock=False),
                   context.Array("b", world_size, lock=False),
                   context.Array("c", world_size * WHERE_BYTES, lock=False),
                   context.Array("q", world_size, lock=False))

    def send(self, sent: dict) -> None:
        # a bound: a rank killed while holding the lock must not block the others
        if self.lock.acquire(timeout=GRACE_S):
            try:
                self.writer.send(sent)
            finally:
                self.lock.release()

    def received(self) -> list[dict]:
        out = []
        while self.reader.poll():
            out.append(self.reader.recv())
        return out

    def close(self) -> None:
        self.reader.close()
        self.writer.close()

    def publish(self, rank: int) -> None:
        where, waiting = main_thread_where()
        data = where.encode()[:WHERE_BYTES].ljust(WHERE_BYTES, b"\0")
        self.where[rank * WHERE_BYTES:(rank + 1) * WHERE_BYTES] = data
        self.waiting[rank] = int(waiting)
        self.published[rank] += 1

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


class StderrTail:
    """
    ## A rank's stderr, passed on and its end kept

    A rank killed by a signal writes no report, and a signal's name alone rarely
    says why (`SIGABRT` from a C++ exception, `SIGKILL` from the kernel's
    out-of-memory killer). So each rank's stderr is a pipe the launcher reads,
    and a death is reported with the last lines the rank wrote. The pipe lives in
    the launcher, so what the rank wrote before it died is there even when the
    death was instant.

    `fd` is the read end of the rank's stderr pipe; a daemon thread copies
    every chunk to the launcher's stderr (file descriptor 2, as the rank's
    own stderr was before) and keeps the last `TAIL_BYTES`.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.tail = b""
        self.thread = threading.Thread(target=self.pump, daemon=True)
        self.thread.start()

    def pump(self) -> None:
        forward = True
        try:
            while chunk := os.read(self.fd, 65536):
                self.tail = (self.tail + chunk)[-TAIL_BYTES:]
                if forward:
                    try:
                        os.write(2, chunk)
                    except OSError:  # our stderr is gone: keep draining the
                        forward = False  # rank's, or it blocks once the pipe is full
        except OSError:
            pass
        finally:
            os.close(self.fd)

    def last_lines(self, wait_s: float = 1.0) -> list[str]:
        """The last non-empty lines, once the pipe is drained (or `wait_s`)."""
        self.thread.join(wait_s)
        text = self.tail.decode(errors="replace").replace("\r", "\n")
        return [" ".join(line.split()) for line in text.splitlines()
                if line.strip()][-TAIL_LINES:]


def last_words(exitcode: int, lines: list[str]) -> str:
    """`died (signal …)` with what the rank last wrote, or a hint if nothing."""
    cause = died(exitcode)
    if lines:
        return f"{cause}; its last words on stderr: {shorten(' | '.join(lines), 300)}"
    if exitcode == -signal.SIGKILL:
        return (f"{cause}, printing nothing: killed from outside, often by the "
                f"kernel's out-of-memory killer (see dmesg)")
    return f"{cause}, printing nothing on stderr"


class HangWatch:
    """
    ## The launcher's view of the heartbeats

    With a hang timeout $T$, the launcher watches each rank's heartbeat count. A
    rank whose count has not moved for $T$ seconds (after its first beat: loading
    is not watched) has stopped; since the others then wait for it in a
    collective, they stop too, and counts alone cannot tell which one stopped
    first. So each rank's watchdog thread publishes where its main thread is: a
    rank whose innermost frame is inside `torch.distributed` is waiting for a
    peer, so the rank named is one that is *not* waiting, then the one with the
    fewest beats. $T$ must exceed the longest gap between two beats (a
    validation, a checkpoint save). A rank whose main thread hangs holding the
    GIL stops its watchdog too, so what it last published is stale: it may
    still say "waiting" from the collective before. A rank silent for
    `SILENT_S` is therefore named before any rank that still answers.

    It remembers when it last saw each count move, so no clock is shared.
    """

    def __init__(self, world_size: int, timeout: float | None):
        self.timeout = timeout
        self.counts = [0] * world_size
        self.moved_at: list[float | None] = [None] * world_size
        self.published = [-1] * world_size
        self.published_at = [0.0] * world_size

    def check(self, shared: Shared, now: float, running: list[bool]
              ) -> RankFailed | None:
        """A rank that is still running and whose count stood still for $T$."""
        for rank, count in enumerate(shared.beats[:len(self.counts)]):
            if count != self.counts[rank]:
                self.counts[rank], self.moved_at[rank] = count, now
        for rank, count in enumerate(shared.published[:len(self.counts)]):
            if count != self.published[rank]:
                self.published[rank], self.published_at[rank] = count, now
        if self.timeout is None or not any(
                run and t is not None and now - t > self.timeout
                for run, t in zip(running, self.moved_at)):
            return None
        silent = [run and now - t > SILENT_S
                  for run, t in zip(running, self.published_at)]
        if all(s or not run for s, run in zip(silent, running)):
            silent = [False] * len(silent)  # none answers: nothing to tell apart
        # running, silent, not waiting for a peer (a silent rank's "waiting"
        # is stale), fewest beats, the longest still
        rank = min(range(len(self.counts)), key=lambda r: (
            not running[r], not silent[r], not silent[r] and shared.waiting[r],
            self.counts[r], self.moved_at[r] or 0.0, r))
        where = shared.where_of(rank)
        step = shared.steps[rank] if shared.steps[rank] >= 0 else None
        place = ""
        if where:
            place = f", last seen at {where}" if silent[rank] else f", at {where}"
        if silent[rank]:
            place += (" (its threads stopped too: its main thread holds the "
                      "GIL, or the process is stopped)")
        return RankFailed(rank, f"stopped making progress: no heartbeat for "
                          f"{self.timeout:g} s "
                          f"{progress_text(self.counts[rank], step)}" + place)


def supervise(processes: list[Any], shared: Shared,
              hang_timeout: float | None,
              tails: list[StderrTail] | None = None) -> RankFailed | None:
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
            [shared.reader]
            + [p.sentinel for p in processes if p.exitcode is None], POLL_S)
        exits = {rank: p.exitcode for rank, p in enumerate(processes)}
        for sent in shared.received():
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
    error = cause(reports, deaths)
    if error is not None and tails and error.rank in deaths and not error.traceback:
        lines = tails[error.rank].last_lines()
        error = RankFailed(error.rank, last_words(deaths[error.rank], lines),
                           others=error.others)
    return error


def shorten(line: str, limit: int = 160) -> str:
    return line if len(line) <= limit else line[:limit - 1] + "…"


def cause(reports: dict[int, dict], deaths: dict[int, int]) -> RankFailed | None:
    """
    ### The rank to blame

    The first whose error is not an echo; then a rank that died without a report
    (a signal, `os._exit`); an echo only if nothing else is known. Within each, in
    arrival order.
    """
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
    # After an error that says it all (see Failure), the same line on another
    # rank, or an echo that points at it, adds nothing.
    said = str(error).partition(": ")[2]
    brief = any(r["rank"] == error.rank and r.get("brief") for r in reports.values())
    error.others = tuple(
        [f"rank {r['rank']} then: {shorten(r['line'])}" for r in reports.values()
         if r["rank"] != error.rank and not (brief and (r["line"] == said
                                                        or r["echo"]))]
        + [f"rank {rank} then {died(code)}" for rank, code in deaths.items()
           if rank != error.rank])
    return error


# ## Under torchrun


# Held by whichever of a torchrun rank's two voices speaks first: the main
# thread reporting its exception, or its hang watchdog. See `speak_once`.
_SPEAKING = threading.Lock()


def speak_once(*, wait_s: float = 0.0) -> bool:
    """
    #### One voice per torchrun rank

    A rank whose peer stopped gets an exception in its collective a moment
    after its own watchdog's deadline may have passed: both would print a line
    and write torchrun's error file at once, the watchdog would call the rank
    that only waited hung, and torchrun could read a half-written file. So each
    takes this lock first and the second stays silent: the watchdog returns,
    the main thread waits (`wait_s`) for the watchdog's `os._exit`.
    """
    return _SPEAKING.acquire(timeout=wait_s) if wait_s > 0 else \
        _SPEAKING.acquire(blocking=False)


def tell_torchrun(line: str, traceback_text: str = "", *, echo: bool = False
                  ) -> None:
    """
    #### The line torchrun's failure summary shows for this rank

    torchrun reads a JSON error file from each failed rank (the path is in
    `TORCHELASTIC_ERROR_FILE`) and calls the one with the smallest timestamp, in
    whole seconds, the root cause; ties go to the lowest rank. An echo comes after
    its cause, so it is dated one second later.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = str(int(time.time()) + int(echo))
    data = {"message": {"message": line, "extraInfo": {
        "py_callstack": traceback_text, "timestamp": stamp}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the summary is a courtesy; the line is already printed
        pass


def self_watch(progress: Heartbeat, rank: int, timeout: float) -> None:
    """
    #### A torchrun rank's own hang watchdog

    Under torchrun each rank watches only its own heartbeat. A rank waiting for
    a peer allows $T$ more seconds, so the rank that stopped is the one that
    speaks first: a rank waiting in a collective gives the others $T$ more
    seconds to be the one that reports.
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
            if not speak_once():
                return  # the main thread is reporting its own failure
            done = progress_text(count, progress.step())
            at = f", at {where}" if where else ""
            # Still waiting after twice the time: the peer that stopped never
            # spoke, as one whose main thread holds the GIL cannot.
            line = (f"rank {rank} waited {2 * timeout:g} s in a collective "
                    f"{done}{at}, for a peer that stopped without a word (its "
                    f"main thread may hold the GIL)" if waiting else
                    f"rank {rank} stopped making progress: no heartbeat for "
                    f"{timeout:g} s {done}{at}")
            print(line, file=sys.stderr, flush=True)
            tell_torchrun(line)
            os._exit(1)
