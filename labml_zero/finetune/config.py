r"""
---
title: The fine-tune's configuration
summary: FinetuneConfig, one documented and checked field per setting of the
  fine-tune, the model's family it picks, and presets as functions that
  return one.
---

# The fine-tune's configuration

Every setting of [the fine-tune](job.html) is one field of `FinetuneConfig`,
written once: its type, its default and, under it, its note; the [command
line](cli.html) is generated from these fields. One optimizer step sees

$$B \cdot A \cdot N_d$$

sequences of $T$ tokens: the micro-batch $B$ (`batch_size`, per rank), the
accumulation $A$ (`grad_accum`) and the world size $N_d$, which is the
launcher's, not the config's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labml_zero.app.client import check_app_url
from labml_zero.families import (FAMILIES, family_for_model_type,
                                 family_for_preset)
from labml_zero.family import ModelFamily
from labml_zero.layers.float8 import fp8_refusal
from labml_zero.finetune.lr_schedule import SCHEDULES, LRSchedule
from labml_zero.zero3.state_layout import LAYOUTS as STATE_LAYOUTS

__all__ = ["FinetuneConfig", "laptop", "neox_20b_biases", "FAMILY",
           "MODEL_PRESETS", "DTYPES", "FINETUNERS", "snapshot_model_type"]

# The default family, GPT-NeoX: the laptop run's, and a snapshot's whose
# `config.json` names no `model_type` (GPT-NeoX's reader defaults it).
FAMILY = family_for_model_type("gpt_neox")

# `--model` names → every family's preset functions, in registry order (see
# [the registry](../families.html)); the name picks the family.
MODEL_PRESETS = {name: preset for family in FAMILIES
                 for name, preset in family.presets.items()}

# Every family's fine-tuner names, in registry order; a family refuses those
# it has not (`check_family`).
FINETUNERS = tuple(dict.fromkeys(name for family in FAMILIES
                                 for name in family.finetuners))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The largest seed, the largest signed integer of 8 bytes: every consumer of
# the seed takes it (torch's generators, the seed sequence of NumPy's order).
MAX_SEED = 2**63 - 1


def snapshot_model_type(checkpoint: str) -> str:
    """`config.json`'s `model_type`; `ValueError` naming the file otherwise."""
    path = Path(checkpoint) / "config.json"
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--checkpoint {checkpoint}: no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--checkpoint {checkpoint}: config.json does not read: "
                         f"{' '.join(str(e).split())}") from None
    if not isinstance(value, dict) or not isinstance(value.get("model_type"), str):
        raise ValueError(f"--checkpoint {checkpoint}: config.json has no "
                         f"'model_type' string")
    return value["model_type"]


def flag(*, shown_default: str | None = None, **options) -> dict:
    """
    #### How the command line shows a field

    `metavar`, `choices`: as in argparse. The type and the default come from the
    field itself; `shown_default` is what the help says of a default that is
    resolved later (`None` meaning "the family's").
    """
    return {"flag": options, "shown_default": shown_default}


