"""Sharded checkpoints: bit-exact resume, resharding, atomic saves, export, errors."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import shard_model, zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.checkpoint import (
    CheckpointError,
    CheckpointReader,
    consolidated_tensors,
    export_full_state_dict,
    load_checkpoint,
    prefix_rename,
    save_checkpoint,
)
from labml_zero.zero3.checkpoint import save as save_module
from tests import tolerance
from tests.distributed import run_distributed
from tests.zero3.models import TINY_TERMS, batch, tiny_layers

# One global batch of 6 rows, split evenly at world sizes 1, 2 and 3, so every
# world size takes the same steps (up to the order of the gradient sums).
ROWS = 6
SAVED_AT, RESUMED_FOR = 3, 3
RESUMED_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, steps=RESUMED_FOR, lr=3e-3), 1.5)
KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


# ## Helpers, run inside the ranks


class Local:
    """A one-rank context: without a process group the engine runs locally."""

    rank, world_size, device = 0, 1, torch.device("cpu")


def build(ctx, dtype, *, chunk_numel=200, api="sequential", seed=0, group=None):
    """A sharded tiny model and its optimizer; `seed` changes the initial weights."""
    layers = tiny_layers(seed)
    config = ZeroConfig(dtype=dtype, chunk_numel=chunk_numel, align=4)
    if api == "sequential":
        model = Zero3Sequential(zero3_layers(layers, device=ctx.device, config=config,
                                             group=group))
    else:
        # the generic wrapper: first and last layers in the root unit, so chunk
        # order and layout differ from the sequential one; the names do not
        model = shard_model(nn.Sequential(*layers), layers[1:4], device=ctx.device,
                            config=config, group=group)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3, weight_decay=0.01)
    return model, optimizer


def train(ctx, model, optimizer, steps, *, noisy=False):
    """Train on this rank's rows; `noisy` draws from every RNG a loop may use."""
    rows = ROWS // ctx.world_size
    mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    dtype = model.chunks[0].dtype
    for step in steps:
        x, y = batch(step, ROWS)
        if noisy:
            # torch, python and numpy RNGs, as dropout or data sampling would
            x = x + 0.1 * torch.randn_like(x) * random.random() * np.random.rand()
        x, y = x[mine].to(ctx.device, dtype), y[mine].to(ctx.device)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def weights(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (gathered between steps)."""
    with model.runtime.gathered():
        return {name: p.detach().clone()
                for c in model.chunks for name, p in zip(c.names, c.params)}


# ## Resume at the same world size


def resume_run(ctx, root):
    """Save after k steps, continue; load into a fresh model, continue; compare."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        path = Path(root) / str(dtype)
        model, optimizer = build(ctx, dtype)
        train(ctx, model, optimizer, range(SAVED_AT), noisy=True)
        save_checkpoint(path, model, optimizer, extra={"scale": 1024.0, "good": 7},
                        rank_extra={"position": 10 + ctx.rank})
        after_save = {n: t.clone() for n, t in weights(model).items()}
        train(ctx, model, optimizer, range(SAVED_AT, SAVED_AT + RESUMED_FOR),
              noisy=True)
        uninterrupted = weights(model)

        # Other initial weights, so that anything not loaded shows.
        fresh, fresh_optimizer = build(ctx, dtype, seed=1)
        loaded = load_checkpoint(path, fresh, fresh_optimizer)
        at_load = weights(fresh)
        train(ctx, fresh, fresh_optimizer, range(SAVED_AT, SAVED_AT + RESUMED_FOR),
              noisy=True)
        resumed = weights(fresh)
        out[str(dtype)] = {
            "at_load_equal": all(torch.equal(after_save[n], at_load[n])
                                 for n in after_save),
            "resumed_equal": all(torch.equal(uninterrupted[n], resumed[n])
                                 for n in uninterrupted),
            "moved": any(not torch.equal(after_save[n], resumed[n])
                         for n in after_save),
            "loaded": loaded,
        }

        if dtype == torch.float32:
            # The reference for resharding: continue at this world size, no noise.
            plain, plain_optimizer = build(ctx, dtype, seed=2)
            load_checkpoint(path, plain, plain_optimizer)
            train(ctx, plain, plain_optimizer, range(SAVED_AT, SAVED_AT + RESUMED_FOR))
            out["reference"] = weights(plain)
    return out


def world_2_runs(ctx, root):
    """Every world-size-2 scenario in one spawn: processes are slow to start."""
    return {
        "resume": resume_run(ctx, root),
        "crash": crash_run(ctx, str(Path(root) / "crash")),
        "export": export_run(ctx, str(Path(root) / "hf")),
        "changed": changed_shard_run(ctx, str(Path(root) / "changed")),
    }


@pytest.fixture(scope="module")
def at_2(tmp_path_factory):
    """The results of `world_2_runs` on each rank, and where it saved."""
    root = tmp_path_factory.mktemp("at_2")
    return root, run_distributed(world_2_runs, 2, str(root))


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_resume_is_bit_exact(at_2, dtype):
    _, results = at_2
    for rank, result in enumerate(results):
        run = result["resume"][dtype]
        assert run["at_load_equal"], rank
        assert run["moved"], rank
        # every RNG, every moment and every master came back to the last bit
        assert run["resumed_equal"], rank
        loaded = run["loaded"]
        assert loaded.extra == {"scale": 1024.0, "good": 7}
        assert loaded.rank_extra == {"position": 10 + rank}
        assert (loaded.world_size, loaded.resharded) == (2, False)


@pytest.mark.distributed
def test_manifest_describes_the_layout(at_2):
    root, _ = at_2
    reader = CheckpointReader(root / "torch.bfloat16")
    manifest = reader.manifest
    assert manifest["world_size"] == 2
    assert sorted(manifest["files"]) == [
        "extra.pt", "rank-00000.pt", "rank-00000.safetensors", "rank-00001.pt",
        "rank-00001.safetensors",
    ]
    layers = tiny_layers()
    expected = {f"{i}.{n}": tuple(p.shape)
                for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    assert reader.shapes == expected
    for chunk in manifest["chunks"]:
        assert chunk["numel"] % 2 == 0 and chunk["dtype"] == "bfloat16"
        # trainable chunks were saved with their state, frozen ones without
        assert (chunk["step"] == SAVED_AT) == chunk["trainable"] == chunk["has_master"]
        offsets = [p["offset"] for p in chunk["params"]]
        assert offsets == sorted(offsets)
    assert manifest["param_groups"][0]["lr"] == 3e-3
    assert manifest["param_groups"][0]["betas"] == [0.9, 0.999]


@pytest.mark.distributed
def test_manifest_holds_every_ranks_digests(at_2):
    """Each rank hashed its own files; rank 0 wrote all of them, and they hold."""
    import hashlib

    root, _ = at_2
    for dtype in ("torch.float32", "torch.bfloat16"):
        reader = CheckpointReader(root / dtype)
        assert sorted(reader.digests) == sorted(reader.manifest["files"])
        for name, digest in reader.digests.items():
            data = (root / dtype / name).read_bytes()
            assert digest == "sha256:" + hashlib.sha256(data).hexdigest(), name
        reader.verify_files()


# ## Resharding


def reshard_run(ctx, source, resaved, api, chunk_numel, group=None):
    """Load at this world size (and layout), save again, continue training."""
    model, optimizer = build(ctx, torch.float32, chunk_numel=chunk_numel, api=api,
                             seed=3, group=group)
    loaded = load_checkpoint(source, model, optimizer)
    if resaved is not None:
        save_checkpoint(resaved, model, optimizer)
        # the bf16 checkpoint too, for the element-by-element comparison
        model16, optimizer16 = build(ctx, torch.bfloat16, chunk_numel=chunk_numel,
                                     api=api, seed=3)
        load_checkpoint(Path(source).parent / "torch.bfloat16", model16, optimizer16)
        save_checkpoint(resaved + "-bf16", model16, optimizer16)
    train(ctx, model, optimizer, range(SAVED_AT, SAVED_AT + RESUMED_FOR))
    return {"loaded": loaded, "weights": weights(model)}


def world_3_runs(ctx, source, at_3):
    """2 → 3 on three ranks, then 3 → 2 on a process group of ranks 0 and 1."""
    out = {"from 2": reshard_run(ctx, source, at_3, "generic", 96)}
    # Every rank takes part in creating a group, member or not. One spawn
    # fewer: starting processes is most of this file's time.
    pair = dist.new_group([0, 1])
    if ctx.rank < 2:
        in_pair = SimpleNamespace(rank=ctx.rank, world_size=2, device=ctx.device)
        out["from 3"] = reshard_run(in_pair, at_3, None, "sequential", 128, pair)
    dist.barrier()
    return out


def same_contents(a: Path, b: Path) -> None:
    """Two checkpoints hold the same elements, whatever their layouts."""
    old, new = CheckpointReader(a), CheckpointReader(b)
    assert old.shapes == new.shapes
    for name in old.params:
        assert old.step(name) == new.step(name), name
        for kind in KINDS:
            if kind != "param" and old.step(name) is None:
                continue
            assert torch.equal(old.read(name, kind), new.read(name, kind)), (name, kind)


@pytest.mark.distributed
def test_reshard_2_to_3_to_1_and_2(at_2):
    root, results = at_2
    reference = results[0]["resume"]["reference"]
    source = root / "torch.float32"
    at_3 = str(root / "resaved-at-3")

    # 2 → 3 with another chunk size and the generic wrapper's layout, then
    # 3 → 2 with a third chunk size
    results_3 = run_distributed(world_3_runs, 3, str(source), at_3)
    same_contents(source, Path(at_3))
    same_contents(root / "torch.bfloat16", Path(at_3 + "-bf16"))
    assert CheckpointReader(at_3).world_size == 3
    from_2 = [result["from 2"] for result in results_3]
    from_3 = [result["from 3"] for result in results_3[:2]]
    assert [r["loaded"].world_size for r in from_2 + from_3] == [2, 2, 2, 3, 3]
    # 3 → 1, in this process
    at_1 = str(root / "resaved-at-1")
    result_1 = reshard_run(Local, at_3, at_1, "sequential", 64)
    same_contents(source, Path(at_1))
    same_contents(root / "torch.bfloat16", Path(at_1 + "-bf16"))

    for result in [*from_2, *from_3, result_1]:
        assert result["loaded"].resharded
        for name, expected in reference.items():
            # the sums of gradients over ranks come in another order: fp32
            # rounding through the steps after the load (tests/tolerance.py)
            diff = (result["weights"][name] - expected).abs().max().item()
            assert diff <= RESUMED_ERROR, (name, diff)


# ## Atomic save


def crash_run(ctx, root):
    """A save that fails on rank 1 after writing part of its file."""
    Path(root).mkdir(exist_ok=True)
    path = Path(root) / "checkpoint"
    model, optimizer = build(ctx, torch.bfloat16)
    train(ctx, model, optimizer, range(1))
    save_checkpoint(path, model, optimizer)
    saved = weights(model)
    train(ctx, model, optimizer, range(1, 2))

    real_write = save_module.write_tensors
    seen_mid_save = {}

    def crashing_write(tensors, file, *, metadata):
        real_write(tensors, file, metadata=metadata)
        if ctx.rank == 1:
            with open(file, "r+b") as f:
                f.truncate(os.path.getsize(file) // 2)
            # mid-save, `path` is still the complete previous checkpoint
            reader = CheckpointReader(path)
            seen_mid_save["complete"] = all(
                reader.read(name, "param").numel() == reader.params[name].numel
                for name in reader.params
            )
            seen_mid_save["listing"] = sorted(os.listdir(path))
            raise OSError("disk full (simulated)")

    save_module.write_tensors = crashing_write
    try:
        save_checkpoint(path, model, optimizer)
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    finally:
        save_module.write_tensors = real_write

    fresh, fresh_optimizer = build(ctx, torch.bfloat16, seed=1)
    load_checkpoint(path, fresh, fresh_optimizer)
    loaded = weights(fresh)
    return {
        "error": error,
        "seen_mid_save": seen_mid_save,
        "previous_loads": all(torch.equal(saved[n], loaded[n]) for n in saved),
        "siblings": sorted(os.listdir(root)),
    }


@pytest.mark.distributed
def test_crash_mid_save_keeps_previous_checkpoint(at_2):
    _, results = at_2
    results = [result["crash"] for result in results]
    assert results[1]["error"] == "OSError: disk full (simulated)"
    assert results[0]["error"] == (
        "CheckpointError: save failed on rank 1; see its error"
    )
    assert results[1]["seen_mid_save"] == {
        "complete": True,
        "listing": ["manifest.json", "rank-00000.pt", "rank-00000.safetensors",
                    "rank-00001.pt", "rank-00001.safetensors"],
    }
    for result in results:
        assert result["previous_loads"]
        # the half-written temporary directory is gone
        assert result["siblings"] == ["checkpoint"]


# ## A changed file on one rank


def changed_shard_run(ctx, root):
    """Rank 1's shard file changes after the save; both ranks then load."""
    path = Path(root)
    model, optimizer = build(ctx, torch.bfloat16)
    train(ctx, model, optimizer, range(1))
    save_checkpoint(path, model, optimizer)
    if ctx.rank == 1:
        shard = path / "rank-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    # barrier: nobody loads before the file has changed
    dist.barrier()
    fresh, fresh_optimizer = build(ctx, torch.bfloat16, seed=1)
    before = weights(fresh)
    try:
        load_checkpoint(path, fresh, fresh_optimizer)
        error = None
    except CheckpointError as caught:
        error = str(caught)
    after = weights(fresh)
    return {"error": error, "unchanged": all(torch.equal(before[n], after[n])
                                             for n in before),
            "no_state": not fresh_optimizer.state, "path": str(path)}


@pytest.mark.distributed
def test_a_changed_shard_on_one_rank_is_refused_on_every_rank(at_2):
    _, results = at_2
    results = [result["changed"] for result in results]
    shard = Path(results[1]["path"]) / "rank-00001.safetensors"
    assert results[1]["error"] == (f"{shard}: checksum mismatch, the file was "
                                   "changed after it was saved")
    assert results[0]["error"] == "load failed on rank 1; see its error"
    for result in results:
        assert result["unchanged"] and result["no_state"]


# ## Export


def export_run(ctx, out_dir):
    """A tiny GPT-NeoX, sharded in bf16, exported into Hugging Face files."""
    from labml_zero.neox.hf_checkpoint import save_hf_checkpoint
    from labml_zero.neox.model import NeoXConfig, build_layers, hf_prefix

    config = NeoXConfig(n_vocab=97, d_model=32, n_heads=2, n_layers=2)
    torch.manual_seed(0)
    layers = build_layers(config)
    original = copy.deepcopy(layers)
    rename = prefix_rename([hf_prefix(layer) for layer in layers])
    model = Zero3Sequential(zero3_layers(
        layers, device=ctx.device,
        config=ZeroConfig(dtype=torch.bfloat16, chunk_numel=1000, align=8),
    ))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-3)
    # Before any step the masters are the exact fp32 weights the model was built
    # with, so the export equals the unsharded layers bit for bit.
    export_full_state_dict(
        lambda tensors: save_hf_checkpoint(out_dir, config, tensors,
                                           max_shard_bytes=20_000),
        model, optimizer, rename=rename,
    )
    # Without the masters, the bf16 values; a consumer that stops early is fine.
    first = {}
    if ctx.rank == 0:
        pairs = consolidated_tensors(model, dtype=torch.float16)
        first = dict([next(pairs)])
        for _ in pairs:
            pass
    else:
        for _ in consolidated_tensors(model):
            pass
    return {"original": [layer.state_dict() for layer in original], "first": first}


@pytest.mark.distributed
def test_export_streams_into_hf_checkpoint(at_2):
    from labml_zero.neox.hf_checkpoint import HFCheckpoint
    from labml_zero.neox.model import NeoXConfig, build_layers

    root, results = at_2
    out_dir = root / "hf"
    results = [result["export"] for result in results]
    exported = HFCheckpoint(out_dir)
    assert len(list(out_dir.glob("model-*.safetensors"))) > 1
    layers = build_layers(NeoXConfig(n_vocab=97, d_model=32, n_heads=2, n_layers=2))
    for layer, original in zip(layers, results[0]["original"]):
        state = exported.layer_state_dict(layer)
        assert state.keys() == original.keys()
        for name, tensor in original.items():
            assert tensor.dtype == torch.float32
            assert torch.equal(state[name], tensor), name
    [(name, tensor)] = results[0]["first"].items()
    assert name == "0.embed_in.weight" and tensor.dtype == torch.float16
    assert results[1]["first"] == {}


# ## Export with hybrid sharding: one writer in the world
#
# Every shard group holds the same shards and `comm.rank` 0 is one rank in each
# group; only the first group's rank 0 may write, or the groups' renames race.


def hybrid_export_run(ctx, out_dir, shard_group_size=None):
    """A tiny GPT-NeoX, sharded in bf16 over shard groups of `shard_group_size`,
    exported three ways: the job's `export_hf` (with its side files), the
    adapter export's view of the trainable chunks, and a target that fails.
    Returns the world ranks that wrote or read anything, and what each
    rank raised."""
    from labml_zero.hf.peft_adapter import TrainableOnly
    from labml_zero.neox import family
    from labml_zero.neox.model import NeoXConfig, build_layers

    config = NeoXConfig(n_vocab=97, d_model=32, n_heads=2, n_layers=2)
    torch.manual_seed(0)
    model = Zero3Sequential(zero3_layers(
        build_layers(config), device=ctx.device,
        config=ZeroConfig(dtype=torch.bfloat16, chunk_numel=1000, align=8,
                          shard_group_size=shard_group_size)))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-3)
    rank = dist.get_rank() if dist.is_initialized() else 0
    seen = {"side files": [], "adapter": []}

    def side_files(tokenizer, snapshot):
        seen["side files"].append(rank)
        return {"tokenizer.json": "{}"}

    reads = family.hf_side_files
    family.hf_side_files = side_files
    try:
        exported = family.export_hf(Path(out_dir), model, None, config, optimizer,
                                    tokenizer="tokenizer.json")
    finally:
        family.hf_side_files = reads

    def count(tensors):
        seen["adapter"].append(rank)
        return len(list(tensors))

    trainable = TrainableOnly(model.runtime,
                              [c for c in model.chunks if c.trainable])
    counted = export_full_state_dict(count, trainable, optimizer)

    def fail(tensors):
        next(tensors)
        raise ValueError("disk full")

    try:
        export_full_state_dict(fail, model, optimizer)
        raised = None
    except Exception as error:
        raised = (type(error).__name__, str(error))
    return {"rank": rank, "seen": seen, "exported": exported, "counted": counted,
            "raised": raised}


@pytest.mark.distributed
def test_hybrid_export_has_one_writer_and_fails_on_every_rank(tmp_path):
    hybrid = run_distributed(hybrid_export_run, 4, str(tmp_path / "hybrid"), 2)
    single = hybrid_export_run(Local, str(tmp_path / "single"))
    for result in hybrid:
        # rank 0 of the first shard group wrote, read and returned; none else
        writer = result["rank"] == 0
        assert result["seen"] == ({"side files": [0], "adapter": [0]} if writer
                                  else {"side files": [], "adapter": []})
        assert result["exported"] == (tmp_path / "hybrid" if writer else None)
        assert result["counted"] == (single["counted"] if writer else None)
        # the writer's failure reached every rank: its own error there, the
        # first group's outcome in the other group
        assert result["raised"] == (
            ("ValueError", "disk full") if writer else
            ("CheckpointError", "export failed on rank 0; see its error")
            if result["rank"] < 2 else
            ("CheckpointError", "export failed in the first shard group; see its "
                                "error"))
    # the files are those one rank writes
    files = sorted(p.name for p in (tmp_path / "hybrid").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "single").iterdir())
    assert "tokenizer.json" in files
    for name in files:
        assert ((tmp_path / "hybrid" / name).read_bytes()
                == (tmp_path / "single" / name).read_bytes()), name
    assert not [p for p in tmp_path.iterdir() if p.name not in ("hybrid", "single")]


