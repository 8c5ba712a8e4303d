"""The job's fast path: `--kernels`, `--cuda-graph` refused where it cannot
apply (one line, status 2, before any rank starts), and the job's step recorded
by `GraphedStep` training as its eager step (the CPU twin, bit for bit)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labml_zero import launch
from labml_zero.finetune.config import FinetuneConfig
from tests.distributed import run_distributed
from tests.finetune.test_preflight import run_main

CUDA = torch.device("cuda")


def test_cuda_graph_is_refused_before_any_rank_starts(tmp_path, capsys,
                                                      monkeypatch):
    def spawn(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "spawn", spawn)
    outputs = ["--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")]
    err = run_main(["--cuda-graph", *outputs], capsys)
    assert "--cuda-graph needs GPUs" in err and "on CPU" in err
    assert not (tmp_path / "out").exists()  # refused before preflight made it


@pytest.mark.parametrize("change, why", [
    (dict(activation_checkpointing=True), "--activation-checkpointing"),
    (dict(offload_optimizer=0.5), "--offload-optimizer"),
    (dict(offload_optimizer=1.0, offload_params=0.5), "--offload-params"),
    (dict(offload_optimizer="auto"), "host memory"),
    (dict(dtype="fp16"), "loss scaler"),
    (dict(clip_grad=1.0), "--clip-grad"),
    (dict(grad_accum=2), "--grad-accum 1"),
])
def test_cuda_graph_refusals_on_gpus(change, why):
    config = FinetuneConfig(cuda_graph=True, **change)
    assert why in config.cuda_graph_refusal(CUDA)
    # without the flag nothing is refused; with it and nothing in the way, too
    assert dataclasses.replace(config, cuda_graph=False).cuda_graph_refusal(
        CUDA) is None
    assert FinetuneConfig(cuda_graph=True).cuda_graph_refusal(CUDA) is None
    assert FinetuneConfig(cuda_graph=True, dtype="bf16").cuda_graph_refusal(
        CUDA) is None


def test_an_unknown_kernel_is_a_flag_error(capsys):
    err = run_main(["--kernels", "loss,fast"], capsys)
    assert "--kernels: kernels 'loss,fast': unknown kernel(s) fast" in err


def test_fp8_is_refused_before_start_on_cpu_and_with_lora(capsys):
    err = run_main(["--kernels", "loss,fp8"], capsys)
    assert "--kernels fp8 needs" in err  # a CUDA GPU, or torchao where it is missing
    err = run_main(["--kernels", "fp8", "--finetune", "lora"], capsys)
    assert "kernels fp8 with finetune 'lora'" in err
    err = run_main(["--kernels", "fp8", "--peer-memory"], capsys)
    assert "kernels fp8 with peer_memory" in err
    assert FinetuneConfig(kernels="loss").fp8_refusal(CUDA) is None


STEPS = 6


def graphed_against_eager(ctx: launch.DistContext) -> list[torch.Tensor]:
    """`STEPS` steps of the tiny model twice, from the same weights and batches:
    eagerly, then through `GraphedStep` (CPU: its twin re-runs the step in the
    captured mode). Returns each run's totals and trainable shards."""
    from labml_zero.finetune.job import (GRAPH_WARMUP, Training, build_model,
                                         device_step)
    from labml_zero.optimizers.graphed_step import GraphedStep

    config = FinetuneConfig(kernels="loss", seq_len=16, batch_size=2)
    generator = torch.Generator().manual_seed(1)
    n_vocab = config.model_config().n_vocab
    batches = [torch.randint(0, n_vocab, (1, 2, 2, 16), generator=generator)
               for _ in range(STEPS)]
    out = []
    for graphed in (False, True):
        built = build_model(config, ctx)
        training = Training(built.model, built.optimizer, None, fused_loss=True)

        def step(batch, training=training):
            return device_step(training, batch, config)

        run = (GraphedStep(step, built.optimizer, warmup=GRAPH_WARMUP)
               if graphed else step)
        totals = torch.stack([run(batch) for batch in batches])  # [STEPS, 4]
        out.append([totals, *[s.detach().clone()
                              for s in built.model.get_trainable_chunk()]])
    return out


def test_the_graphed_job_step_trains_as_the_eager_step():
    eager, graphed = run_distributed(graphed_against_eager, 1)[0]
    # the loss sums are finite (the fused loss), the accuracy unknown (NaN)
    assert torch.isfinite(eager[0][:, 0]).all() and eager[0][:, 1].isnan().all()
    assert len(eager) == len(graphed) > 1
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