@dataclass(frozen=True)
class FinetuneConfig:
    r"""
    ## The experiment's configuration

    The defaults are the laptop run: the tiny GPT-NeoX (two narrow layers with the
    real vocabulary of $V$ tokens), randomly initialised, every parameter trained,
    a couple of minutes on a laptop's CPU. Random weights with only the biases
    training would barely move; `'all'` takes the validation loss well down from
    the $\ln V$ of a uniform guess in that time.
    """

    model: str = field(default="tiny", metadata=flag(choices=tuple(MODEL_PRESETS)))
    """A key of `MODEL_PRESETS`; ignored when `checkpoint` is given."""
    checkpoint: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """A Hugging Face snapshot directory (`config.json` and safetensors) of any
    family: GPT-NeoX/Pythia, Llama, Qwen 2, Mistral;
    the model's shape comes from its `config.json`, and its family from that
    file's `model_type`. `None`: random weights."""
    finetune: str = field(default="all", metadata=flag(choices=FINETUNERS))
    """What trains: `'biases'` (labml-nn's BitFit-style job), `'ffn'`, `'all'` or
    `'lora'` (low-rank adapters on a frozen base, see [LoRA](../neox/lora.html));
    the Llama family has `'all'` and `'lora'`."""
    lora_rank: int = 8
    """LoRA's rank $r$ (with `finetune='lora'` only)."""
    lora_alpha: float = field(default=16.0, metadata=flag(metavar="ALPHA"))
    r"""LoRA's $\alpha$: the adapters' update is scaled by $\alpha / r$."""
    lora_targets: tuple[str, ...] | None = field(default=None,
                                                 metadata=flag(metavar="NAMES"))
    """The projections LoRA adapts, comma-separated on the command line; `None`:
    every one the family has. GPT-NeoX's are `query_key_value`, `dense`,
    `dense_h_to_4h`, `dense_4h_to_h`; Llama's `q_proj`, `k_proj`, `v_proj`,
    `o_proj`, `gate_proj`, `up_proj`, `down_proj`."""
    export_hf: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """At the end, write the fine-tuned model here as a Hugging Face
    checkpoint with its tokenizer, for any `finetune` (LoRA's adapters merged
    into their weights), in the base snapshot's dtype, else the training one."""
    export_merged: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """With LoRA: the older name of `export_hf`."""
    export_adapter: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """With LoRA: at the end, write the adapters alone here, in PEFT's format."""
    filter_layers: tuple[int, ...] | None = field(default=None,
                                                  metadata=flag(metavar="0,1"))
    """Keep only these transformer layers (labml-nn's way to try its largest
    model on small hardware); `None` keeps all."""
    data: str | None = field(default=None, metadata=flag(metavar="PATH"))
    """The text to fine-tune on: a text file or its `.gz`, a directory of them,
    a JSON Lines file (`.jsonl`, the text in `text_field`), or a token file
    (`.u16`, `.u32`, `.bin`: token ids, memory-mapped). Text is tokenised once
    into a token file cached beside it (see [the token file](token_file.html)).
    `None`: the bundled Tiny Shakespeare."""
    valid_data: str | None = field(default=None, metadata=flag(metavar="PATH"))
    """Validation text, in any format of `data`; `None`: the last
    `valid_fraction` of `data`."""
    valid_fraction: float = field(default=0.1, metadata=flag(metavar="F"))
    """The share of `data`'s tokens, from its end, that validates when no
    `valid_data` is given."""
    text_field: str = field(default="text", metadata=flag(metavar="NAME"))
    """The field of each JSON Lines record that holds its text."""
    seq_len: int = 64
    """$T$, tokens per sequence."""
    batch_size: int = 8
    """$B$, sequences per micro-batch *per rank*."""
    grad_accum: int = 1
    """$A$, micro-batches per optimizer step."""
    steps: int | None = 120
    """Optimizer steps in all; `None` runs `epochs` epochs. The laptop run's
    steps see less than an epoch."""
    epochs: int = 1
    r"""Epochs when `steps` is `None`. An epoch is
    $\lfloor n_\text{samples} / (B A N_d) \rfloor$ steps (leftovers dropped)."""
    lr: float = field(default=3e-3, metadata=flag(metavar="LR"))
    """Adam's peak learning rate (after the warm-up). The default suits the
    random tiny model; pre-trained weights want about a tenth of it (as in
    labml-nn)."""
    lr_schedule: str = field(default="constant", metadata=flag(choices=SCHEDULES))
    """After the warm-up: `constant`, or `linear` or `cosine` decay towards
    `min_lr`, reached just after the last step (see [the
    schedule](lr_schedule.html))."""
    warmup_steps: int = 0
    """Steps of linear warm-up from `lr / warmup_steps` to `lr`; fewer than
    the run's steps."""
    min_lr: float = field(default=0.0, metadata=flag(metavar="LR"))
    """The floor that `linear` and `cosine` decay to."""
    weight_decay: float = field(default=0.0, metadata=flag(metavar="DECAY"))
    """AdamW's decoupled weight decay."""
    clip_grad: float | None = field(default=None, metadata=flag(metavar="NORM"))
    """Clip the global gradient norm (over all ranks' shards) to this; `None`: off."""
    offload_optimizer: float | str = field(
        default=0.0, metadata=flag(metavar="FRACTION|auto"))
    """Fraction of the trainable elements whose fp32 master and Adam moments
    (for a layout without a master, its states and a copy of the weight)
    live in host memory (whole chunks, from the output end; see
    [placement](../planner/placement.html)): 0 keeps all on the device.
    `'auto'` (GPUs only): as few chunks as make the step fit, decided from a
    measured forward and backward before the first step."""
    offload_params: float = field(default=0.0, metadata=flag(metavar="FRACTION"))
    """Fraction of the parameter shards (all chunks, from the output end) kept in
    host memory and copied up at each gather; needs `offload_optimizer=1`."""
    optimizer_states: str = field(default="fp32",
                                  metadata=flag(choices=tuple(STATE_LAYOUTS)))
    """The optimizer's [state layout](../zero3/state_layout.html): `fp32` (an
    fp32 master and fp32 moments), `bf16-moments` (the moments in bf16),
    `bf16-stochastic` (no master: the bf16 parameters updated with stochastic
    rounding, bf16 moments; offloaded, the host keeps a copy of the weight;
    no fp16), `bf16-kahan` (as
    `bf16-stochastic`, but rounded to nearest with a bf16 compensation of
    what rounding lost) or `8bit-moments` (the moments coded in 8 bits, one
    fp32 scale per block). A `--resume` from a
    checkpoint of another layout converts its states once and says so."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass."""
    prefetch_depth: int = 1
    """Units gathered ahead of the one that computes (`ZeroConfig`'s): more
    hides more of the gathers, and holds more gathered chunks."""
    compile: bool = False
    """`torch.compile` each transformer layer's forward ([compiled
    layers](../zero3/compiled.html)): Inductor on GPUs, `aot_eager` on CPU."""
    kernels: str = field(default="auto",
                         metadata=flag(metavar="auto|none|loss,rotary,..."))
    """The model's [fused kernels](../neox/kernels.html): `auto` turns every
    fusion on with GPUs and none on CPU ([the model's
    build](../neox/build.html)); `none`; or names from `loss`, `rotary`,
    `norms`, `bias_gelu`, comma-separated, for GPT-NeoX; the Llama family's
    are [its own](../llama/kernels.html): `rms_norm`, `swiglu`, `rotary`,
    `loss`. `fp8` (either family, never in `auto`; `auto,fp8` adds it) runs
    the layers' large linears in [fp8](../layers/float8.html): GPUs of compute
    with fp8 products (Ada, Hopper) and torchao, refused before start elsewhere."""
    cuda_graph: bool = False
    """Record the whole training step as one CUDA graph after two eager steps
    and replay it ([the step as one CUDA
    graph](../optimizers/graphed_step.html)): GPUs only, one micro-batch a step,
    no recomputation, offload, fp16 or clipping; refused before start
    otherwise."""
    peer_memory: bool = False
    """Gather and reduce-scatter the chunks through the other ranks' memory
    instead of with NCCL's kernels (`ZeroConfig.peer_gather` and `peer_reduce`,
    see [peer memory](../zero3/peer_memory.html), which says when it pays). All
    ranks on one host."""
    shard_group_size: int | None = field(default=None, metadata=flag(metavar="K"))
    """Hybrid sharding: shard over groups of this many consecutive ranks (one
    host) and replicate across the groups (`ZeroConfig.shard_group_size`, see
    [hybrid sharding](../zero3/hybrid.html)); it must divide the world size.
    `None`: shard over all ranks."""
    dtype: str | None = field(default=None, metadata=flag(choices=tuple(DTYPES)))
    """`'fp32'`, `'bf16'` or `'fp16'`: the chunks' and the computation's dtype.
    `None`: fp32 on CPU (half-precision matmuls are slow on most CPUs), bf16 on CUDA."""
    valid_every: int = 20
    """Evaluate every this many steps, and at the last step."""
    valid_batches: int = 4
    """Global validation batches per evaluation."""
    checkpoint_every: int | None = None
    """Write a sharded checkpoint every this many steps, and at the last step;
    `None`: never."""
    keep_checkpoints: int = 3
    r"""Keep the newest this many checkpoints under `out`; older ones are removed
    only after a new one is complete. 0 keeps them all. One checkpoint of a model
    of $\Psi$ parameters, $\Psi_t$ of them trainable, in $p$-byte chunks is
    about $p\Psi + K\Psi_t$ bytes over all ranks, $K$ the fp32 master and moments;
    during a save the kept ones and the new one are on the disk together, so
    `out` needs room for one more than are kept (checked before start)."""
    resume: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """A checkpoint directory written by this job, to continue from."""
    out: str | None = field(default=None, metadata=flag(
        metavar="DIR", shown_default="runs/<experiment>"))
    """Run outputs: `checkpoints/step-NNNNNN/` under it. Unset, the
    experiment's folder under runs, the experiment named by the model's
    family: runs/zero3_neox for GPT-NeoX, runs/zero3_llama for Llama
    (`out_dir`)."""
    log_dir: str = field(default="logs", metadata=flag(metavar="DIR"))
    """labml's experiments directory: runs go to `<log_dir>/<experiment>/`,
    the experiment named by the model's family (`zero3_neox`, `zero3_llama`)."""
    app_url: str | None = field(default=None, metadata=flag(metavar="URL"))
    """A labml app's API URL (`http://127.0.0.1:5005/api/v1/default/` for
    `python -m labml_zero.app`); used only if an app answers there."""
    seed: int = 0
    """Seeds the random init and the data order: from 0 to `MAX_SEED`, the
    largest signed integer of 8 bytes."""
    hang_timeout: float = field(default=300.0, metadata=flag(metavar="SECONDS"))
    """Seconds a rank may go without progress, after its first step, before the
    launcher calls it hung and ends the job (passed to `launch.spawn` /
    `launch.run_torchrun`, which set the collectives' timeout above it). A
    validation, or a checkpoint of a large model, must fit in it."""
    prompt: str = "It is"
    """Prompt of the sample printed at the end."""
    sample_tokens: int = 60
    """Tokens to generate at the end; 0 skips the sample."""
    top_k: int | None = 5
    """Top-$k$ sampling for the sample (seeded, so every rank draws the same
    tokens); `None`: greedy."""

    # `__post_init__` checks each field alone (ranges, names, finite numbers), so
    # a config that exists is one the job can start with; what needs the disk
    # (the checkpoint's files, `--out` being writable) is checked once more before
    # any rank starts, by [the pre-flight checks](preflight.html).
    def __post_init__(self):
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"unknown model {self.model!r}; expected one of "
                             f"{', '.join(MODEL_PRESETS)}")
        if self.finetune not in FINETUNERS:
            raise ValueError(f"unknown fine-tuner {self.finetune!r}; expected one "
                             f"of {', '.join(FINETUNERS)}")
        self.check_lora()
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of "
                             f"{', '.join(DTYPES)}")
        if self.filter_layers is not None:
            if not self.filter_layers:
                raise ValueError("filter_layers must name at least one layer")
            if min(self.filter_layers) < 0:
                raise ValueError(f"filter_layers must be >= 0, got "
                                 f"{list(self.filter_layers)}")
            if len(set(self.filter_layers)) != len(self.filter_layers):
                raise ValueError(f"filter_layers names a layer twice: "
                                 f"{','.join(map(str, self.filter_layers))}")
        for name in ("seq_len", "batch_size", "grad_accum", "epochs", "valid_every",
                     "valid_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "checkpoint_every", "top_k", "shard_group_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("lr", "weight_decay", "clip_grad", "offload_params",
                     "hang_timeout", "min_lr", "valid_fraction"):
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        self.check_data_and_schedule()
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0, got "
                             f"{self.keep_checkpoints}")
        if self.hang_timeout <= 0:
            raise ValueError(f"hang_timeout must be > 0, got {self.hang_timeout}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise ValueError(f"clip_grad must be > 0, got {self.clip_grad}")
        if self.offload_optimizer != "auto" and not (
                isinstance(self.offload_optimizer, (int, float))
                and 0.0 <= self.offload_optimizer <= 1.0):  # NaN fails too
            raise ValueError(f"offload_optimizer must be in [0, 1] or 'auto', got "
                             f"{self.offload_optimizer!r}")
        if not 0.0 <= self.offload_params <= 1.0:  # NaN fails too
            raise ValueError(f"offload_params must be in [0, 1], got "
                             f"{self.offload_params}")
        if self.optimizer_states not in STATE_LAYOUTS:
            raise ValueError(f"unknown optimizer_states {self.optimizer_states!r}; "
                             f"expected one of {', '.join(STATE_LAYOUTS)}")
        layout = STATE_LAYOUTS[self.optimizer_states]
        if layout.master is None and self.dtype == "fp16":
            raise ValueError(f"--optimizer-states {self.optimizer_states} rounds "
                             f"into bf16 or fp32 parameters, not --dtype fp16")
        if self.offload_params > 0 and self.offload_optimizer != 1:
            raise ValueError("offload_params needs offload_optimizer=1 (a shard in "
                             "host memory is updated there)")
        try:
            family = self.family
        except ValueError:
            family = None  # the snapshot's config.json: `model_config` says why
        if family is not None:
            self.check_family(family)
        if self.app_url is not None:
            try:
                check_app_url(self.app_url)
            except ValueError as e:
                # the app's message says "app url"; the user knows the field
                raise ValueError(str(e).replace("app url", "app_url", 1)) from None
        if self.sample_tokens < 0:
            raise ValueError(f"sample_tokens must be >= 0, got {self.sample_tokens}")
        # a seed out of range fails only in a rank (NumPy's order refuses a
        # negative one), or overflows there
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if self.sample_tokens and not self.prompt:
            raise ValueError("prompt must be non-empty to sample")

    def fp8_refusal(self, device: torch.device) -> str | None:
        """#### Why `--kernels` with fp8 cannot run on `device`, or `None`"""
        if "fp8" not in [n.strip() for n in self.kernels.split(",")]:
            return None
        return fp8_refusal(device)

    def cuda_graph_refusal(self, device: torch.device) -> str | None:
        """
        #### Why `cuda_graph` cannot apply to this run, or `None`

        Known before any rank starts. A capture records kernels without running
        them, so nothing in the step may wait on the host or change between
        steps ([when a step can be recorded](../optimizers/graphed_step.html)).
        """
        if not self.cuda_graph:
            return None
        if device.type != "cuda":
            return "needs GPUs (a CUDA graph records CUDA kernels; this run is on CPU)"
        if self.activation_checkpointing:
            return ("cannot record the recomputation of activations: leave out "
                    "--activation-checkpointing")
        if self.offload_optimizer != 0 or self.offload_params != 0:
            return ("cannot record the update of a shard in host memory (it runs "
                    "on a host thread): leave out --offload-optimizer/--offload-params")
        if self.torch_dtype(device) == torch.float16:
            return ("cannot record fp16's loss scaler (its overflow check waits on "
                    "the host): use --dtype bf16")
        if self.clip_grad is not None:
            return ("cannot record clipping (the norm is read on the host): leave "
                    "out --clip-grad")
        if self.grad_accum != 1:
            return "records one micro-batch a step: use --grad-accum 1"
        return None

    def check_data_and_schedule(self) -> None:
        """
        #### The data's and the schedule's fields, alone

        The files themselves are read before any rank starts (see [the
        fine-tune's data](data.html)); an epoch's steps are known only then,
        so with `epochs` the warm-up is checked there.
        """
        if not 0.0 < self.valid_fraction < 1.0:  # NaN fails too
            raise ValueError(f"valid_fraction must be in (0, 1), got "
                             f"{self.valid_fraction}")
        if not self.text_field:
            raise ValueError("text_field must be non-empty")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; expected "
                             f"one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.steps is not None and self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} must be fewer than "
                             f"--steps {self.steps}")
        if not 0.0 <= self.min_lr <= self.lr:  # NaN fails too
            raise ValueError(f"min_lr must be in [0, lr {self.lr:g}], got "
                             f"{self.min_lr:g}")

    def schedule(self, total_steps: int) -> LRSchedule:
        """The learning-rate schedule of a run of `total_steps` steps."""
        return LRSchedule(lr=self.lr, total_steps=total_steps, kind=self.lr_schedule,
                          warmup_steps=self.warmup_steps, min_lr=self.min_lr)

    def check_lora(self) -> None:
        """
        #### LoRA's fields

        `lora_targets` may come as one comma-separated string (the flag's
        value); it is kept as a tuple. The exports need adapters to export.
        """
        if isinstance(self.lora_targets, str):
            targets = tuple(t.strip() for t in self.lora_targets.split(",")
                            if t.strip())
            object.__setattr__(self, "lora_targets", targets)
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) \
                or self.lora_rank < 1:
            raise ValueError(f"lora_rank must be an integer >= 1, got "
                             f"{self.lora_rank!r}")
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"lora_alpha must be a finite number > 0, got "
                             f"{self.lora_alpha}")
        if self.lora_targets is not None and not self.lora_targets:
            raise ValueError("lora_targets must name at least one projection")
        for name in ("export_merged", "export_adapter"):
            if getattr(self, name) is not None and self.finetune != "lora":
                raise ValueError(f"{name} needs finetune 'lora' (only adapters "
                                 f"are exported; export_hf exports any "
                                 f"fine-tune), got {self.finetune!r}")
        if self.export_merged is not None:
            if self.export_hf not in (None, self.export_merged):
                raise ValueError("export_merged is the older name of export_hf: "
                                 "give one of them")
            object.__setattr__(self, "export_hf", self.export_merged)
        if self.export_hf is not None and self.filter_layers is not None:
            # transformers would fill the missing layers with random weights
            raise ValueError("export_hf needs the whole model: filter_layers "
                             "keeps only some layers")
        if self.export_hf is not None and self.export_hf == self.export_adapter:
            name = "export_merged" if self.export_merged else "export_hf"
            raise ValueError(f"{name} and export_adapter must be different "
                             "directories")

    @property
    def family(self) -> ModelFamily:
        """
        ### The model's family: the job asks it, never a model package

        `checkpoint`'s `config.json` names it by `model_type`; a file that
        names none (or does not read) is the default family's to judge, as
        GPT-NeoX's reader always has. Without a checkpoint, the `model`
        preset's family. `ValueError` for a `model_type` no family reads.
        """
        if self.checkpoint is not None:
            try:
                model_type = snapshot_model_type(self.checkpoint)
            except ValueError:
                return FAMILY
            return family_for_model_type(model_type)
        return family_for_preset(self.model)

    @property
    def out_dir(self) -> Path:
        """`out`, or the family's `runs/<experiment>`, so one family's
        checkpoints never land among another's."""
        return Path(self.out if self.out is not None
                    else f"runs/{self.family.experiment}")

    def check_family(self, family: ModelFamily) -> None:
        """
        #### The fields the family judges

        The fine-tuner's name, LoRA's targets (`None` becomes every one the
        family has) and the kernels' names, each in one line naming the family.
        """
        if self.finetune not in family.finetuners:
            raise ValueError(f"finetune {self.finetune!r} is not a fine-tuner of "
                             f"the {family.name} family; expected one of "
                             f"{', '.join(family.finetuners)}")
        if self.lora_targets is None:
            object.__setattr__(self, "lora_targets", family.lora_targets)
        unknown = [t for t in self.lora_targets if t not in family.lora_targets]
        if unknown:
            raise ValueError(f"lora_targets names an unknown projection "
                             f"{unknown[0]!r}; "
                             f"expected some of {', '.join(family.lora_targets)}")
        if len(set(self.lora_targets)) != len(self.lora_targets):
            raise ValueError(f"lora_targets names a projection twice: "
                             f"{','.join(self.lora_targets)}")
        try:
            # names, whatever the device
            kernels = family.resolve_kernels(self.kernels, "cpu")
        except ValueError as e:
            raise ValueError(f"kernels {self.kernels!r}: {e}") from None
        if kernels.fp8 and self.finetune == "lora":
            raise ValueError("kernels fp8 with finetune 'lora': the adapter's "
                             "wrapper computes the product itself, in bf16")
        if kernels.fp8 and self.peer_memory:
            raise ValueError("kernels fp8 with peer_memory: the fp8 products' "
                             "weights are gathered in fp8, which peer memory "
                             "does not do (it copies the chunks as they are)")

    def tuner(self):
        """
        #### The fine-tuner of `finetune`

        The family's LoRA with the `lora_*` fields for `'lora'`; the others take
        no options.
        """
        family = self.family
        if self.finetune == "lora":
            if self.lora_targets is None:
                self.check_family(family)
            return family.finetuner("lora", rank=self.lora_rank,
                                    alpha=self.lora_alpha, targets=self.lora_targets)
        return family.finetuner(self.finetune)

    def model_config(self) -> Any:
        """
        ### The model's shape

        From the checkpoint's `config.json` (the family's `snapshot_config`,
        one line naming the file and field it refuses) or the preset; checks
        the family's fields, `filter_layers` and `seq_len` against it (cheap:
        reads one small JSON file at most).
        """
        family = self.family
        if self.checkpoint is not None:
            config = family.snapshot_config(self.checkpoint)
        else:
            config = MODEL_PRESETS[self.model]()
        self.check_family(family)
        if self.filter_layers is not None:
            bad = [i for i in self.filter_layers if i >= config.n_layers]
            if bad:
                raise ValueError(f"filter_layers {bad} out of range: the model has "
                                 f"{config.n_layers} layers (0..{config.n_layers - 1})")
        # the family's limit, which its model refuses to exceed: the context,
        # or a Mistral's shorter sliding window (a GPT-NeoX's config has no
        # `max_sequence`: its context is its limit)
        longest = getattr(config, "max_sequence", config.max_position)
        limit = "max_position" if longest == config.max_position else \
            "sliding_window"
        if self.seq_len > longest:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's "
                             f"{limit} {longest}")
        return config

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def export_dtype(self, training: torch.dtype) -> torch.dtype:
        """`export_hf`'s dtype: the base snapshot's, else `training`'s."""
        base = (self.family.snapshot_dtype(self.checkpoint) if self.checkpoint
                else None)
        return base or training


# ## Presets
#
# Functions that return a config (`laptop()`, `neox_20b_biases(checkpoint)`),
# derived with `dataclasses.replace`.


def laptop() -> FinetuneConfig:
    """The default: the tiny model, random init, all parameters."""
    return FinetuneConfig()


def neox_20b_biases(checkpoint: str) -> FinetuneConfig:
    r"""
    ### labml-nn's job

    GPT-NeoX-20B from `checkpoint`, biases only, with labml-nn's sequence
    length, batch size, learning rate and fp16, and whole epochs.
    """
    return FinetuneConfig(model="gpt-neox-20b", checkpoint=checkpoint,
                          finetune="biases", seq_len=128, batch_size=16, lr=3e-4,
                          dtype="fp16", steps=None, valid_every=100)


