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
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import io
import queue
import sys
import threading
import time
from pathlib import Path
from uuid import uuid1

import torch.distributed as dist

from labml_zero.app.client import (app_url_if_running, labml_app_settings,
                                   run_series_names, show_run_health)
from labml_zero.finetune.config import FinetuneConfig
from labml_zero.launch import DistContext

__all__ = ["start_labml", "labml_configs", "VALID_INDICATORS",
           "local_log_written", "BoundedSender", "install_bounded_sender",
           "HEALTH_CHARTS", "RunPageSetup"]

# What a step records: `loss.train`, `acc.train`, the mean cross-entropy and the
# next-token accuracy over the step's $B \cdot A \cdot N_d$ sequences; and
# `loss.valid`, `acc.valid`, the same on the validation batches, only at the steps
# where they are measured (every `valid_every`). labml's screen line would repeat
# the last value of an indicator on every later line, so these two are kept off
# it and printed on their own line when measured.
VALID_INDICATORS = ("loss.valid", "acc.valid")


# ## The local log, written before the rank ends

# The longest wait for labml's writer of the local log once the run has ended.
LOG_WRITE_WAIT_S = 10.0


@contextlib.contextmanager
def local_log_written(timeout_s: float = LOG_WRITE_WAIT_S):
    """
    ### Leave only once labml's local log holds every record

    labml writes the local log (one JSON line of records at a time) from a
    thread of its own, fed its last records when the run ends (the exit of
    `experiment.start()`, on success and on failure alike). A rank ends with
    `os._exit` (the launcher's `end_rank`), which would cut that thread
    short: on a loaded host the last steps' records, the step a failure came
    after included, could be lost. Entered outside `experiment.start()`,
    this waits for the thread once the run has ended, at most `timeout_s`,
    so that a stuck disk cannot hold the rank.
    """
    try:
        yield
    finally:
        from labml.internal.tracker.writers.file import FileWriterThread

        deadline = time.monotonic() + timeout_s
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
# At exit, the time the last records get: room for two of labml-app's answers,
# each after its fixed pause (one request in flight, one with the last records).
EXIT_WAIT_S = 10.0
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
       returns; `finish`, at exit, waits for that at most `EXIT_WAIT_S`.
    """

    def __init__(self, url: str, *, app_url: str, rank: int, log_dir: Path):
        super().__init__(url, timeout_seconds=REQUEST_TIMEOUT_S, daemon=True)
        self.app_url, self.rank, self.log_dir = app_url, rank, log_dir
        self.pending: collections.deque = collections.deque(maxlen=MAX_PENDING)
        self.lost = False
        self.done = threading.Event()

    def stop(self) -> None:
        # labml calls this when the run ends, from the main thread: no waiting
        # (and none of labml's "please wait" lines)
        self.is_stopped = True

    def warn(self, why: str) -> None:
        if self.rank == 0:
            print(f"labml app at {self.app_url} {why}; the run's records are "
                  f"complete in {self.log_dir}", file=sys.stderr, flush=True)

    def take(self, wait_s: float) -> None:
        """Move what labml's writers have ready into `pending`."""
        sources = []
        try:
            sources.append(self.queue.get(timeout=wait_s))
            while True:
                sources.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        for source in dict.fromkeys(sources):  # each writer once, in order
            packet = source.get_data_packet()
            if not self._is_updating_notification(packet) and not self.lost:
                self.pending.append(packet)

    def send(self) -> bool:
        """One request with everything pending; `True` if the app took it."""
        try:
            response = self._send([p.data for p in self.pending])
        except Exception:  # any failure of the app is a failed send, never the run's
            self.errored = False  # labml's tracker would raise this in the run
            return False
        self.pending.clear()
        for handler in self.handlers:
            if handler.handle(response):
                break
        return True

    def run(self) -> None:
        failing_since, backoff = None, 1.0
        try:
            while not (self.is_stopped and self.queue.empty() and not self.pending):
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

    def finish(self) -> None:
        """At exit: the last records get `EXIT_WAIT_S`, then the rank goes."""
        if self.is_alive() and not self.done.wait(EXIT_WAIT_S) and not self.lost:
            self.warn(f"did not take the run's last records within "
                      f"{EXIT_WAIT_S:g} s")


def bounded_app_tracker(app_url: str, rank: int, log_dir: Path):
    """
    #### labml's `AppTracker`, making a `BoundedSender` instead of its own thread
    """
    from labml.internal.app import AppTracker

    class BoundedAppTracker(AppTracker):
        def _check(self) -> bool:
            if self.stopped:
                return False
            if self.thread is None:
                self.thread = BoundedSender(self.app_track_url, app_url=app_url,
                                            rank=rank, log_dir=log_dir)
                atexit.register(self.thread.finish)
            return True

    return BoundedAppTracker


def install_bounded_sender(app_url: str, rank: int, log_dir: Path) -> None:
    """
    ### Make labml use `BoundedSender` for this process's runs

    labml builds its `AppTracker` inside `experiment.start()`, looking the
    class up in `labml.internal.app` then; replacing it there is the one place
    this page reaches into labml.
    """
    import labml.internal.app

    labml.internal.app.AppTracker = bounded_app_tracker(app_url, rank, log_dir)


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
    once more at exit, it re-chooses a chart's series if more have arrived.
    The training loop never waits for it; an app that fails makes it give up
    with one line, and at exit it gets at most `PAGE_EXIT_WAIT_S` more.

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

    def finish(self) -> None:
        """
        At exit, after the sender's last records: one last look, so that the
        series of the last steps are charted; at most `PAGE_EXIT_WAIT_S`.
        """
        self.exiting.set()
        self.done.wait(PAGE_EXIT_WAIT_S)


def git_root(path: Path) -> Path | None:
    for directory in (path, *path.parents):
        if (directory / ".git").exists():
            return directory
    return None


def start_labml(config: FinetuneConfig, ctx: DistContext, *, python_file: str
                ) -> str:
    """
    ## One labml run over all ranks; returns its uuid

    Rank 0 picks the uuid and probes the app (see [the app
    client](../app/client.html)); a broadcast tells the others, so every rank
    agrees without each probing (and under torchrun, where no parent process
    could pick for them). `python_file` is the job's source, which labml records.
    The app writer is on only when `app_url` answered the probe; otherwise
    nothing touches the network.
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
    if app_url is not None:
        settings.update(labml_app_settings(app_url))
        writers.add("app")
        install_bounded_sender(app_url, ctx.rank, log_dir)
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
    if app_url is not None and ctx.rank == 0:
        page = RunPageSetup(app_url, run_uuid)
        page.start()
        atexit.register(page.finish)
    return run_uuid


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