# ## Export of what lives on the host


@pytest.mark.parametrize("offloaded", ["optimizer", "params"])
def test_export_gathers_offloaded_state_from_the_device(monkeypatch, offloaded):
    """NCCL's all-gather reads device tensors only, and an offloaded master or
    parameter shard lives on the host. On the CPU the two are one, so the
    communicator is told its device is `meta`: a source left on the host
    shows as `cpu`."""
    model, _ = build(Local, torch.bfloat16, chunk_numel=64)
    shards = model.get_trainable_chunk()
    optimizer = AdamFP16(shards, lr=3e-3, offload=(
        range(len(shards)) if offloaded == "optimizer" else None))
    if offloaded == "params":
        for chunk in model.chunks:
            chunk.offload_shard()
        optimizer = None  # the export reads the shards themselves
    else:
        train(Local, model, optimizer, range(2))
    assert (optimizer is not None and len(optimizer.host) == len(shards)
            or all(chunk.shard_on_host for chunk in model.chunks))
    comm = model.runtime.comm
    handed = []
    monkeypatch.setattr(comm, "device", torch.device("meta"))
    monkeypatch.setattr(comm, "all_gather",
                        lambda full, shard: handed.append((full.device,
                                                           shard.device)))
    # a rank that only contributes: it gathers every chunk and copies none of
    # it to the host (a meta tensor has no data to copy)
    monkeypatch.setattr(comm, "rank", 1)
    for _ in consolidated_tensors(model, optimizer):
        pass
    meta = torch.device("meta")
    assert handed == [(meta, meta)] * len(model.chunks)


