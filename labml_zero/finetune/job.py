r"""
---
title: Fine-tuning a model family with ZeRO-3
summary: The experiment: a model of any family (GPT-NeoX, Llama) built layer by
  layer into ZeRO-3 shards, AdamFP16, a scheduled learning rate, the user's data,
  labml tracking, sharded checkpoints and a sample at the end.
---

# Fine-tuning a model family with ZeRO-3

This page is the training job that puts the pieces together: a model's
layers, a fine-tuner that decides what trains, the [ZeRO-3
engine](../zero3/index.html) that shards them over $N_d$ ranks,
[AdamFP16](../optimizers/adam_fp16.html) on the shards at the rate of [the
schedule](lr_schedule.html), and [the data](data.html); `train(ctx, config)`
below is what each rank runs. With $B$ sequences of $T$ tokens per micro-batch,
$A$ micro-batches per step and $N_d$ ranks, each micro-batch's loss is divided
by $A$ and the reduce-scatter averages over ranks, so the shard gradients are
those of

$$\mathcal{L} = \frac{1}{A N_d} \sum_{a, r} \frac{1}{BT} \sum_{b, t}
  -\log p_\theta\left(x^{(a,r)}_{b,t+1} \mid x^{(a,r)}_{b, \le t}\right),$$

the mean over the whole global batch, as if one unsharded model had seen it.
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from labml_zero.assembly import Assembled, Recipe
from labml_zero.finetune.checkpoints import (resume, run_lineage, save,
                                             saved_steps)
from labml_zero.finetune.config import (DTYPES, FINETUNERS, MODEL_PRESETS,
                                        FinetuneConfig, laptop, neox_20b_biases)
from labml_zero.finetune.data import job_data
from labml_zero.finetune.token_file import TokenCache
from labml_zero.finetune.dataset import RankSampler
from labml_zero.finetune.steps import (GRAPH_WARMUP, Totals, Training,
                                       batch_loss, device_step, evaluate,
                                       micro_batch, train_step,
                                       validation_micro_batches)
from labml_zero.finetune.step_metrics import StepMeter, peak_flops
from labml_zero.finetune.tracking import labml_configs, start_labml
from labml_zero.family import TrainingBuild
from labml_zero.launch import DistContext, ranks_text
from labml_zero.optimizers.adam_fp16 import NonFiniteGradient
from labml_zero.optimizers.grad_scaler import LossScaler
from labml_zero.optimizers.graphed_step import GraphedStep
from labml_zero.zero3.config import ZeroConfig
from labml_zero.planner.placement import shard_specs
from labml_zero.planner.step_time import model_flops_per_token
from labml_zero.planner.placement_report import measured_lines
from labml_zero.zero3.sharded_model import Zero3Sequential

__all__ = ["FinetuneConfig", "laptop", "neox_20b_biases", "MODEL_PRESETS",
           "DTYPES", "FINETUNERS", "train", "build_model",
           "NonFiniteLoss"]

# Test-only fault injection: `rank:step` makes that rank raise after that step.
# The failure tests use it to check that a dying rank ends the whole job.
FAIL_AT_STEP_ENV = "LABML_ZERO_FAIL_AT_STEP"
# Test-only: `step` makes every rank's training loss NaN from that step on, the
# way weights gone bad would.
NAN_AT_STEP_ENV = "LABML_ZERO_NAN_AT_STEP"

# Below a loss scale of 1 the scaler shrinks the gradients: an overflow that
# persists there is not the scale's doing (see Note: non-finite losses).
SCALE_FLOOR = 1.0


class NonFiniteLoss(RuntimeError):
    """
    ## Note: non-finite losses

    A non-finite training loss means the weights (or the data) went bad: every
    later step would train on garbage. With bf16 or fp32 the job stops at the
    first one. With fp16 an overflow is expected now and then: the scaler skips
    that step and halves the scale, so the job stops only when the loss is still
    non-finite with the scale below `SCALE_FLOOR`, where scaling no longer
    explains it. The check reads the step's all-reduced loss, which every rank
    has, so all ranks stop at the same step. Before each save the trainable
    shards are checked to be finite too (the last update may have broken them
    while the loss was still finite), so every checkpoint kept can be resumed.
    """

    # the message is the whole story: the launcher leaves out the traceback
    user_error = True


# ## The model


def build_model(config: FinetuneConfig, ctx: DistContext,
                probe=None) -> Assembled:
    """
    ### Build on meta, mark, shard, initialise or load, place, optimizer

    The job imports no model package: the configuration picks a [model
    family](../family.html) (`--model`'s preset, or `--checkpoint`'s
    `config.json` `model_type`, from [the registry](../families.html)), and
    every model-specific question goes to that object: the config, the sharded
    model, its weights, the tokenizer, the exports and the sample. The step, the
    data order, the checkpoints and the tracking are the job's, the same for
    every family. A model whose input and output embeddings are one matrix
    (tied: SmolLM2, Llama-3.2) trains too: `zero3_layers` lays the matrix out
    once, in the embedding layer, gathered for the whole step (the Llama
    model's [Note: a tied embedding in the chunk
    layout](../llama/model.html)).

    GPT-NeoX-20B must never exist whole on one rank. The model is put together
    by its family's `assemble` (GPT-NeoX's is
    [`build_neox`](../neox/build.html), the benchmark's path too), with the
    fused kernels of `kernels` (on GPUs all of the family's, by default) and,
    with `compile`, compiled layers: the layers are built on the meta device
    (no memory), marked by the
    fine-tuner, and sharded while still on meta; each chunk is then initialised on
    its own (the seeded initialiser is the same on every rank, each keeps its
    slice), or, with a Hugging Face checkpoint, each layer's tensors are read on
    the host and copied slice by slice into the shards. A rank never holds more
    than one chunk on its device beyond its shards, and one layer on the host.

    `probe(model)` runs one micro-batch's forward and backward, for
    `offload_optimizer='auto'`, which runs it `grad_accum` times, as `train_step`
    does.
    """
    family = config.family
    model = config.model_config()
    build = TrainingBuild(model, kernels=config.kernels, compile=config.compile,
                          filter_layers=config.filter_layers)
    dtype = config.torch_dtype(ctx.device)
    scaled = dtype == torch.float16
    early = config.clip_grad is None and not scaled
    tuner = config.tuner()
    recipe = Recipe(
        zero=ZeroConfig(dtype=dtype,
                        activation_checkpointing=config.activation_checkpointing,
                        prefetch_depth=config.prefetch_depth,
                        peer_gather=config.peer_memory,
                        peer_reduce=config.peer_memory,
                        shard_group_size=config.shard_group_size),
        finetune=tuner,
        offload_optimizer=config.offload_optimizer,
        offload_params=config.offload_params, grad_accum=config.grad_accum,
        lr=config.lr, weight_decay=config.weight_decay,
        # updates overlap the backward pass unless clipping or unscaling
        # changes the gradients after it; each then frees its gradient, as
        # the planner's budget counts, and sums its squares for `grad_norm`
        update_during_backward=early, free_grads=early, grad_squares=early,
        states=config.optimizer_states, seed=config.seed)
    if config.checkpoint is None:
        # Random weights, drawn one chunk at a time into the chunk's buffer.
        init, load = family.init_parameter(model), None
    else:
        hf = family.open_checkpoint(config.checkpoint)

        # Pretrained weights are loaded after sharding; the chunks start at 0.
        def init(name: str, param: torch.Tensor) -> None:
            pass

        def load(sharded) -> None:
            for layer in sharded:
                # [one layer] on the host, shapes checked before reading; each
                # rank copies only its slices into its shards (and fp32 masters).
                # LoRA's adapters are not in the checkpoint: they keep their init.
                family.load_sharded(hf, layer)

    if config.finetune == "lora":
        # adapters: $A$ drawn as PEFT draws it, $B = 0$, inside each chunk like
        # the rest; so the model at step 0 is the base model
        init = tuner.init_param(init)
    return family.assemble(build, recipe, device=ctx.device, init_param=init,
                           load=load, probe=probe)


def env_step(name: str, rank: int) -> int | None:
    """
    #### A test-only fault's step, from the environment

    `LABML_ZERO_FAIL_AT_STEP` is `rank:step` (that rank raises after that
    step); `LABML_ZERO_NAN_AT_STEP` is `step` (every rank's loss is NaN from it).
    """
    value = os.environ.get(name)
    if not value:
        return None
    if name == NAN_AT_STEP_ENV:
        return int(value)
    fail_rank, step = (int(x) for x in value.split(":"))
    return step if fail_rank == rank else None


def check_shards_finite(training: Training, step: int) -> None:
    """
    ### Refuse to save shards that are not finite

    One all-reduce of a flag, so every rank raises alike. Only trainable shards
    change, so only they are read.
    """
    shards = training.model.get_trainable_chunk()
    comm = training.model.runtime.comm
    finite = torch.ones((), dtype=torch.float32, device=comm.device)
    for shard in shards:
        finite *= torch.isfinite(shard).all()
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item() < 1:  # host sync: .item(), once per save
        raise NonFiniteLoss(f"non-finite weights after step {step}: not saving "
                            f"a checkpoint of them")


def check_loss(totals: Totals, step: int, scaler: LossScaler | None,
               last_saved: Path | None) -> None:
    """
    ### Stop on a training loss that stays non-finite

    At once without a scaler, and with one only once the scale is below
    `SCALE_FLOOR` (see Note: non-finite losses).
    """
    if math.isfinite(totals.loss):
        return
    if scaler is not None and scaler.scale_value >= SCALE_FLOOR:
        return  # the scaler skipped this step and backed off
    kept = (f"the last good checkpoint is {last_saved}" if last_saved is not None
            else "no checkpoint was written")
    scale = (f" with the loss scale at {scaler.scale_value:g}" if scaler is not None
             else "")
    raise NonFiniteLoss(f"loss became non-finite at step {step} (training loss "
                        f"{totals.loss}{scale}); lower the learning rate ({kept})")


# The automatic offload predicts the device and host peaks from one probe step;
# after this many steps of the job the measured peaks are printed beside them.
PEAKS_AFTER_STEPS = 2


def measured_peaks(built: Assembled, ctx: DistContext, steps: int) -> list[str]:
    """
    ### The automatic offload's measured peaks, on rank 0

    Empty unless `offload_optimizer='auto'` decided the placement. The device
    peak counts from `reset_peak_memory_stats` before the first step, so the
    probe and the build are not in it.
    """
    if built.decided is None or ctx.rank != 0:
        return []
    return measured_lines(built.decided, shard_specs(built.model),
                          device=ctx.device, steps=steps)


def weights_origin(config: FinetuneConfig, step: int) -> str:
    """Where the weights came from, for the banner."""
    if step:
        return f"weights from checkpoint {config.resume} (after step {step})"
    if config.checkpoint:
        return f"weights from {config.checkpoint}"
    return "randomly initialised (no --checkpoint given)"


def layers_kept(config: FinetuneConfig, model) -> int:
    """The transformer layers the run builds: `filter_layers`' or the model's."""
    if config.filter_layers is None:
        return model.n_layers
    return len(config.filter_layers)


def token_flops(config: FinetuneConfig, model) -> float:
    """A token's FLOPs for the MFU, over the layers kept: the planner's
    `model_flops_per_token` for what trains (the weight gradients of the
    matrices that train only), the count of every MFU in the project.
    `model` is the family's config, a dataclass with `n_layers`."""
    kept = replace(model, n_layers=layers_kept(config, model))
    return model_flops_per_token(config.family, kept, config.seq_len,
                                 config.finetune)


def banner(config: FinetuneConfig, model, counts, *, step: int,
           world_size: int) -> str:
    """
    The line that opens a run: the layers it keeps (`filter_layers` may keep
    fewer than the model's), their parameters, the weights' origin, what
    trains and on how many ranks. `counts` is the fine-tuner's `TrainableCount`.
    """
    kept = layers_kept(config, model)
    return (f"{config.family.title}: {kept} layer{'s' if kept != 1 else ''} of "
            f"width {model.d_model}, {counts.total:,} parameters, "
            f"{weights_origin(config, step)}; training {counts.trainable:,} "
            f"({config.finetune}) on {ranks_text(world_size)}")


# Steps whose time the closing throughput line leaves out: the first compiles
# (with `compile`), the first `GRAPH_WARMUP` run eagerly and the next records
# the graph (with `cuda_graph`); the benchmark's default warm-up is as long.
STEADY_AFTER = GRAPH_WARMUP + 1


# ## The job


def train(ctx: DistContext, config: FinetuneConfig,
          caches: tuple[TokenCache, ...] = ()) -> None:
    """
    ## The job, on one rank

    1. the labml run, the data, the sharded model, the optimizer on its shards;
    2. with `resume`, the shards, the optimizer, the sampler and the step from
       the checkpoint;
    3. the loop: step, track, stop on a non-finite loss, evaluate, checkpoint;
    4. the Hugging Face checkpoint and LoRA's adapter, if asked for;
    5. a sample from the fine-tuned model.

    Its settings are [the configuration](config.html), its numbers ([what a
    step shows](step_metrics.html)) go to [labml](tracking.html), and the
    command line is [`finetune_neox`](cli.html), which runs [the pre-flight
    checks](preflight.html) before it starts the ranks.
    """
    from labml import experiment

    run = start_labml(config, ctx, python_file=__file__)
    # labml saves the configuration from the run's start on; the build's facts
    # join it once they are known
    experiment.configs(labml_configs(config, ctx))
    # the run is in the app from here on, and ends there whatever ends it: a
    # rank that fails to build, to load or to step ends it too (see
    # [tracking](tracking.html), Note: the end of a run that failed)
    with run.started():
        fine_tune(ctx, config, caches, run_uuid=run.uuid)


def fine_tune(ctx: DistContext, config: FinetuneConfig,
              caches: tuple[TokenCache, ...], *, run_uuid: str) -> None:
    """
    ### The job inside its labml run

    The steps of `train` after the first: the data, the model, the loop, the
    exports and the sample. `run_uuid` names this run's checkpoints.
    """
    from labml import experiment, logger, monit, tracker

    family = config.family
    shape = config.model_config()
    # checked before any rank started; `caches` are the token files the launcher
    # decided, so this checks the data is unchanged and maps them
    data = job_data(config, world_size=ctx.world_size, n_vocab=shape.n_vocab,
                    caches=caches)
    tokenizer, total_steps = data.tokenizer, data.total_steps
    sampler = RankSampler(len(data.train), batch_size=config.batch_size,
                          grad_accum=config.grad_accum, rank=ctx.rank,
                          world_size=ctx.world_size, seed=config.seed)
    schedule = config.schedule(total_steps)

    fused_loss = family.resolve_kernels(config.kernels, ctx.device).loss

    def probe(model: Zero3Sequential) -> None:
        # one micro-batch of the training split, without moving the sampler,
        # through the loss the steps use
        batch = micro_batch(data.train, list(range(config.batch_size)), ctx.device)
        batch_loss(model, batch, fused=fused_loss)[0].backward()

    built = build_model(config, ctx, probe)
    model = built.model
    scaled = config.torch_dtype(ctx.device) == torch.float16
    scaler = LossScaler(model.runtime.comm) if scaled else None
    training = Training(model, built.optimizer, scaler, fused_loss=fused_loss)
    if config.cuda_graph:
        # refused before start where it cannot apply (`cuda_graph_refusal`)
        training = training._replace(graphed=GraphedStep(
            lambda batch: device_step(training, batch, config), built.optimizer,
            warmup=GRAPH_WARMUP, counter=model.runtime.comm.counter))
    step = resume(config, training, sampler) if config.resume is not None else 0
    if step >= total_steps:
        # preflight refuses this for --steps; with --epochs it shows only here
        if ctx.rank == 0:
            logger.log(f"{config.resume} is already at step {step} of "
                       f"{total_steps}: nothing to train")
        return
    experiment.configs(labml_configs(
        config, ctx, total_steps=total_steps,
        chunk_numel=max(c.numel for c in model.chunks), n_chunks=len(model.chunks),
        params_total=built.counts.total, params_trainable=built.counts.trainable,
        n_layers=shape.n_layers, d_model=shape.d_model,
        n_vocab=shape.n_vocab))
    dtype = config.torch_dtype(ctx.device)
    meter = StepMeter(token_flops=token_flops(config, shape),
                      peak=peak_flops(ctx.device, dtype), world_size=ctx.world_size,
                      device=ctx.device, warmup=STEADY_AFTER)
    fail_at = env_step(FAIL_AT_STEP_ENV, ctx.rank)
    nan_at = env_step(NAN_AT_STEP_ENV, ctx.rank)
    last_saved = Path(config.resume) if config.resume is not None else None
    # whose checkpoints pruning may remove: this run's chain of resumes only
    lineage = run_lineage(config, run_uuid)
    saves = set(saved_steps(config, step, total_steps))

    def track_valid(at: int) -> None:
        valid = evaluate(model, data.valid, config, ctx)
        tracker.save(at, {"loss.valid": valid.loss, "acc.valid": valid.accuracy})
        if ctx.rank == 0:
            # off the screen line, which would repeat it (see tracking)
            logger.log(f"step {at}: loss.valid {valid.loss:.4f}, "
                       f"acc.valid {valid.accuracy:.4f}")

    if ctx.rank == 0:
        logger.log(banner(config, shape, built.counts, step=step,
                          world_size=ctx.world_size))
        _, short = validation_micro_batches(config, len(data.valid), ctx.world_size)
        if short:
            logger.log(short)
    if step == 0:
        track_valid(0)
        tracker.new_line()
    first = step + 1
    peaks_at = first - 1 + min(PEAKS_AFTER_STEPS, total_steps - step)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    meter.clock.restart()
    for step in monit.loop(range(first, total_steps + 1)):
        # the rate is a pure function of the step: the same after a resume
        lr = schedule.rate(step)
        for group in training.optimizer.param_groups:
            group["lr"] = lr
        try:
            totals = train_step(training, sampler.next_step(), data.train, config)
        except NonFiniteGradient as e:  # an early update met it first
            raise NonFiniteLoss(f"loss became non-finite at step {step}; lower "
                                f"the learning rate (--lr {lr:g})") from e
        if step == peaks_at:
            for line in measured_peaks(built, ctx, step - first + 1):
                logger.log(line)
        # the launcher's hang watch: a rank silent for `hang_timeout` is hung
        ctx.heartbeat(step)
        if nan_at is not None and step >= nan_at:
            totals = totals._replace(loss_sum=math.nan)
        check_loss(totals, step, scaler, last_saved)
        # the fused loss knows no prediction: no training accuracy then
        accuracy = ({} if math.isnan(totals.correct)
                    else {"acc.train": totals.accuracy})
        tracker.save(step, {"loss.train": totals.loss, **accuracy,
                            **meter.indicators(totals, lr=lr, scale=(
                                scaler.scale_value if scaler else None))})
        if step % config.valid_every == 0 or step == total_steps:
            track_valid(step)
        if step in saves:
            check_shards_finite(training, step)
            last_saved = save(config, step, training, sampler, lineage,
                              caches=data.caches)
        if fail_at is not None and step >= fail_at:
            raise RuntimeError(f"injected failure on rank {ctx.rank} after step "
                               f"{step} ({FAIL_AT_STEP_ENV})")
        ctx.heartbeat(step)  # again after a validation or a save, which take long
        tracker.new_line()
        meter.clock.restart()  # the next step's time excludes this one's extras

    if ctx.rank == 0 and (steady := meter.steady_line()) is not None:
        logger.log(steady)
    with beating(ctx, config.hang_timeout):
        export(config, built, shape, ctx.device)
        if config.sample_tokens:
            text = sample(model, tokenizer, config, ctx)
            if ctx.rank == 0:
                logger.log(f"\nSample after {total_steps} steps:\n"
                           f"{config.prompt}{text}\n")


@contextmanager
def beating(ctx: DistContext, hang_timeout: float) -> Iterator[None]:
    """
    ### The hang watch, after the last step

    The exports and the sample gather every chunk (the sample once per token),
    which on a large model takes longer than any step; no step count measures
    them. So a thread beats for the rank four times per `hang_timeout` while
    they run, and a rank stuck in one of their collectives is ended by the
    collectives' own timeout, which the launcher sets above `hang_timeout`.
    """
    done = threading.Event()

    def beat() -> None:
        while not done.wait(hang_timeout / 4):
            ctx.heartbeat()

    thread = threading.Thread(target=beat, daemon=True, name="after the last step")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def export(config: FinetuneConfig, built: Assembled, model,
           device: torch.device) -> None:
    """
    ### The exports, after the last step

    Every rank takes part (each chunk is gathered in turn, with the optimizer's
    fp32 masters where it has them); rank 0 writes. The Hugging Face checkpoint
    (`export_hf`, any fine-tune, LoRA's adapters merged) loads in transformers
    alone, with the tokenizer the job encoded with; the adapter in peft over the
    base checkpoint. A previous export of the same kind is replaced whole, once
    the new one is complete; preflight has refused any other destination (see
    [fine-tune exports](../neox/lora_export.html)). The writers are the
    family's: `model` is its config.
    """
    if config.export_hf is None and config.export_adapter is None:
        return
    family = config.family
    tuner = config.tuner() if config.finetune == "lora" else None
    if config.export_hf is not None:
        family.export_hf(config.export_hf, built.model, tuner, model,
                         built.optimizer, overwrite=True,
                         tokenizer=family.tokenizer_file(config.checkpoint),
                         snapshot=config.checkpoint,
                         dtype=config.export_dtype(config.torch_dtype(device)))
    if config.export_adapter is not None:
        family.export_adapter(config.export_adapter, built.model, tuner,
                              built.optimizer,
                              base_model_name_or_path=config.checkpoint,
                              overwrite=True)


def sample(model: Zero3Sequential, tokenizer, config: FinetuneConfig,
           ctx: DistContext) -> str:
    """
    ### A sample through the sharded model

    It re-runs the whole prefix per token (no KV cache), so every rank gathers
    every layer for every token. Every rank runs the same forwards. The sampler is
    seeded alike on every rank, so all draw the same tokens; even if rounding made
    them differ, only the text would, not the sequence of collectives.
    """
    family = config.family
    generator = torch.Generator().manual_seed(config.seed)
    sampling = family.sampling(top_k=config.top_k, max_context=config.seq_len)
    return family.generate(model, tokenizer, config.prompt,
                           n_tokens=config.sample_tokens, sampling=sampling,
                           generator=generator, device=ctx.device)
