"""The benchmark's placement workloads (W5, W3R) and host-memory watchdog, on CPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench import pair as bench_pair
from bench import run as bench_run
from bench.host_memory import HostMemoryWatch, exit_on_exhausted, meminfo, rss_peak


def test_offloaded_and_resident_workloads_run_tiny():
    # W5: half the optimizer states on the simulated device's host; W3R: frozen
    # chunks resident. Both train as their plain twins (W3 for W3R) do.
    lines = {line["workload"]: line for line in bench_run.main([
        "--tiny", "--cpu", "--workloads", "W3,W3R,W5", "--engines", "labml_zero",
        "--steps", "2", "--warmup", "1", "--no-profile"])}
    assert all(line["status"] == "ok" for line in lines.values())
    w5, w3r, w3 = lines["W5"], lines["W3R"], lines["W3"]
    assert w5["info"]["offloaded_fraction"] >= 0.5
    assert w5["memory_model_gib"]["host_states"] > 0
    assert w3r["info"]["resident_chunks"] > 0
    assert w3r["loss"] == pytest.approx(w3["loss"], abs=1e-6)
    # after the first step the frozen chunks are not gathered again
    gathered = w3r["comm_bytes_per_step"]["all_gather"]
    assert gathered < w3["comm_bytes_per_step"]["all_gather"]
    assert w3r["host_rss_peak_gib"] > 0


def test_a_rank_ends_itself_once_its_record_is_written(monkeypatch, tmp_path):
    # The cause of an occasional "rank 0 died (signal SIGABRT)" under load: a
    # rank that returned into the interpreter's teardown, where gloo may abort
    # after the work is done. The worker writes its record, then ends its
    # process itself (`end_process`), never returning into that teardown.
    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(bench_pair.os, "_exit", fake_exit)
    # a spawned rank's process group, faked
    destroyed = []
    monkeypatch.setattr(bench_pair.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(bench_pair.dist, "destroy_process_group",
                        lambda: destroyed.append(True))
    monkeypatch.setattr(bench_pair, "measure_rank",
                        lambda ctx, engine, workload, run, progress: {"loss": 1.0})
    with pytest.raises(SystemExit) as ended:
        bench_pair.worker(SimpleNamespace(rank=0), "labml_zero",
                         bench_run.workloads()["W3R"], bench_run.RunConfig(),
                         str(tmp_path))
    assert ended.value.code == 0 and destroyed == [True]
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["status"] == "ok" and record["loss"] == 1.0


def test_offloaded_predicted_peak_is_the_placements(capfd):
    # W6 at world size 1, at two micro-batch sizes (--batch): the line's
    # predicted peak is the automatic placement's own, which rank 0 printed
    lines = bench_run.main([
        "--tiny", "--cpu", "--workloads", "W6", "--engines", "labml_zero",
        "--batch", "2,4", "--world-size", "1", "--steps", "1", "--warmup", "1",
        "--no-profile"])
    assert [line["batch_per_gpu"] for line in lines] == [2, 4]
    for line in lines:
        assert line["status"] == "ok" and line["world_size"] == 1
        info, memory = line["info"], line["memory_model_gib"]
        assert info["offloaded_chunks"] > 0
        assert memory["predicted_peak"] * bench_run.GIB == pytest.approx(
            info["predicted_peak"], rel=1e-12)
    printed = capfd.readouterr().out
    assert printed.count("automatic offload: optimizer states of") == 2
    assert printed.count("automatic offload after 2 steps: measured peaks") == 2


def test_batch_flag_checks_its_values():
    for bad in ("0", "2,x", ""):
        with pytest.raises(SystemExit, match="--batch"):
            bench_run.parse_args(["--batch", bad])
    assert bench_run.parse_args(["--batch", "2,4,8"]).batch_list == [2, 4, 8]
    assert bench_run.parse_args([]).batch_list == [None]


def test_one_gpu_workloads():
    from bench.workloads import workloads

    known = workloads()
    w6, w21, w21o = known["W6"], known["W2-1"], known["W2-1O"]
    assert (w6.model.n_layers, w6.model.d_model, w6.model.n_vocab) == (36, 5120, 50688)
    assert w6.offload == "auto" and w6.activation_checkpointing
    assert w21.model.d_model == 4096 and w21.offload is None
    assert w21.activation_checkpointing and w21o.offload == "auto"


def test_watchdog_reports_a_host_out_of_memory():
    info = meminfo()
    assert info is not None and 0 < info["MemAvailable"] <= info["MemTotal"]
    assert rss_peak() > 0
    exits = []
    # a reserve above the host's memory: the first sample is "exhausted"
    watch = HostMemoryWatch(reserve=info["MemTotal"] + 1, on_exhausted=exits.append)
    with watch:
        pass
    # called once (the watch stops itself), with the bytes in use
    assert len(exits) == 1 and watch.used_peak >= exits[0] > 0


def test_exhausted_rank_writes_its_record_and_exits(monkeypatch, tmp_path):
    path = tmp_path / "rank0.json"

    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(bench_pair.os, "_exit", fake_exit)
    monkeypatch.setattr("bench.host_memory.os._exit", fake_exit)
    exhausted = exit_on_exhausted(lambda record: path.write_text(json.dumps(record)))
    with pytest.raises(SystemExit) as ended:
        exhausted(250 * 2**30)
    assert ended.value.code == 1
    record = json.loads(path.read_text())
    assert record["status"] == "oom" and record["where"] == "host"
    assert "250.0 GiB in use" in record["error"]


def test_watchdog_checks_its_settings():
    with pytest.raises(ValueError, match="reserve must be >= 0"):
        HostMemoryWatch(reserve=-1, on_exhausted=print)
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        HostMemoryWatch(reserve=0, on_exhausted=print, interval_s=0)