# ## Errors, at world size 1 in this process


def trained_checkpoint(path: Path):
    model, optimizer = build(Local, torch.bfloat16, chunk_numel=64)
    train(Local, model, optimizer, range(2))
    save_checkpoint(path, model, optimizer)
    return model, optimizer


def test_single_file_export_and_offline_reader(tmp_path):
    from safetensors.torch import load_file

    model, optimizer = trained_checkpoint(tmp_path / "ck")
    export_full_state_dict(tmp_path / "full.safetensors", model, optimizer)
    full = load_file(tmp_path / "full.safetensors")
    reader = CheckpointReader(tmp_path / "ck")
    assert full.keys() == reader.params.keys()
    for name, tensor in full.items():
        # masters for trainable chunks, the bf16 values (upcast) for frozen ones
        assert torch.equal(tensor.reshape(-1), reader.read(name, "master")), name
        assert tensor.shape == reader.params[name].shape
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_errors_name_the_problem_and_change_nothing(tmp_path):
    path = tmp_path / "ck"
    trained_checkpoint(path)
    model, optimizer = build(Local, torch.bfloat16, chunk_numel=64, seed=5)
    before = weights(model)

    def refused(match: str, target=path, into=model):
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(target, into, optimizer)

    # a different model: the readout has 6 outputs instead of 5
    layers = tiny_layers()
    layers[4] = nn.Linear(13, 6)
    other = Zero3Sequential(zero3_layers(
        layers, device="cpu", config=ZeroConfig(chunk_numel=64, align=4)))
    refused(r"different model: parameter '4.weight' has shape \(5, 13\) in the "
            r"checkpoint, \(6, 13\) in the model", into=other)

    shard = path / "rank-00000.safetensors"
    good = shard.read_bytes()
    # a damaged header of the right size
    shard.write_bytes(b"\xff" * 8 + good[8:])
    refused(r"corrupted shard file .*rank-00000\.safetensors: .*header")
    # a truncated file
    shard.write_bytes(good[:-10])
    refused(r"corrupted shard file .*rank-00000\.safetensors: \d+ bytes, the "
            r"manifest says \d+")
    shard.unlink()
    refused(r"missing shard file .*rank-00000\.safetensors")
    shard.write_bytes(good)
    (path / "manifest.json").rename(path / "manifest.bak")
    refused(r"no manifest\.json in .*ck: not a checkpoint")
    refused(r"no checkpoint at .*nowhere$", target=tmp_path / "nowhere")
    # a save interrupted between its two renames left the old one aside
    (tmp_path / ".gone.old-0123").mkdir()
    refused(r"no checkpoint at .*gone; an interrupted save left the previous one "
            r"at .*\.gone\.old-0123", target=tmp_path / "gone")
    (path / "manifest.bak").rename(path / "manifest.json")

    after = weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not optimizer.state
    load_checkpoint(path, model, optimizer)


