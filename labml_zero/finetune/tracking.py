r"""
---
title: Tracking the fine-tune with labml
summary: One labml run over all ranks (one uuid, a directory per rank), the app
  writer only when an app answered, and the numbers each step records.
---

# Tracking the fine-tune with labml

Each rank creates the same labml run (one uuid, agreed by a broadcast) with its own
rank, so labml keeps a directory per rank (`<log_dir>/<experiment>/<uuid>.<rank>/`,
the experiment named by the model's [family](../family.html): `zero3_neox`,
`zero3_llama`) and the labml app merges them. The tracked numbers are already means over all
ranks (one all-reduce of three scalars per step, see [the job](job.html)), so
every rank's log agrees; only rank 0 prints. Tracking never decides a run's
outcome: every rank's records are on disk under `log_dir` whatever the app does.

However the run ends (its last step, a rank's failure, `SIGINT` or `SIGTERM`), it
ends in the local log and in the app with its status and the lines it printed:
`LabmlRun.started` is the one way out, with every wait bounded.

## Limitations

A rank that the launcher kills (`SIGKILL`, after its grace period) or that is
stuck inside a collective when the signal comes sends nothing more: the app
shows that rank's run as in progress until labml-app calls it unresponsive.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator
from uuid import uuid1

import torch.distributed as dist

from labml_zero.app.client import (app_url_if_running, labml_app_settings,
                                   run_series_names, show_run_health)
from labml_zero.finetune.config import FinetuneConfig
from labml_zero.launch import DistContext
from labml_zero.launch.supervisor import GRACE_S

__all__ = ["start_labml", "LabmlRun", "labml_configs", "VALID_INDICATORS",
           "local_log_joined", "BoundedSender", "install_bounded_sender",
           "HEALTH_CHARTS", "RunPageSetup"]

# What a step records: `loss.train`, `acc.train`, the mean cross-entropy and the
# next-token accuracy over the step's $B \cdot A \cdot N_d$ sequences; and
# `loss.valid`, `acc.valid`, the same on the validation batches, only at the steps
# where they are measured (every `valid_every`). labml's screen line would repeat
# the last value of an indicator on every later line, so these two are kept off
# it and printed on their own line when measured.
VALID_INDICATORS = ("loss.valid", "acc.valid")


# ## The local log, written before the rank ends


def local_log_joined(wait_s: float) -> None:
    """
    ### Wait until labml's local log holds every record

    labml writes the local log (one JSON line of records at a time) from a
    thread of its own, fed its last records when the run ends (the exit of
    `experiment.start()`, on success and on failure alike). A rank ends with
    `os._exit` (the launcher's `end_rank`), which would cut that thread
    short: on a loaded host the last steps' records, the step a failure came
    after included, could be lost. Called once the run has ended, this waits
    for the thread at most `wait_s`, so that a stuck disk cannot hold the rank.
    """
    from labml.internal.tracker.writers.file import FileWriterThread

    deadline = time.monotonic() + wait_s
    for thread in threading.enumerate():
        if isinstance(thread, FileWriterThread):
            thread.join(max(0.0, deadline - time.monotonic()))


# ## Sending to the app, bounded
#
# labml's own sender thread is not a daemon and retries a failed request
# forever, so this page gives labml a sender with every wait bounded
# (`BoundedSender`).

# One request; labml's own waits minutes.
REQUEST_TIMEOUT_S = 5.0
# Failing this long, the app counts as gone.
LOST_AFTER_S = 20.0
# At the end of a run that succeeded, the time its last records get (the local
# log's, the app's, the page's last look): room for two of labml-app's answers,
# each after its fixed pause (one request in flight, one with the last records).
EXIT_WAIT_S = 10.0
# At the end of a run that failed or was interrupted, the same within the
# launcher's grace: it ends every rank with `SIGTERM`, then `SIGKILL` `GRACE_S`
# later; a second is left for the rank's report and exit (see Note: the end of a
# run that failed).
ENDED_WAIT_S = GRACE_S - 1.0
# Packets held while the app does not answer (a few seconds of a run each).
MAX_PENDING = 64
# The longest pause between two tries of a failed request.
MAX_BACKOFF_S = 4.0


def labml_sender_base():
    """labml's sender thread class, the one private name this page uses."""
    from labml.internal.app import _AppTrackThread

    return _AppTrackThread


class BoundedSender(labml_sender_base()):
    """
    ## labml's sender thread, with every wait bounded

    labml's own sender (in the labml releases `pyproject.toml` accepts) is not a
    daemon, waits minutes for each request and retries a failed one forever, so
    an app that goes away in the middle of a run keeps every rank from exiting
    after its last step. This one bounds every wait: one request waits at most
    `REQUEST_TIMEOUT_S`; packets that come while a request fails wait in a queue
    of at most `MAX_PENDING` (the oldest dropped); the thread is a daemon. The app
    is only a view, so the worst a lost app costs is its copy of the records.

    1. `run` takes the packets labml's writers have ready into `pending`;
    2. sends them all in one request; on success `pending` empties;
    3. on failure waits (1, 2, 4 s) and tries again; a failure that has lasted
       `LOST_AFTER_S` makes the app *lost*: one warning on rank 0, and from
       then on packets are taken (so labml's buffers empty) and dropped;
    4. once labml has called `stop` (the run ended) and nothing is pending, it
       returns; `finish`, at the run's end, waits for that, bounded, and sends
       the last records at once if a request is in flight (see Note: the last
       records do not wait behind a paused request).

    ### Note: the last records do not wait behind a paused request

    labml-app stores a request's records when it arrives, then pauses before it
    answers. The records labml queues when the run ends (its status, its last
    lines) would leave only after the answer to the request in flight, up to
    that pause later: time that a rank the launcher is ending does not have,
    and that its peers, waiting for it in a collective, would spend too. So
    `finish` sends them at once, in a request of their own, and the rank may go
    as soon as the app has answered that one; the request in flight was stored
    when it arrived.
    """

    def __init__(self, url: str, *, app_url: str, rank: int, log_dir: Path):
        super().__init__(url, timeout_seconds=REQUEST_TIMEOUT_S, daemon=True)
        self.app_url, self.rank, self.log_dir = app_url, rank, log_dir
        self.pending: collections.deque = collections.deque(maxlen=MAX_PENDING)
        self.lost = self.warned = False
        # a request is on its way, or in the app's pause
        self.in_flight = False
        # `finish`'s request of the last records: started, on its way, failed
        self.rest_started = self.sending_rest = self.rest_failed = False
        # the app has every record, or the thread has ended
        self.done = threading.Event()

    def stop(self) -> None:
        # labml calls this when the run ends, from the main thread: no waiting
        # (and none of labml's "please wait" lines)
        self.is_stopped = True

    def warn(self, why: str) -> None:
        # one line a run: an app lost near the run's end would otherwise say
        # so twice, once from each thread
        if self.rank == 0 and not self.warned:
            self.warned = True
            print(f"labml app at {self.app_url} {why}; the run's records are "
                  f"complete in {self.log_dir}", file=sys.stderr, flush=True)

    def packets(self, wait_s: float) -> list:
        """What labml's writers have ready, waiting at most `wait_s` for it."""
        sources = []
        try:
            sources.append(self.queue.get(timeout=wait_s))
            while True:
                sources.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        # each writer once, in order
        packets = [source.get_data_packet() for source in dict.fromkeys(sources)]
        return [p for p in packets if not self._is_updating_notification(p)]

    def take(self, wait_s: float) -> None:
        """Move what labml's writers have ready into `pending`."""
        for packet in self.packets(wait_s):
            if not self.lost:
                self.pending.append(packet)

    def send(self) -> bool:
        """One request with everything pending; `True` if the app took it."""
        self.in_flight = True
        try:
            response = self._send([p.data for p in self.pending])
        except Exception:  # any failure of the app is a failed send, never the run's
            self.errored = False  # labml's tracker would raise this in the run
            return False
        finally:
            self.in_flight = False
        self.pending.clear()
        for handler in self.handlers:
            if handler.handle(response):
                break
        return True

    def run(self) -> None:
        failing_since, backoff = None, 1.0
        try:
            while not (self.is_stopped and self.queue.empty() and not self.pending
                       and not self.sending_rest):
                self.take(wait_s=0.5)
                if not self.pending:
                    continue
                if self.send():
                    failing_since, backoff = None, 1.0
                    continue
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= LOST_AFTER_S:
                    self.lost = True
                    self.pending.clear()
                    self.warn(f"did not answer for {LOST_AFTER_S:g} s; tracking "
                              f"goes on to disk only")
                    continue
                time.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
        finally:
            self.done.set()

    def finish(self, wait_s: float | None = None) -> None:
        """
        At the run's end: the last records get `wait_s` (`EXIT_WAIT_S` by
        default), then the rank goes. Behind a request in flight they go at
        once (see Note: the last records do not wait behind a paused request).
        """
        wait_s = EXIT_WAIT_S if wait_s is None else wait_s
        if not self.is_alive():
            return
        if self.in_flight and not self.lost and not self.rest_started:
            self.rest_started = self.sending_rest = True
            threading.Thread(target=self.send_rest, daemon=True,
                             name="labml last records").start()
        answered = self.done.wait(wait_s)
        if not self.lost and (not answered or self.rest_failed):
            self.warn("did not take the run's last records" + (
                "" if answered else f" within {round(wait_s, 1):g} s"))

    def send_rest(self) -> None:
        """
        #### The last records, beside the request in flight

        Sets `done` once the app has answered; with nothing queued, the request
        in flight carries them, and `done` comes when the thread ends.
        """
        try:
            packets = self.packets(wait_s=0.0)
            if packets:
                self._send([p.data for p in packets])
                self.done.set()
        except Exception:  # a failed send, never the run's
            self.errored = False
            self.rest_failed = True
        finally:
            self.sending_rest = False


def bounded_app_tracker(app_url: str, rank: int, log_dir: Path,
                        senders: list[BoundedSender]):
    """
    #### labml's `AppTracker`, making a `BoundedSender` instead of its own thread

    Each sender it makes is added to `senders`, where the run's end finds it.
    """
    from labml.internal.app import AppTracker

    class BoundedAppTracker(AppTracker):
        def _check(self) -> bool:
            if self.stopped:
                return False
            if self.thread is None:
                self.thread = BoundedSender(self.app_track_url, app_url=app_url,
                                            rank=rank, log_dir=log_dir)
                senders.append(self.thread)
            return True

    return BoundedAppTracker


def install_bounded_sender(app_url: str, rank: int,
                           log_dir: Path) -> list[BoundedSender]:
    """
    ### Make labml use `BoundedSender` for this process's runs

    labml builds its `AppTracker` inside `experiment.start()`, looking the
    class up in `labml.internal.app` then; replacing it there is the one place
    this page reaches into labml. Returns the list the sender joins once labml
    makes it (at the run's first record).
    """
    import labml.internal.app

    senders: list[BoundedSender] = []
    labml.internal.app.AppTracker = bounded_app_tracker(app_url, rank, log_dir,
                                                        senders)
    return senders


# ## The run's page: its health beside its loss

# The charts a run's page shows beside labml-app's own loss chart, one series
# each: what [a step records](step_metrics.html) about the run's health. `mfu`
# exists only where the device's peak is known (GPUs), `memory.host` only off
# the CPU (where the device's peak is the host's), `loss_scale` only in fp16.
HEALTH_CHARTS = {
    "learning rate": ("lr",),
    "gradient norm": ("grad_norm",),
    "tokens per second": ("tokens_per_s",),
    "MFU": ("mfu",),
    "peak memory (GiB)": ("memory.peak",),
    "host memory (GiB)": ("memory.host",),
    "loss scale": ("loss_scale",),
}
# Every step records these together, so once they are in the app, so is any
# other chart's series (`mfu`, `loss_scale`).
HEALTH_READY = ("loss.train", "lr")
# Between two looks at the app while the run's first steps are on their way.
PAGE_POLL_S = 2.0
# Between two looks once the charts are there.
PAGE_RECHECK_S = 30.0
# At exit, after the sender's wait: the last look is a few small requests to
# an app that has just answered; one that does not answer costs no more.
PAGE_EXIT_WAIT_S = 2.0


class RunPageSetup(threading.Thread):
    """
    ## The run's page set up once, beside the run

    A daemon thread on rank 0: it asks the app every `PAGE_POLL_S` until the
    first steps' series and the configs have arrived, then adds the charts of
    `HEALTH_CHARTS` and selects the configuration
    ([`show_run_health`](../app/client.html)); then every `PAGE_RECHECK_S`, and
    once more at the run's end, it re-chooses a chart's series if more have
    arrived. The training loop never waits for it; an app that fails makes it
    give up with one line, and at the end it gets at most `PAGE_EXIT_WAIT_S` more.

    ### Note: a chart's series are positions in a list

    labml-app stores a chart's choice as one entry per series of the run, in
    the order of its list of series, not by name. A series that arrives
    later (labml's loop timer comes with the second step) shifts the entries
    after it, and a chart would draw its neighbour. So the charts are made
    once two looks in a row see the same list, and chosen again, by name,
    whenever the list has grown.
    """

    def __init__(self, app_url: str, run_uuid: str):
        super().__init__(daemon=True, name="labml run page")
        self.app_url, self.run_uuid = app_url, run_uuid
        self.done = threading.Event()
        self.exiting = threading.Event()

    def run(self) -> None:
        seen = None
        try:
            while True:
                last = self.exiting.is_set()
                try:
                    # the page is set up only once two looks agree: a new
                    # series shifts every position after it (see Note: a
                    # chart's series are positions in a list)
                    names = run_series_names(self.app_url, self.run_uuid,
                                             timeout_s=REQUEST_TIMEOUT_S)
                    settled = last or (names == seen and names is not None)
                    seen = names
                    shown = settled and show_run_health(
                        self.app_url, self.run_uuid, HEALTH_CHARTS,
                        ready=HEALTH_READY, timeout_s=REQUEST_TIMEOUT_S)
                except OSError:
                    # unreachable: tried again later; an app that stays away
                    # is the sender's one warning (`BoundedSender.warn`)
                    shown = False
                if last:
                    return
                self.exiting.wait(PAGE_RECHECK_S if shown else PAGE_POLL_S)
        except Exception as e:  # the app is only a view: never the run's failure
            print(f"labml app at {self.app_url}: the run's page was not set up "
                  f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        finally:
            self.done.set()

    def finish(self, wait_s: float = PAGE_EXIT_WAIT_S) -> None:
        """
        At the run's end, after the sender's last records: one last look, so
        that the series of the last steps are charted; at most `wait_s`.
        """
        self.exiting.set()
        self.done.wait(wait_s)


# ## The run's end, whatever ends it


class ExitWait:
    """
    ## One deadline for the waits at a run's end, kept through signals

    `run(wait)` calls `wait(seconds)` with what is left of the deadline, at
    most `at_most`. An `Interrupted` inside it (a `KeyboardInterrupt`: the
    launcher's `SIGTERM`, or a second signal) does not end the waiting: the
    run's outcome was decided before the wait began. The launcher kills
    `GRACE_S` after its signal, so the deadline moves to at most `ENDED_WAIT_S`
    after the signal, and `wait` is called again with what is left.
    """

    def __init__(self, wait_s: float):
        self.deadline = time.monotonic() + wait_s

    def run(self, wait: Callable[[float], object], *,
            at_most: float = float("inf")) -> None:
        while True:
            try:
                wait(max(0.0, min(at_most, self.deadline - time.monotonic())))
                return
            except KeyboardInterrupt:
                self.deadline = min(self.deadline, time.monotonic() + ENDED_WAIT_S)
                if time.monotonic() >= self.deadline:
                    return


@dataclasses.dataclass(frozen=True)
class LabmlRun:
    """
    ## This rank's labml run, as `start_labml` set it up

    * `uuid`: the run's, the same on every rank.
    * `senders`: this rank's `BoundedSender` once labml has made it (at the
      run's first record); empty without the app.
    * `page`: rank 0's `RunPageSetup` when the app answered, else `None`.

    ### Note: the end of a run that failed

    labml records a run's end when `experiment.start()` is left, and its app
    writer sends it from a thread. A rank that fails or is interrupted ends with
    `os._exit` (the launcher's `end_rank`) without running exit handlers, which
    kills that thread: the app showed such a run in progress, without its last
    lines, or not at all if it failed before its first send. So `started` waits
    for the sender itself, for every outcome, before the exception leaves the
    job. The wait has to fit the launcher: once a rank has failed (or the job is
    interrupted) it sends `SIGTERM` to every rank and `SIGKILL` `GRACE_S` later,
    so after a failure or a signal all the waits together get `ENDED_WAIT_S`.
    labml-app pauses before it answers a request; the last records go beside a
    paused request, not after it (see Note: the last records do not wait
    behind a paused request), and this app answers them at once (see Note: a
    run's last request is not paused), so a rank's wait is short. It has to
    be: a rank that fails or is interrupted first holds its peers, waiting
    for it in a collective, until it exits, and their waits come after its
    own, all within the grace. The launcher's `SIGTERM` may arrive during the
    wait, as an `Interrupted` in the main thread; `ExitWait` keeps waiting to
    its deadline, and then the run's own exception goes on. The tracking never
    replaces an outcome, so the exit status is the one the run's end gives.

    labml also tells an interruption by `exc_type == KeyboardInterrupt`: the
    launcher's `Interrupted`, a subclass, would be recorded as *crashed*. It is
    handed to labml as a `KeyboardInterrupt`, and the app shows *interrupted*.

    The cost: a failing rank reports its failure up to `ENDED_WAIT_S` later,
    and its peers, waiting for it in a collective, see it that much later.
    """

    uuid: str
    senders: list[BoundedSender] = dataclasses.field(default_factory=list)
    page: RunPageSetup | None = None

    @contextlib.contextmanager
    def started(self) -> Iterator[None]:
        """
        ### The job's body, as a labml run that ends in the app however it ends

        `experiment.start()` around the body; on the way out, whichever way:

        1. labml records the outcome in the local log and queues it for the
           app: *completed*; *interrupted* for `SIGINT`, `SIGTERM` or `SIGHUP`
           (the launcher's `Interrupted`); *crashed*, with the error's
           message, for anything else;
        2. the run's last records get their waits (`records_sent`),
           `EXIT_WAIT_S` in all after a success, `ENDED_WAIT_S` otherwise (see
           Note: the end of a run that failed);
        3. the exception, if any, goes on unchanged.
        """
        from labml import experiment

        watcher = experiment.start()
        try:
            yield
        except BaseException as error:
            # labml tells an interruption by `exc_type == KeyboardInterrupt`:
            # the launcher's `Interrupted`, a subclass, would be *crashed*
            kind = (KeyboardInterrupt if isinstance(error, KeyboardInterrupt)
                    else type(error))
            watcher.__exit__(kind, error, error.__traceback__)
            self.records_sent(ExitWait(ENDED_WAIT_S))
            raise
        watcher.__exit__(None, None, None)
        self.records_sent(ExitWait(EXIT_WAIT_S))

    def records_sent(self, wait: ExitWait) -> None:
        """
        #### The run's last records: on disk, in the app, on its page

        In turn, within `wait`'s deadline: the local log first (the records
        that are there whatever the app does), then the app's sender, then
        the page's last look, which needs the sender's records in the app.
        """
        wait.run(local_log_joined)
        for sender in self.senders:
            wait.run(sender.finish)
        if self.page is not None:
            wait.run(self.page.finish, at_most=PAGE_EXIT_WAIT_S)


def git_root(path: Path) -> Path | None:
    for directory in (path, *path.parents):
        if (directory / ".git").exists():
            return directory
    return None


def start_labml(config: FinetuneConfig, ctx: DistContext, *, python_file: str
                ) -> LabmlRun:
    """
    ## One labml run over all ranks

    Rank 0 picks the uuid and probes the app (see [the app
    client](../app/client.html)); a broadcast tells the others, so every rank
    agrees without each probing (and under torchrun, where no parent process
    could pick for them). `python_file` is the job's source, which labml records.
    The app writer is on only when `app_url` answered the probe; otherwise
    nothing touches the network. The job runs inside the returned run's
    `started()`.
    """
    from labml import experiment, lab, logger, tracker

    decision = [None, None]
    if ctx.rank == 0:
        answered = (app_url_if_running(config.app_url)
                    if config.app_url is not None else None)
        decision = [uuid1().hex, answered]
    dist.broadcast_object_list(decision, src=0)
    run_uuid, app_url = decision

    log_dir = Path(config.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    # labml's project path is where it reads the git commit it records with the
    # run: the repository we run in, if any. Runs go to `log_dir` either way.
    settings = {"path": str(git_root(Path.cwd()) or log_dir),
                "experiments_path": str(log_dir)}
    writers = {"file"} | ({"screen"} if ctx.rank == 0 else set())
    senders: list[BoundedSender] = []
    if app_url is not None:
        settings.update(labml_app_settings(app_url))
        writers.add("app")
        senders = install_bounded_sender(app_url, ctx.rank, log_dir)
    elif config.app_url is not None and ctx.rank == 0:
        logger.log(f"no labml app answered at {config.app_url} within 2 s; "
                   f"tracking offline to {log_dir}")
    # labml copies what the rank prints to the app's output card by replacing
    # the `write` of whatever `sys.stdout` is when `labml.internal.app.logs` is
    # first imported. Imported inside the `redirect_stdout` below, it would
    # copy the swallowed set-up lines and never a training line; so first.
    import labml.internal.app.logs  # noqa: F401

    # labml looks for its project file, `.labml.yaml`, above the file that
    # first calls it (this one) and above `python_file` (the job's), and warns
    # for each lookup that finds none: the package's root holds one
    # (`labml_zero/.labml.yaml`, empty: every setting is given here).
    lab.configure(settings)
    # Outside a git repository labml says it records no commit, in a warning
    # box; expected for an installed job, so that notice alone is kept out.
    quiet = (contextlib.nullcontext() if git_root(Path.cwd())
             else contextlib.redirect_stdout(io.StringIO()))
    with quiet:
        experiment.create(name=config.family.experiment, uuid=run_uuid, writers=writers,
                          python_file=python_file, distributed_rank=ctx.rank,
                          distributed_world_size=ctx.world_size)
    for name in VALID_INDICATORS:
        tracker.set_scalar(name, is_print=False)
    page = None
    if app_url is not None and ctx.rank == 0:
        page = RunPageSetup(app_url, run_uuid)
        page.start()
    return LabmlRun(run_uuid, senders, page)


def labml_configs(config: FinetuneConfig, ctx: DistContext, **facts) -> dict:
    """
    ## What labml records as the run's configuration

    The config's fields (but where the logs go and the app's address, which say
    nothing about the run), the dtype resolved for this device, the world size
    and backend, and `facts`: what the build found (parameter counts, chunks).
    """
    return {
        **{k: v for k, v in dataclasses.asdict(config).items()
           if k not in ("log_dir", "app_url")},
        "filter_layers": (None if config.filter_layers is None
                          else list(config.filter_layers)),
        "dtype": str(config.torch_dtype(ctx.device)).removeprefix("torch."),
        "engine": "zero3_chunks",
        "optimizer": "AdamFP16",
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        **facts,
    }
