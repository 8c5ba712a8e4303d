"""`bench/export_memory.py` on CPU: the tiny model saved with and without
masters, exported by a child process, one line each; it removes what it
wrote and keeps the folders it was given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity

from bench import export_memory
from labml_zero.zero3.checkpoint import (CheckpointReader, save_checkpoint,
                                         saved_tensors)
from tests.optimizers.test_narrow_moments import sharded
from tests.optimizers.test_offload import run_steps


@pytest.mark.distributed
def test_a_line_per_model_with_and_without_masters(tmp_path):
    out = tmp_path / "lines.jsonl"
    work, ckpts = tmp_path / "work", tmp_path / "ckpts"
    for frozen in (["--frozen"], []):
        export_memory.main(["--model", "tiny", *frozen, "--dir", str(work),
                            "--checkpoint-dir", str(ckpts), "--out", str(out)])
    frozen, trained = [json.loads(line) for line in out.read_text().splitlines()]
    assert (frozen["masters"], trained["masters"]) == (False, True)
    # the same bf16 export either way; the largest tensor read is the bf16
    # weight, or its fp32 master: twice the bytes
    assert frozen["export_bytes"] == trained["export_bytes"] > 0
    assert trained["largest_tensor_read_bytes"] == 2 * frozen["largest_tensor_read_bytes"]
    assert frozen["peak_rss_bytes"] > frozen["largest_tensor_read_bytes"]
    # what it wrote is gone; the folders it was given stay
    assert work.is_dir() and ckpts.is_dir()
    assert not any(work.iterdir()) and not any(ckpts.iterdir())


# ## What reading a tensor allocates, measured
#
# The profiler records every CPU allocation and free with its address, so
# the bytes that assembling one parameter holds at once are the peak of the
# allocations made since it was asked for and not yet freed (what the
# previous parameter left, freed meanwhile, does not count). The count must
# be that peak, parameter by parameter.


def assembly_peaks(reader, trace: Path) -> dict[str, int]:
    """Each parameter's peak of bytes allocated while `saved_tensors`
    assembles it."""
    tensors = saved_tensors(reader)
    peaks = {}
    while True:
        with torch.profiler.profile(activities=[ProfilerActivity.CPU],
                                    profile_memory=True) as profiler:
            item = next(tensors, None)
        if item is None:
            return peaks
        profiler.export_chrome_trace(str(trace))
        events = sorted((e for e in json.loads(trace.read_text())["traceEvents"]
                         if e.get("name") == "[memory]"),
                        key=lambda e: (e["ts"], e["args"]["Ev Idx"]))
        live, held, peak = {}, 0, 0
        for event in events:
            address, nbytes = event["args"]["Addr"], event["args"]["Bytes"]
            if nbytes > 0:
                live[address] = nbytes
                held += nbytes
            elif address in live:
                held -= live.pop(address)
            peak = max(peak, held)
        peaks[item[0]] = peak
        del item


@pytest.mark.parametrize("states", ["bf16-kahan", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_read_bytes_are_what_the_reader_allocates(tmp_path, states, dtype):
    """A trained model's checkpoint: chunks with a master, or (`"bf16-kahan"`)
    with a compensation instead, and frozen ones with neither."""
    model, optimizer = sharded(dtype, states)
    run_steps(model, optimizer, range(2))
    save_checkpoint(tmp_path / "ck", model, optimizer)
    reader = CheckpointReader(tmp_path / "ck")
    if states == "bf16-kahan":
        assert any(reader.adds_compensation(name) for name in reader.params)
    peaks = assembly_peaks(reader, tmp_path / "trace.json")
    assert export_memory.largest_read_bytes(tmp_path / "ck") == max(peaks.values())
    assert peaks == {name: export_memory.read_bytes(reader, name)
                     for name in reader.params}
