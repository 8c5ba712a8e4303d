r"""
---
title: Fine-tuning GPT-NeoX with ZeRO-3
summary: The experiment: a GPT-NeoX built layer by layer into ZeRO-3 shards, AdamFP16,
  Tiny Shakespeare, labml tracking, sharded checkpoints and a sample at the end.
---

# Fine-tuning GPT-NeoX with ZeRO-3

This page is the training job that puts the pieces together: the
[GPT-NeoX layers](model.html), a [fine-tuner](finetuners.html) that decides what
trains, the [ZeRO-3 engine](../zero3/index.html) that shards them over $N_d$ ranks,
[AdamFP16](../optimizers/adam_fp16.html) on the shards, and
[Tiny Shakespeare](dataset.html). The command line is
[`finetune_neox`](../finetune_neox.html); `train(ctx, config)` below is what each
rank runs.

## One step

With a micro-batch of $B$ sequences of $T$ tokens per rank, $A$ micro-batches
accumulated per step and $N_d$ ranks, one optimizer step sees $B \cdot A \cdot N_d$
sequences. Each micro-batch's loss is the mean cross-entropy over its $BT$ tokens,
divided by $A$; the engine's reduce-scatter averages over ranks, so the shard
gradients are those of

$$\mathcal{L} = \frac{1}{A N_d} \sum_{a, r} \frac{1}{BT} \sum_{b, t}
  -\log p_\theta\left(x^{(a,r)}_{b,t+1} \mid x^{(a,r)}_{b, \le t}\right)$$

the mean over the whole global batch, as if one unsharded model had seen it. The
first $A - 1$ backward passes run inside `model.no_sync()`, so gradients stay in
the chunks' full-size buffers and one reduce-scatter per chunk serves the whole
step.

Then, in order: with fp16, the [loss scaler](../optimizers/grad_scaler.html)
unscales the shard gradients and checks them for overflow (one all-reduce of the
squared norm, which every rank sees alike, so all skip a bad step together); with
`clip_grad`, the [global norm](../optimizers/clip_grad.html) is clipped, reusing
that norm; then AdamFP16 steps. Without either (bf16 or fp32, no
`clip_grad`), no gradient changes after its chunk is reduced, so each shard is
updated right then, during the rest of the backward pass
([`update_during_backward`](../optimizers/adam_fp16.html)). Tracking costs one
more all-reduce, of three numbers (loss sum, correct tokens, tokens), and one
host sync per step.

## Building the model one chunk at a time

A 20B model must never exist whole on one rank. So the layers are first built on
the meta device (no memory), the fine-tuner marks them, and the chunk size is
chosen from their shapes alone. `zero3_layers` then shards each layer while it is
still on meta, and initialises it chunk by chunk: a chunk's full buffer gets
memory, the seeded initialiser (the same on every rank) writes its parameters,
the rank keeps its slice, and the buffer is freed before the next chunk. With a
Hugging Face checkpoint the chunks start at zero and each layer's tensors are read
on the host (that layer's only) and copied slice by slice into the shards. A rank
never holds more than one chunk on its device beyond its shards, and one layer
on the host.

With `compile`, each transformer layer's forward is then compiled (the
engine's hooks stay eager around it, see [compiled
layers](../zero3/compiled.html)); the first step pays for the compilation.

## Tracking

Each rank creates the same labml run (one uuid, agreed by a broadcast) with its own
rank, so labml keeps a directory per rank (`<log_dir>/zero3_neox/<uuid>.<rank>/`)
and the labml app merges them. The tracked numbers are already means over all
ranks (one all-reduce of three scalars per step), so every rank's log agrees;
only rank 0 prints. The app writer is on only when `app_url` answered a probe;
otherwise nothing touches the network.

## Checkpoints and resuming

Every `checkpoint_every` steps the ranks write a [sharded
checkpoint](../zero3/checkpoint.html) (each its own shards and optimizer state)
with the step and the data sampler's position as extra state. A run resumed from it
rebuilds the model exactly as before (so frozen weights are the same), loads the
shards, and continues at the next batch: with fp32 it reproduces the uninterrupted
losses bit for bit.

## Limitations

* The learning rate is constant: no warm-up or decay.
* Resuming needs the same world size and batch size (the data order depends on
  them), although the checkpoint itself could be loaded at another world size.
* Validation uses the first `valid_batches` global batches of the validation split,
  the same ones each time, not the whole split.
* The sample at the end re-runs the whole prefix per token (no KV cache), through
  the sharded model, so every rank gathers every layer for every token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labml_zero.app_client import (app_url_if_running, check_app_url,
                                   labml_app_settings)
from labml_zero.launch import DistContext
from labml_zero.neox import model as neox_model
from labml_zero.neox.checkpoint import HFCheckpoint
from labml_zero.neox.dataset import RankSampler, TextDataset, load_datasets
from labml_zero.neox.finetuners import TrainableCount, finetuner
from labml_zero.neox.generate import Sampling, generate
from labml_zero.neox.tokenizer import load_tokenizer
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.optimizers.clip_grad import clip_grad_norm_
from labml_zero.zero3.compiled import compile_layers
from labml_zero.zero3.placement import (
    StaticPlacement,
    first_step_placement,
    apply_placement,
    shard_specs,
)
from labml_zero.optimizers.grad_scaler import LossScaler
from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint
from labml_zero.zero3.config import ZeroConfig
from labml_zero.zero3.sharded_model import Zero3Sequential, zero3_layers

__all__ = ["FinetuneConfig", "laptop", "neox_20b_biases", "MODEL_PRESETS",
           "DTYPES", "train", "build_model"]

# `--model` names → preset functions of [the model page](model.html).
MODEL_PRESETS = {
    "tiny": neox_model.tiny,
    "pythia-70m": neox_model.pythia_70m,
    "pythia-160m": neox_model.pythia_160m,
    "pythia-410m": neox_model.pythia_410m,
    "pythia-1b": neox_model.pythia_1b,
    "pythia-1.4b": neox_model.pythia_1_4b,
    "pythia-2.8b": neox_model.pythia_2_8b,
    "pythia-6.9b": neox_model.pythia_6_9b,
    "pythia-12b": neox_model.pythia_12b,
    "gpt-neox-20b": neox_model.gpt_neox_20b,
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FINETUNERS = ("biases", "ffn", "all")
EXPERIMENT_NAME = "zero3_neox"

# Test-only fault injection: `rank:step` makes that rank raise after that step.
# The failure tests use it to check that a dying rank ends the whole job.
FAIL_AT_STEP_ENV = "LABML_ZERO_FAIL_AT_STEP"


# ## Configuration


@dataclass(frozen=True)
class FinetuneConfig:
    """
    ## The experiment's configuration

    The defaults are the laptop run: the tiny GPT-NeoX (2 layers of width 64 with
    the real 50,432-row vocabulary), randomly initialised, every parameter
    trained, 120 steps of $2 \\times 8$ sequences of 64 tokens: one to two minutes
    on a 2-core CPU. Random weights with only the biases training would barely
    move; `'all'` takes the validation loss from $\\ln 50432 \\approx 10.8$ to
    about 5.5 in that time.
    """

    model: str = "tiny"
    """A key of `MODEL_PRESETS`; ignored when `checkpoint` is given."""
    checkpoint: str | None = None
    """A Hugging Face GPT-NeoX/Pythia directory (`config.json` and safetensors);
    the model's shape comes from its `config.json`. `None`: random weights."""
    finetune: str = "all"
    """What trains: `'biases'` (labml-nn's BitFit-style job), `'ffn'` or `'all'`."""
    filter_layers: tuple[int, ...] | None = None
    """Keep only these transformer layers (labml-nn's way to try 20B on small
    hardware); `None` keeps all."""
    seq_len: int = 64
    """$T$, tokens per sequence."""
    batch_size: int = 8
    """$B$, sequences per micro-batch *per rank*."""
    grad_accum: int = 1
    """$A$, micro-batches per optimizer step."""
    steps: int | None = 120
    """Optimizer steps in all; `None` runs `epochs` epochs. 120 steps of the
    laptop run see 123k tokens, about 40% of an epoch."""
    epochs: int = 1
    """Epochs when `steps` is `None`. An epoch is
    $\\lfloor n_{samples} / (B N_d) \\rfloor / A$ steps (leftovers dropped)."""
    lr: float = 3e-3
    """Adam's learning rate, constant. $3 \\cdot 10^{-3}$ suits the random tiny
    model; pre-trained weights want less ($3 \\cdot 10^{-4}$ in labml-nn)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    clip_grad: float | None = None
    """Clip the global gradient norm (over all ranks' shards) to this; `None`: off."""
    offload_optimizer: float | str = 0.0
    """Fraction of the trainable elements whose fp32 master and Adam moments
    live in host memory (whole chunks, from the output end; see
    [placement](../zero3/placement.html)): 0 keeps all on the device.
    `'auto'` (GPUs only): as few chunks as make the step fit, decided from a
    measured forward and backward before the first step."""
    offload_params: float = 0.0
    """Fraction of the parameter shards (all chunks, from the output end) kept in
    host memory and copied up at each gather; needs `offload_optimizer=1`."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass."""
    compile: bool = False
    """`torch.compile` each transformer layer's forward ([compiled
    layers](../zero3/compiled.html)): Inductor on GPUs, `aot_eager` on CPU."""
    peer_memory: bool = False
    """Gather and reduce-scatter the chunks through the other ranks' memory
    instead of with NCCL's kernels (`ZeroConfig.peer_gather` and `peer_reduce`,
    see [peer memory](../zero3/peer_memory.html)). On 2×H200 it made steps with
    100 MB chunks and more 2–11% faster, and Pythia-160M's 2–5% slower. All ranks
    on one host."""
    dtype: str | None = None
    """`'fp32'`, `'bf16'` or `'fp16'`: the chunks' and the computation's dtype.
    `None`: fp32 on CPU (16-bit matmuls are slow on most CPUs), bf16 on CUDA."""
    valid_every: int = 20
    """Evaluate every this many steps, and at the last step."""
    valid_batches: int = 4
    """Global validation batches per evaluation."""
    checkpoint_every: int | None = None
    """Write a sharded checkpoint every this many steps, and at the last step;
    `None`: never."""
    resume: str | None = None
    """A checkpoint directory written by this job, to continue from."""
    out: str = "runs/zero3_neox"
    """Run outputs: `checkpoints/step-NNNNNN/` under it."""
    log_dir: str = "logs"
    """labml's experiments directory: runs go to `<log_dir>/zero3_neox/`."""
    app_url: str | None = None
    """A labml app's API URL (`http://127.0.0.1:5005/api/v1/default/` for
    `python -m labml_zero.app`); used only if an app answers there."""
    seed: int = 0
    """Seeds the random init and the data order."""
    prompt: str = "It is"
    """Prompt of the sample printed at the end."""
    sample_tokens: int = 60
    """Tokens to generate at the end; 0 skips the sample."""
    top_k: int | None = 5
    """Top-$k$ sampling for the sample (seeded, so every rank draws the same
    tokens); `None`: greedy."""

    def __post_init__(self):
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"unknown model {self.model!r}; expected one of "
                             f"{', '.join(MODEL_PRESETS)}")
        if self.finetune not in FINETUNERS:
            raise ValueError(f"unknown fine-tuner {self.finetune!r}; expected one "
                             f"of {', '.join(FINETUNERS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of "
                             f"{', '.join(DTYPES)}")
        if self.filter_layers is not None:
            if not self.filter_layers:
                raise ValueError("filter_layers must name at least one layer")
            if min(self.filter_layers) < 0:
                raise ValueError(f"filter_layers must be >= 0, got "
                                 f"{list(self.filter_layers)}")
        for name in ("seq_len", "batch_size", "grad_accum", "epochs", "valid_every",
                     "valid_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "checkpoint_every", "top_k"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise ValueError(f"clip_grad must be > 0, got {self.clip_grad}")
        if self.offload_optimizer != "auto" and not (
                isinstance(self.offload_optimizer, (int, float))
                and 0.0 <= self.offload_optimizer <= 1.0):
            raise ValueError(f"offload_optimizer must be in [0, 1] or 'auto', got "
                             f"{self.offload_optimizer!r}")
        if not 0.0 <= self.offload_params <= 1.0:
            raise ValueError(f"offload_params must be in [0, 1], got "
                             f"{self.offload_params}")
        if self.offload_params > 0 and self.offload_optimizer != 1:
            raise ValueError("offload_params needs offload_optimizer=1 (a shard in "
                             "host memory is updated there)")
        if self.app_url is not None:
            check_app_url(self.app_url)
        if self.sample_tokens < 0:
            raise ValueError(f"sample_tokens must be >= 0, got {self.sample_tokens}")
        if self.sample_tokens and not self.prompt:
            raise ValueError("prompt must be non-empty to sample")

    def model_config(self) -> neox_model.NeoXConfig:
        """
        ### The model's shape

        From the checkpoint's `config.json` or the preset; checks `filter_layers`
        and `seq_len` against it (cheap: reads one small JSON file at most).
        """
        if self.checkpoint is not None:
            config = HFCheckpoint(self.checkpoint).config
        else:
            config = MODEL_PRESETS[self.model]()
        if self.filter_layers is not None:
            bad = [i for i in self.filter_layers if i >= config.n_layers]
            if bad:
                raise ValueError(f"filter_layers {bad} out of range: the model has "
                                 f"{config.n_layers} layers (0..{config.n_layers - 1})")
        if self.seq_len > config.max_position:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's "
                             f"max_position {config.max_position}")
        return config

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def laptop() -> FinetuneConfig:
    """The default: the tiny model, random init, all parameters, 120 steps."""
    return FinetuneConfig()