def test_save_refuses_bad_targets_and_values(tmp_path):
    model, optimizer = build(Local, torch.float32, chunk_numel=64)
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"notes exists and is not a checkpoint"):
        save_checkpoint(precious, model, optimizer)
    assert (precious / "todo.txt").read_text() == "keep me"

    class Scaler:
        pass

    with pytest.raises(CheckpointError, match=r"^extra must hold only tensors"):
        save_checkpoint(tmp_path / "ck", model, optimizer, extra={"s": Scaler()})
    assert sorted(os.listdir(tmp_path)) == ["notes"]


# ## A checkpoint without a master: `"bf16-kahan"`
#
# Its weight is the pair $w + c$, the bf16 parameter and its compensation, so
# whatever reads a master from it (a load that keeps one, the reader, the
# exports) must read $w + c$, not $w$ alone. Both sides of each comparison
# are the same fp32 sum of the same two bf16 values: equal bit for bit.


def kahan_trained(path: Path, *, offload: bool = False):
    """A bf16 model trained with `"bf16-kahan"`, saved at `path`, and each
    trainable chunk's pair $w + c$, [S] fp32."""
    from tests.optimizers.test_narrow_moments import sharded
    from tests.optimizers.test_offload import run_steps

    model, optimizer = sharded(torch.bfloat16, "bf16-kahan", offload=offload)
    run_steps(model, optimizer, range(5))
    save_checkpoint(path, model, optimizer)
    pairs = {id(chunk): chunk.shard.detach().float()
             + optimizer.state[chunk.shard]["compensation"].float()
             for chunk in model.chunks if chunk.trainable}
    # the compensation carries something: $w$ alone is not the weight
    assert any(not torch.equal(pairs[id(c)], c.shard.detach().float())
               for c in model.chunks if c.trainable)
    return model, optimizer, pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_kahan_checkpoint_resumes_from_w_plus_c(tmp_path, dtype):
    from tests.optimizers.test_narrow_moments import sharded

    model, _, pairs = kahan_trained(tmp_path / "ck")
    fresh, fresh_opt = sharded(dtype, "fp32")
    load_checkpoint(tmp_path / "ck", fresh, fresh_opt)
    reader = CheckpointReader(tmp_path / "ck")
    for a, b in zip(model.chunks, fresh.chunks):
        if not a.trainable:
            continue
        pair = pairs[id(a)]
        # an fp32 shard is its own master
        master = (b.shard.detach() if dtype == torch.float32
                  else fresh_opt.state[b.shard]["master"])
        assert torch.equal(master, pair)
        # the shard: the saved $w$ itself in bf16, else the master's rounding
        shard = a.shard if dtype == torch.bfloat16 else pair.to(dtype)
        assert torch.equal(b.shard.detach(), shard)
        for name, slot in zip(a.names, a.spec.slots):
            # one rank: the shard is the whole chunk
            assert torch.equal(reader.read(name, "master"),
                               pair[slot.offset:slot.end]), name


