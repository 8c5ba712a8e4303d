"""
The peers on W5: activation checkpointing and host offload change where memory
goes, not the math; what each engine does when it cannot offload; the offload
arithmetic of the baselines page.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from bench import pair as bench_pair
from bench import run as bench_run
from bench.baselines import (
    EngineUnavailable,
    build_ddp,
    build_deepspeed,
    build_fsdp2,
    deepspeed_config,
    deepspeed_memory,
    fsdp2_memory,
)
from bench.engine import meta_layers, random_batches
from bench.workloads import shrink, workloads
from labml_zero.launch import DistContext
from labml_zero.neox.model import TransformerLayer
from labml_zero.planner.memory_model import zero_model_states
from tests.distributed import run_distributed

STEPS = 3


def tiny_w5():
    """W5 shrunk: 2 layers of width 64, checkpointing and offload kept."""
    w5 = shrink(workloads()["W5"])
    assert w5.activation_checkpointing and w5.offload == "auto"
    return w5


def train(ctx: DistContext, build, workload) -> tuple[list[float], int, dict]:
    """`STEPS` steps from seed 0; losses, transformer-layer forwards, memory model."""
    torch.manual_seed(0)
    engine = build(ctx, workload)
    forwards = 0

    def count(module, args):
        nonlocal forwards
        forwards += isinstance(module, TransformerLayer)

    # Global hook: also sees the forwards that checkpointing reruns in backward.
    # A pre-hook: the rerun stops once it has rebuilt what backward needs
    # (checkpoint's early stop), so it never reaches a forward hook.
    handle = nn.modules.module.register_module_forward_pre_hook(count)
    batches = random_batches(workload, ctx, count=STEPS, seed=0)
    losses = [engine.step(batch).item() for batch in batches]
    handle.remove()
    return losses, forwards, engine.memory_model


def train_each(ctx: DistContext) -> dict:
    w5 = tiny_w5()
    plain = replace(w5, activation_checkpointing=False, offload=None)
    recompute_only = replace(w5, offload=None)
    return {
        "fsdp2_w5": train(ctx, build_fsdp2, w5),
        "fsdp2_plain": train(ctx, build_fsdp2, plain),
        "ddp_recompute": train(ctx, build_ddp, recompute_only),
        "ddp_plain": train(ctx, build_ddp, plain),
    }


@pytest.mark.distributed
def test_offload_and_recompute_keep_the_losses():
    """
    FSDP2 with `CPUOffloadPolicy` and every layer recomputed, on two gloo ranks,
    gives the losses of plain FSDP2 from the same seed and batches; so does DDP
    with recomputation. Each transformer layer runs twice per step when
    recomputed (forward, then again in backward), once otherwise.
    """
    ranks = run_distributed(train_each, 2)
    n_layers = tiny_w5().model.n_layers
    for rank in ranks:
        for engine in ("fsdp2", "ddp"):
            checked = rank[f"{engine}_w5" if engine == "fsdp2" else "ddp_recompute"]
            plain = rank[f"{engine}_plain"]
            losses, forwards, _ = checked
            assert all(torch.isfinite(torch.tensor(losses)))
            # Fused CPU AdamW (offload) against the plain loop: last-bit changes
            # at most. One step at lr 1e-4 moves the next loss by about 1e-3.
            assert losses == pytest.approx(plain[0], rel=1e-5, abs=1e-5), engine
            assert forwards == 2 * STEPS * n_layers
            assert plain[1] == STEPS * n_layers

    # With offload the GPU holds no model states; the host all of FSDP2's.
    _, psi_t, psi_f = meta_layers(tiny_w5())
    memory = ranks[0]["fsdp2_w5"][2]
    assert memory == {"zero_states": 0, "host_states": zero_model_states(
        psi_t, psi_f, 2, param_bytes=4, grad_bytes=4, optimizer_bytes=8)}
    assert ranks[0]["fsdp2_plain"][2] == {"zero_states": memory["host_states"]}


def cpu_context() -> DistContext:
    return DistContext(0, 1, 0, torch.device("cpu"), "gloo")


def test_ddp_is_skipped_on_an_offload_workload(tmp_path):
    """DDP has nothing to offload to: the worker reports `skipped`, with why."""
    with pytest.raises(EngineUnavailable, match="DDP has no offload"):
        build_ddp(cpu_context(), tiny_w5())
    bench_pair.worker(cpu_context(), "ddp", tiny_w5(), bench_pair.RunConfig(),
                     str(tmp_path))
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["status"] == "skipped" and "DDP has no offload" in record["reason"]


def test_deepspeed_offloads_its_whole_optimizer_to_the_host():
    """The optimizer's full offload (no `ratio`), still `torch.optim.AdamW`."""
    config = deepspeed_config(tiny_w5(), torch.device("cuda"))
    zero = config["zero_optimization"]
    assert zero == {"stage": 3,
                    "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert "offload_optimizer" not in deepspeed_config(
        shrink(workloads()["W4"]), torch.device("cuda"))["zero_optimization"]


def test_deepspeed_on_w5_is_skipped_when_missing(monkeypatch):
    """Not even found: no process. Found but broken: the builder says why."""
    monkeypatch.setattr(bench_pair.importlib.util, "find_spec", lambda name: None)
    line = bench_pair.run_pair(
        "deepspeed", tiny_w5(), bench_run.RunConfig(), world_size=2,
        backend="gloo", timeout_s=10,
    )
    assert line["status"] == "skipped" and "deepspeed" in line["reason"]

    # `import deepspeed` raises ImportError when sys.modules holds None.
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "0")
    with pytest.raises(EngineUnavailable, match="import deepspeed failed"):
        build_deepspeed(cpu_context(), tiny_w5())


def test_w5_offload_exceeds_the_host():
    """
    The page's arithmetic for the real W5 (GPT-NeoX-20B, 2 ranks, a 256 GiB
    host): both peers' host states outgrow the host, DeepSpeed's only once
    Adam's moments come; both fit their GPU states on an H200.
    """
    w5 = workloads()["W5"]
    _, psi_t, psi_f = meta_layers(w5)
    assert psi_f == 0 and round(psi_t / 1e9, 2) == 20.55
    host, gpu, ranks = 256 * 2**30, 139 * 2**30, 2

    fsdp2 = fsdp2_memory(psi_t, psi_f, ranks, offload=True)
    assert fsdp2["zero_states"] == 0
    assert fsdp2["host_states"] == 16 * psi_t // ranks
    assert ranks * fsdp2["host_states"] > host
    # Shards and gradients alone would fit: the moments tip it over.
    assert ranks * fsdp2["host_states"] * 8 // 16 < host

    deepspeed = deepspeed_memory(psi_t, psi_f, ranks, offload=True)
    assert deepspeed["host_states"] == 18 * psi_t // ranks
    assert ranks * deepspeed["host_states"] > host
    assert ranks * deepspeed["host_states"] * 10 // 18 < host
    assert deepspeed["zero_states"] == 2 * psi_t // ranks < gpu
    # Without offload DeepSpeed would need 16 bytes a parameter on the GPU.
    assert deepspeed_memory(psi_t, psi_f, ranks, offload=False)[
        "zero_states"] == 16 * psi_t // ranks > gpu
