"""The supervisor's decisions, without processes: which report is the cause, what
is an echo, where an error happened, and which rank a hang names."""

from __future__ import annotations

import types

import torch.distributed as dist

from labml_zero.launch import ranks_text, supervisor
from labml_zero.launch.supervisor import (Heartbeat, HangWatch, cause, is_echo,
                                          location, report)


def sent(rank: int, line: str, echo: bool) -> dict:
    return {"rank": rank, "line": line, "echo": echo, "traceback": f"tb {rank}"}


def test_no_failure_is_no_cause():
    assert cause({}, {}) is None


def test_first_report_that_is_no_echo_wins_over_earlier_echoes_and_deaths():
    reports = {0: sent(0, "DistBackendError: peer gone", True),
               2: sent(2, "OSError: disk full", False),
               3: sent(3, "ValueError: later", False)}
    error = cause(reports, {1: -9})
    assert str(error) == "rank 2 failed: OSError: disk full"
    assert error.traceback == "tb 2"
    assert error.others == ("rank 0 then: DistBackendError: peer gone",
                            "rank 3 then: ValueError: later",
                            "rank 1 then died (signal SIGKILL)")


def test_a_death_beats_echoes_and_an_echo_is_named_only_alone():
    reports = {0: sent(0, "DistBackendError: peer gone", True)}
    assert str(cause(reports, {1: 3})) == "rank 1 died (exit code 3)"
    assert str(cause(reports, {})) == "rank 0 failed: DistBackendError: peer gone"


def test_an_error_that_says_it_all_is_one_line():
    class Damaged(ValueError):
        user_error = True

    try:
        raise Damaged("rank-00001.safetensors: checksum mismatch")
    except Damaged as error:
        own = report(1, error)
    assert own["traceback"] == "" and own["brief"]
    reports = {0: sent(0, "Damaged: load failed on rank 1; see its error", True),
               1: own, 2: {**own, "rank": 2}}
    error = cause(reports, {})
    assert str(error).startswith("rank 1 failed: Damaged: rank-00001.safetensors")
    # every rank's same line, and the echoes pointing at it, add nothing
    assert error.others == () and error.traceback == ""


def test_last_words_of_a_rank_killed_by_a_signal():
    assert supervisor.last_words(-6, ["terminate called", "what(): x"]) == \
        "died (signal SIGABRT); its last words on stderr: terminate called | what(): x"
    assert "out-of-memory killer" in supervisor.last_words(-9, [])
    assert supervisor.last_words(-11, []) == \
        "died (signal SIGSEGV), printing nothing on stderr"


def test_echoes_are_recognised_through_the_exception_chain():
    assert is_echo(dist.DistBackendError("Connection closed by peer"))
    assert is_echo(RuntimeError("save failed on rank 1; see its error"))
    assert not is_echo(OSError(28, "No space left on device"))
    try:
        try:
            raise dist.DistNetworkError("reset")
        except dist.DistNetworkError:
            raise ValueError("while saving")
    except ValueError as error:
        assert is_echo(error)


def test_location_skips_torch_frames():
    ours = ("/x/labml_zero/finetune/job.py", 12, "train")
    theirs = (supervisor.TORCH_DIR + "distributed/distributed_c10d.py", 5, "wait")
    assert location([ours, theirs]) == "/x/labml_zero/finetune/job.py:12 in train"
    assert location([theirs]).endswith("distributed_c10d.py:5 in wait")
    assert location([]) == ""


def test_report_is_one_line_with_the_place():
    try:
        raise ValueError("bad header\n  in rank-00003.safetensors")
    except ValueError as error:
        line = report(3, error)["line"]
    assert line.startswith("ValueError: bad header in rank-00003.safetensors "
                           "(tests/test_supervisor.py:")
    assert line.endswith(" in test_report_is_one_line_with_the_place)")


def fake_shared(beats: list[int], waiting: list[int],
                steps: list[int] | None = None,
                published: list[int] | None = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(beats=beats, waiting=waiting,
                                 steps=steps or [-1] * len(beats),
                                 published=published or [0] * len(beats),
                                 where_of=lambda rank: f"where {rank}")


def test_hang_names_the_rank_not_waiting_for_a_peer():
    watch = HangWatch(3, 2.0)
    shared = fake_shared([1, 1, 1], [1, 0, 1])
    assert watch.check(shared, 0.0, [True] * 3) is None  # first beats: watched
    assert watch.check(shared, 1.9, [True] * 3) is None
    hung = watch.check(shared, 2.1, [True] * 3)
    # no step named: the beats, counted as beats
    assert str(hung) == ("rank 1 stopped making progress: no heartbeat for 2 s "
                         "after 1 heartbeat, at where 1")


def test_a_rank_hung_holding_the_gil_is_named_though_it_said_waiting():
    # both ranks last said "waiting" (rank 1 from the collective before it
    # hung); rank 1's watchdog then stopped publishing, rank 0's goes on
    watch = HangWatch(2, 2.0)
    for tick in range(12):
        now = tick * 0.25
        hung = watch.check(fake_shared([3, 3], [1, 1], published=[tick, 1]),
                           now, [True, True])
        assert hung is None or now > 2.0
    assert str(hung) == ("rank 1 stopped making progress: no heartbeat for 2 s "
                         "after 3 heartbeats, last seen at where 1 (its threads "
                         "stopped too: its main thread holds the GIL, or the "
                         "process is stopped)")


def test_hang_is_reported_after_the_step_the_rank_named():
    # a job beats twice at step 20 (after the step, after its validation): the
    # message counts steps, as the user does, not the 40 beats
    watch = HangWatch(2, 1.0)
    shared = fake_shared([40, 40], [1, 0], steps=[20, 20])
    watch.check(shared, 0.0, [True, True])
    hung = watch.check(shared, 1.5, [True, True])
    assert str(hung) == ("rank 1 stopped making progress: no heartbeat for 1 s "
                         "after step 20, at where 1")


def test_a_heartbeat_keeps_the_last_step_named():
    progress = Heartbeat([0], 0, [-1])
    assert progress.step() is None
    progress.beat(7)
    progress.beat()  # a beat without a step keeps the last one named
    assert (progress.count(), progress.step()) == (2, 7)
    # a rank that never names a step is counted in heartbeats
    assert Heartbeat([3], 0).step() is None


def test_hang_without_a_waiting_test_names_the_fewest_beats():
    watch = HangWatch(2, 1.0)
    watch.check(fake_shared([1, 1], [0, 0]), 0.0, [True, True])
    shared = fake_shared([2, 1], [0, 0])
    assert watch.check(shared, 0.5, [True, True]) is None
    assert watch.check(shared, 1.2, [True, True]).rank == 1


def test_no_hang_before_the_first_beat_or_after_a_rank_ended():
    watch = HangWatch(2, 1.0)
    assert watch.check(fake_shared([0, 0], [0, 0]), 100.0, [True, True]) is None
    watch.check(fake_shared([1, 0], [0, 0]), 100.0, [True, True])
    # rank 0 beat once and ended well; rank 1 never beat
    assert watch.check(fake_shared([1, 0], [0, 0]), 200.0, [False, True]) is None
    # no timeout: nothing is ever a hang
    free = HangWatch(1, None)
    free.check(fake_shared([1], [0]), 0.0, [True])
    assert free.check(fake_shared([1], [0]), 1e9, [True]) is None


def test_ranks_are_counted_in_words():
    assert (ranks_text(1), ranks_text(2)) == ("1 rank", "2 ranks")