@pytest.mark.parametrize("offload, add_numel", [(False, None), (True, None),
                                                 (False, 3)])
def test_a_kahan_model_exports_w_plus_c(tmp_path, monkeypatch, offload, add_numel):
    """Live (`consolidated_tensors`) and saved (`saved_tensors`), fp32: the
    pair's sum, also where $c$ is added a few elements at a time. Cast to
    bf16 it is $w$ but at a tie ($|c|$ half the step to the neighbour it
    picks), where rounding to nearest even picks the even neighbour."""
    from labml_zero.zero3.checkpoint import export, saved_tensors

    if add_numel:
        monkeypatch.setattr(export, "ADD_NUMEL", add_numel)
    model, optimizer, pairs = kahan_trained(tmp_path / "ck", offload=offload)
    live = dict(consolidated_tensors(model, optimizer))
    saved = dict(saved_tensors(CheckpointReader(tmp_path / "ck")))
    for chunk in model.chunks:
        if not chunk.trainable:
            continue
        compensation = optimizer.state[chunk.shard]["compensation"].cpu()
        for name, param, slot in zip(chunk.names, chunk.params, chunk.spec.slots):
            want = pairs[id(chunk)][slot.offset:slot.end].view(param.shape)
            assert live[name].dtype == saved[name].dtype == torch.float32
            assert torch.equal(live[name], want), name
            assert torch.equal(saved[name], want), name
            w = chunk.shard.detach()[slot.offset:slot.end]
            c = compensation[slot.offset:slot.end]
            rounded = want.reshape(-1).bfloat16()
            moved = rounded != w
            bits = lambda t: t.view(torch.int16).int()  # noqa: E731
            assert bool(((bits(rounded) - bits(w))[moved].abs() == 1).all())
            assert bool(((rounded.float() - w.float())[moved].abs()
                         == 2 * c.float()[moved].abs()).all())
            assert bool((bits(rounded)[moved] % 2 == 0).all())
