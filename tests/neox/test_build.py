"""`neox/build.py`: `'auto'` kernels by device, and the one builder that the
fine-tune job and the benchmark's labml_zero engine both call."""

from __future__ import annotations

import pytest
import torch

from labml_zero.launch import DistContext
from labml_zero.neox import build as neox_build
from labml_zero.neox.build import resolve_kernels
from labml_zero.neox.kernels import ModelKernels


def test_auto_kernels_are_all_on_cuda_and_none_on_cpu():
    assert resolve_kernels("auto", "cuda") == ModelKernels.all_fused()
    assert resolve_kernels("auto", torch.device("cuda", 1)) == ModelKernels.all_fused()
    assert resolve_kernels("auto", "cpu") == ModelKernels()
    assert resolve_kernels("auto", torch.device("meta")) == ModelKernels()
    # names are the device-blind choice: the fused functions run their twins
    assert resolve_kernels("loss,norms", "cpu") == ModelKernels(loss=True, norms=True)
    assert resolve_kernels("none", "cuda") == ModelKernels()
    with pytest.raises(ValueError, match="unknown kernel.*fast"):
        resolve_kernels("loss,fast", "cuda")


class Built(Exception):
    """Raised by the recording stand-in: what was asked for is in `args`."""


def record_builds(monkeypatch) -> None:
    def build_neox(build, recipe, **kwargs):
        raise Built(build, recipe)

    monkeypatch.setattr(neox_build, "build_neox", build_neox)


def test_the_job_and_the_bench_build_through_build_neox(monkeypatch):
    """Both callers reach `neox.build.build_neox`; neither assembles itself."""
    from bench.engine import build_labml_zero
    from bench.workloads import shrink, workloads
    from labml_zero.finetune.config import FinetuneConfig
    from labml_zero.finetune.job import build_model

    record_builds(monkeypatch)
    cpu = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    workload = shrink(workloads()["W1"])
    kernels = ModelKernels(loss=True, rotary=True)
    from dataclasses import replace
    with pytest.raises(Built) as bench:
        build_labml_zero(cpu, replace(workload, kernels=kernels, compile=True))
    build, _ = bench.value.args
    assert build.model == workload.model and build.kernels == kernels
    assert build.compile
    with pytest.raises(Built) as job:
        build_model(FinetuneConfig(kernels="loss,rotary", compile=True), cpu)
    build, recipe = job.value.args
    assert build.kernels == kernels and build.compile
    # and with the default, `auto`, the job on a CPU builds the plain model
    with pytest.raises(Built) as job:
        build_model(FinetuneConfig(), cpu)
    assert job.value.args[0].kernels == ModelKernels()
    assert not job.value.args[0].compile


def test_laying_out_a_model_and_its_optimizer_imports_no_compiler():
    """A model on the meta device (the plan, the preflight) and `AdamFP16`'s
    parameter groups import no `torch._dynamo`: a second or more of start-up
    in every process that would need none of it."""
    import subprocess
    import sys
    script = (
        "import sys, torch\n"
        "from labml_zero.neox.model import build_layers, tiny\n"
        "from labml_zero.llama.model import Embedding\n"
        "from labml_zero.llama.config import tiny as llama_tiny\n"
        "from labml_zero.optimizers.adam_fp16 import AdamFP16\n"
        "build_layers(tiny(), device='meta'); Embedding(llama_tiny(), device='meta')\n"
        "AdamFP16([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)\n"
        "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