def neox_20b_biases(checkpoint: str) -> FinetuneConfig:
    """
    ### labml-nn's job

    GPT-NeoX-20B from `checkpoint`, biases only, $T = 128$, 16 sequences per
    rank, Adam at $3 \\cdot 10^{-4}$, fp16 as labml-nn ran it.
    """
    return FinetuneConfig(model="gpt-neox-20b", checkpoint=checkpoint,
                          finetune="biases", seq_len=128, batch_size=16, lr=3e-4,
                          dtype="fp16", steps=None, valid_every=100)


# ## The model


class BuiltModel(NamedTuple):
    model: Zero3Sequential
    counts: TrainableCount
    neox: neox_model.NeoXConfig


def build_model(config: FinetuneConfig, ctx: DistContext) -> BuiltModel:
    """
    ### Build on meta, mark, shard, then initialise or load

    See "Building the model one chunk at a time" above.
    """
    neox = config.model_config()
    layers = neox_model.build_layers(neox, filter_layers=config.filter_layers,
                                     device="meta")
    # requires_grad decides trainable vs frozen chunks: set it before sharding.
    counts = finetuner(config.finetune)(layers)
    hf = HFCheckpoint(config.checkpoint) if config.checkpoint is not None else None

    zero = ZeroConfig(dtype=config.torch_dtype(ctx.device),
                      activation_checkpointing=config.activation_checkpointing,
                      peer_gather=config.peer_memory, peer_reduce=config.peer_memory)
    if hf is None:
        # Random weights, drawn one chunk at a time into the chunk's buffer: every
        # rank seeds alike and visits the chunks in the same order, so all draw the
        # same weights and each keeps only its own slice of them.
        init = neox_model.init_parameter(neox)
    else:
        # Pretrained weights are loaded after sharding, below; the chunks start at 0.
        def init(name: str, param: torch.Tensor) -> None:
            pass

    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda"
                               else []):
        torch.manual_seed(config.seed)
        sharded = zero3_layers(layers, device=ctx.device, config=zero, init_param=init)
    if config.compile:
        # the transformer layers' forwards; the engine's hooks stay eager
        compile_layers(sharded, device=ctx.device,
                       types=(neox_model.TransformerLayer,))
    if hf is not None:
        for layer in sharded:
            # [one layer] on the host, shapes checked before reading; each rank
            # copies only its slices into its shards (and fp32 masters)
            layer.load_sharded(hf.layer_state_dict(layer.module))
    return BuiltModel(Zero3Sequential(sharded), counts, neox)


