"""The job with every Llama fused kernel named (`--kernels
rms_norm,swiglu,rotary,loss`) trains the same model as the plain one: on a CPU
each fused function runs its own formula uncompiled (the chunked loss in
chunks), so the losses agree within fp32 rounding of the path, step by step."""

from __future__ import annotations

import torch

from labml_zero.llama.family import LLAMA
from labml_zero.llama.hf_checkpoint import LlamaCheckpoint
from tests import tolerance
from tests.finetune.test_llama_job import check_ok, job, snapshots  # noqa: F401
from tests.llama.test_model import llama_terms
from tests.test_finetune import run_dirs, tracked

STEPS = 3
SEQ = 32  # the job's `SMALL` sequence length


def losses(tmp, snapshot, kernels: str) -> dict[int, float]:
    result = job(tmp, "--checkpoint", str(snapshot), "--steps", str(STEPS),
                 "--kernels", kernels, "--sample-tokens", "0", world=1)
    check_ok(result)
    return tracked(run_dirs(tmp, LLAMA.experiment)[0])["loss.train"]


def test_every_llama_kernel_trains_the_plain_models_losses(snapshots, tmp_path):
    snapshot = snapshots["llama"]
    plain = losses(tmp_path / "plain", snapshot, "none")
    fused = losses(tmp_path / "fused", snapshot, "rms_norm,swiglu,rotary,loss")
    assert sorted(fused) == list(range(1, STEPS + 1))
    config = LlamaCheckpoint(snapshot).config
    # a loss's path: a logit's, then the log-sum-exp over the vocabulary and
    # the mean over the batch's tokens (2 sequences of SEQ)
    terms = llama_terms(config, seq=SEQ) + config.n_vocab + 2 * SEQ
    for step in range(1, STEPS + 1):
        bound = tolerance.loss_after(torch.float32, terms=terms, steps=step - 1)
        assert abs(fused[step] - plain[step]) <= bound["rel"] * abs(plain[step]), (
            step, fused[step], plain[step], bound)
    assert plain[STEPS] < plain[1]  # both trained