def place_chunks(model: Zero3Sequential, config: FinetuneConfig,
                 probe: Callable[[], None]) -> frozenset[int]:
    """
    ### Put the chunks where the config says, before the optimizer exists

    Moves the parameter shards of `offload_params` to the host (or, with
    `'auto'`, which runs `probe`, a forward and backward, to measure the step
    first, keeps frozen chunks resident in the memory left over). Returns the
    trainable shards whose optimizer state goes to host memory: `AdamFP16`'s
    `offload=`.
    """
    if config.offload_optimizer == 0:
        return frozenset()
    shards = shard_specs(model)
    if config.offload_optimizer == "auto":
        if model.runtime.comm.device.type != "cuda":
            raise ValueError("offload_optimizer 'auto' needs GPUs (it reads the "
                             "CUDA allocator's peak); give a fraction on CPU")
        decided = first_step_placement(model, probe)
        # frozen chunks stay gathered in the memory left over
        apply_placement(model, decided.placement)
        return decided.placement.optimizer_offload(shards)
    placement = StaticPlacement(optimizer_cpu_fraction=config.offload_optimizer,
                                param_cpu_fraction=config.offload_params
                                ).place(shards)
    apply_placement(model, placement)
    return placement.optimizer_offload(shards)


# ## Steps


class Totals(NamedTuple):
    """Sums over all ranks' tokens, from one all-reduce."""

    loss_sum: float
    correct: float
    tokens: float

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens


def forward_loss(model: Zero3Sequential, dataset: TextDataset, indices: list[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """
    #### Mean cross-entropy of one micro-batch, and `[loss_sum, correct, tokens]`
    """
    batch = dataset.batch(indices)
    inputs = batch.inputs.to(device)  # [B, T] int64
    targets = batch.targets.to(device)  # [B, T] int64
    logits = model(inputs)  # [B, T, V] param dtype
    # fp32 softmax: in 16 bits log(Σ exp) over 50k logits loses the small ones.
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == targets).sum()
        n = targets.numel()
        # [3] fp64, so sums over many tokens and ranks stay exact
        stats = torch.stack([loss.detach().double() * n, correct.double(),
                             torch.tensor(n, dtype=torch.float64, device=device)])
    return loss, stats


def all_reduce_totals(stats: torch.Tensor) -> Totals:
    dist.all_reduce(stats)
    # host sync: .tolist(), once per step, for the tracker
    return Totals(*stats.tolist())


def micro_batches(sampler: RankSampler) -> Iterator[list[int]]:
    """Batches forever, epoch after epoch; the sampler's state is the position."""
    while True:
        yield from sampler


def valid_sampler(dataset: TextDataset, config: FinetuneConfig,
                  ctx: DistContext) -> RankSampler:
    """The validation order: unshuffled, so each evaluation sees the same batches."""
    try:
        return RankSampler(len(dataset), batch_size=config.batch_size,
                           rank=ctx.rank, world_size=ctx.world_size, shuffle=False)
    except ValueError as e:
        raise ValueError(f"validation split at seq_len {config.seq_len}: {e}") from e


@torch.no_grad()
def evaluate(model: Zero3Sequential, dataset: TextDataset, config: FinetuneConfig,
             ctx: DistContext) -> Totals:
    """
    ### Loss and accuracy on the first `valid_batches` global batches

    Every rank runs the same number of forwards (the engine's all-gathers must
    match), each on its own block of each batch.
    """
    sampler = valid_sampler(dataset, config, ctx)
    stats = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for indices in islice(sampler, min(config.valid_batches, len(sampler))):
        stats += forward_loss(model, dataset, indices, ctx.device)[1]
    return all_reduce_totals(stats)


class Training(NamedTuple):
    """What a step updates."""

    model: Zero3Sequential
    optimizer: AdamFP16
    scaler: LossScaler | None
    """fp16 only: the dynamic loss scale, agreed by all ranks."""


def train_step(training: Training, batches: Iterator[list[int]],
               dataset: TextDataset, config: FinetuneConfig) -> Totals:
    """
    ### One optimizer step over `grad_accum` micro-batches
    """
    model, optimizer, scaler = training
    comm = model.runtime.comm
    stats = torch.zeros(3, dtype=torch.float64, device=comm.device)
    for micro in range(config.grad_accum):
        # Reduce-scatter only after the last micro-batch; see "One step" above.
        last = micro == config.grad_accum - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss, micro_stats = forward_loss(model, dataset, next(batches),
                                             comm.device)
            loss = loss / config.grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
        stats += micro_stats
    shards = model.get_trainable_chunk()
    # The scaler's overflow check is the gradient norm's all-reduce; clipping
    # reuses that norm instead of a second collective.
    norm = scaler.unscale_(shards) if scaler is not None else None
    if config.clip_grad is not None:
        clip_grad_norm_(shards, config.clip_grad, comm, norm=norm)
    if scaler is not None:
        scaler.step(optimizer)
    else:
        optimizer.step()
    optimizer.zero_grad()
    return all_reduce_totals(stats)


def checkpoint_path(config: FinetuneConfig, step: int) -> Path:
    return Path(config.out) / "checkpoints" / f"step-{step:06d}"


def failure_step(rank: int) -> int | None:
    """The step after which this rank must fail, from `LABML_ZERO_FAIL_AT_STEP`."""
    value = os.environ.get(FAIL_AT_STEP_ENV)
    if not value:
        return None
    fail_rank, step = (int(x) for x in value.split(":"))
    return step if fail_rank == rank else None


# ## The job


def labml_configs(config: FinetuneConfig, built: BuiltModel, ctx: DistContext,
                  total_steps: int) -> dict:
    """What labml records as the run's configuration."""
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
        "total_steps": total_steps,
        "chunk_numel": max(c.numel for c in built.model.chunks),
        "n_chunks": len(built.model.chunks),
        "params_total": built.counts.total,
        "params_trainable": built.counts.trainable,
        "n_layers": built.neox.n_layers,
        "d_model": built.neox.d_model,
        "n_vocab": built.neox.n_vocab,
    }


def git_root(path: Path) -> Path | None:
    for directory in (path, *path.parents):
        if (directory / ".git").exists():
            return directory
    return None


def start_labml(config: FinetuneConfig, ctx: DistContext):
    """
    ### One labml run over all ranks

    Rank 0 picks the uuid and probes the app (see [the app client](../app_client.html));
    a broadcast tells the others, so every rank agrees without each probing (and
    under torchrun, where no parent process could pick for them).
    """
    from labml import experiment, lab, logger

    decision = [None, None]
    if ctx.rank == 0:
        from uuid import uuid1

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
    elif config.app_url is not None and ctx.rank == 0:
        logger.log(f"no labml app answered at {config.app_url} within 2 s; "
                   f"tracking offline to {log_dir}")
    lab.configure(settings)
    experiment.create(name=EXPERIMENT_NAME, uuid=run_uuid, writers=writers,
                      python_file=__file__, distributed_rank=ctx.rank,
                      distributed_world_size=ctx.world_size)
    return run_uuid


def save(config: FinetuneConfig, step: int, training: Training,
         sampler: RankSampler) -> None:
    """
    ### A sharded checkpoint after `step`

    `extra` is global state (rank 0 writes it): the sampler's position is the
    same on every rank, and so is the loss scale, agreed by an all-reduce.
    """
    extra = {"step": step, "sampler": sampler.state_dict()}
    if training.scaler is not None:
        extra["scaler"] = training.scaler.state_dict()
    save_checkpoint(checkpoint_path(config, step), training.model,
                    training.optimizer, extra=extra)


def resume(config: FinetuneConfig, training: Training, sampler: RankSampler) -> int:
    """
    ### Continue from `config.resume`; returns the step it was saved after
    """
    extra = load_checkpoint(config.resume, training.model,
                            training.optimizer).extra or {}
    if "step" not in extra or "sampler" not in extra:
        raise ValueError(f"{config.resume} is not a checkpoint of this job (its "
                         f"extra state has no step and sampler position)")
    # Refuses another batch size, world size or seed: the order would differ.
    sampler.load_state_dict(extra["sampler"])
    if training.scaler is not None and "scaler" in extra:
        training.scaler.load_state_dict(extra["scaler"])
    return int(extra["step"])


def train(ctx: DistContext, config: FinetuneConfig) -> None:
    """
    ## The job, on one rank

    1. the labml run, the data, the sharded model, the optimizer on its shards;
    2. with `resume`, the shards, the optimizer, the sampler and the step from
       the checkpoint;
    3. the loop: step, track, evaluate, checkpoint;
    4. a sample from the fine-tuned model.
    """
    from labml import experiment, logger, monit, tracker

    # labml's set-up notices (no .labml.yaml, no git repository) once, not per rank.
    with (contextlib.nullcontext() if ctx.rank == 0
          else contextlib.redirect_stdout(io.StringIO())):
        start_labml(config, ctx)
    tokenizer = load_tokenizer()
    data = load_datasets(seq_len=config.seq_len, tokenizer=tokenizer)
    sampler = RankSampler(len(data.train), batch_size=config.batch_size,
                          rank=ctx.rank, world_size=ctx.world_size, seed=config.seed)
    # Fails now, not after the model is built, if the validation split is
    # smaller than one global batch.
    valid_sampler(data.valid, config, ctx)
    steps_per_epoch = len(sampler) // config.grad_accum
    if config.steps is None and steps_per_epoch < 1:
        raise ValueError(f"an epoch has {len(sampler)} micro-batches, fewer than "
                         f"grad_accum={config.grad_accum}")
    total_steps = config.steps or config.epochs * steps_per_epoch

    built = build_model(config, ctx)
    model = built.model

    def probe() -> None:
        # one micro-batch of the training split, without moving the sampler
        indices = list(range(config.batch_size))
        forward_loss(model, data.train, indices, ctx.device)[0].backward()

    scaled = config.torch_dtype(ctx.device) == torch.float16
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=config.lr,
                         weight_decay=config.weight_decay,
                         offload=place_chunks(model, config, probe),
                         # updates overlap the backward pass unless clipping
                         # or unscaling changes the gradients after it
                         update_during_backward=(config.clip_grad is None
                                                 and not scaled))
    # as each chunk is reduced: an offloaded gradient starts its copy to the
    # host, and (without clipping) a shard its update
    model.runtime.grad_ready = optimizer.grad_ready
    scaler = LossScaler(model.runtime.comm) if scaled else None
    training = Training(model, optimizer, scaler)
    step = resume(config, training, sampler) if config.resume is not None else 0
    experiment.configs(labml_configs(config, built, ctx, total_steps))
    fail_at = failure_step(ctx.rank)

    with experiment.start():
        if ctx.rank == 0:
            origin = (f"weights from {config.checkpoint}" if config.checkpoint
                      else "randomly initialised (no --checkpoint given)")
            logger.log(f"GPT-NeoX: {built.neox.n_layers} layers of width "
                       f"{built.neox.d_model}, {built.counts.total:,} parameters, "
                       f"{origin}; training {built.counts.trainable:,} "
                       f"({config.finetune}) on {ctx.world_size} ranks")
            if step:
                logger.log(f"resumed from {config.resume} after step {step}")
        if step == 0:
            valid = evaluate(model, data.valid, config, ctx)
            tracker.save(0, {"loss.valid": valid.loss, "acc.valid": valid.accuracy})
            tracker.new_line()
        batches = micro_batches(sampler)
        for step in monit.loop(range(step + 1, total_steps + 1)):
            totals = train_step(training, batches, data.train, config)
            tracker.save(step, {"loss.train": totals.loss,
                                "acc.train": totals.accuracy})
            if step % config.valid_every == 0 or step == total_steps:
                valid = evaluate(model, data.valid, config, ctx)
                tracker.save(step, {"loss.valid": valid.loss,
                                    "acc.valid": valid.accuracy})
            if config.checkpoint_every is not None and (
                    step % config.checkpoint_every == 0 or step == total_steps):
                save(config, step, training, sampler)
            if fail_at is not None and step >= fail_at:
                raise RuntimeError(f"injected failure on rank {ctx.rank} after step "
                                   f"{step} ({FAIL_AT_STEP_ENV})")
            tracker.new_line()

        if config.sample_tokens:
            text = sample(model, tokenizer, config, ctx)
            if ctx.rank == 0:
                logger.log(f"\nSample after {total_steps} steps:\n{config.prompt}"
                           f"{text}\n")


def sample(model: Zero3Sequential, tokenizer, config: FinetuneConfig,
           ctx: DistContext) -> str:
    """
    ### A sample through the sharded model

    Every rank runs the same forwards (each gathers every layer). The sampler is
    seeded alike on every rank, so all draw the same tokens; even if rounding made
    them differ, only the text would, not the sequence of collectives.
    """
    generator = torch.Generator().manual_seed(config.seed)
    sampling = Sampling(top_k=config.top_k, max_context=config.seq_len)
    return generate(model, tokenizer, config.prompt, n_tokens=config.sample_tokens,
                    sampling=sampling, generator=generator, device=ctx.device)
