"""
---
title: The Results page
summary: Measured figures from bench/results, rendered once.
---

# The Results page

Every measured figure of the site comes from the benchmark's JSON lines in
`bench/results/` (one line per engine and workload, written by
`python -m bench.run --out FILE`; `bench/README.md` describes the fields). This
module reads them all and keeps, for each *configuration* (workload, engine,
compiled or not, number and kind of GPUs, sequences per GPU, the step replayed
as a CUDA graph or not, the optimizer's state layout, fp8 products,
recomputation, labml_zero's prefetch depth), the **latest** line: files are
ordered by the date in their name, then by their run number, and lines within a file
by their position, so a later measurement of the same configuration replaces an
earlier one. Lines without a `status` (loss curves, probes) are not measurements of
a step and are skipped.

A note inserts a figure with `{{bench: W2 labml_zero tokens_per_s}}`, adding
`compiled`, `graph`, `gpus=1`, `gpu=h200`, `batch=8`, `depth=2` and/or
`states=bf16-moments` to pick another configuration (`batch=` and `gpu=` are
needed only where one configuration was measured at several batch sizes or on
several kinds of GPU; without `states=`, the fp32 states; without `depth=`,
prefetch depth 1);
the figure links to its row here, so each number exists once and says where it
comes from.

MFU is recomputed here from each line's tokens per second and its workload's
FLOPs per token, over the data sheet's dense bf16 peak of the line's GPU (989.4
TFLOP/s on an H200, [the one `mfu`](labml_zero/finetune/step_metrics.html)):
older lines wrote theirs over a measured matrix product's 790 TFLOP/s, and the
lines themselves are raw data, kept as they were written.

For each workload, kind and number of GPUs, **each engine's best setting** is
the fastest of its configurations (eager, compiled, replayed as a CUDA graph) at
the same batch: an H100's line never stands for an H200's; "Best settings"
lists them, so that engines are compared at
their best, each saying which setting that is.

Two "engines" of the rows are not engines but the one-device bounds of
`bench/bounds.py`: `model_only`, the model's forward and backward passes alone,
and `update_floor`, the same with AdamW's update in one pass of fp32 masters and
moments, the least step any engine with `AdamFP16`'s numerics can take.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from bench.predictions import prediction_markdown

from .paths import REPO, BuildError
from .quality_curves import quality_markdown

RESULTS_DIR = "bench/results"
FILE_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-(?:run(\d+)-)?")

def line_mfu(line: dict) -> float | None:
    """
    MFU of a line on the data-sheet basis: its tokens/s times its workload's
    FLOPs per token (the registry's model at the line's sequence length and
    fine-tuner), over its GPUs' bf16 peak. `None` for a CPU, an unknown GPU or
    a model not in the registry (the tiny smoke-test shapes).
    """
    from dataclasses import replace

    from bench.workloads import mfu, workloads

    workload = workloads().get(line.get("workload"))
    model = line.get("model") or {}
    if workload is None or model.get("d_model") != workload.model.d_model:
        return None
    # a line at another depth (`bench.run --layers`) has its own FLOPs
    depth = model.get("n_layers") or workload.model.n_layers
    workload = replace(workload, seq=int(line.get("seq") or workload.seq),
                       finetune=line.get("finetune") or workload.finetune,
                       model=replace(workload.model, n_layers=depth))
    return mfu(workload, line["tokens_per_s"], int(line.get("world_size") or 1),
               line.get("device"))


def _mfu_cell(line: dict) -> str:
    share = line_mfu(line)
    return "—" if share is None else f"{100 * share:.1f}%"


# the one-device bounds, not engines: never a "best setting"
BOUND_ENGINES = ("model_only", "update_floor")

FIELDS = {
    "tokens_per_s": lambda line: f"{line['tokens_per_s']:,.0f} tokens/s",
    "mfu": _mfu_cell,
    "peak_mem_gib": lambda line: f"{line['peak_mem_gib']:.1f} GiB",
    "step_time_mean_s": lambda line: f"{line['step_time_mean_s']:.3f} s",
    "loss": lambda line: f"{line['loss']:.2f}",
}
"""The fields a note may insert, each with its one formatting."""


@dataclass(frozen=True)
class Key:
    workload: str
    engine: str
    compiled: bool
    gpus: int
    batch: int
    """Sequences per GPU (`batch_per_gpu`)."""
    graphed: bool = False
    """labml_zero's whole step replayed as one CUDA graph (`cuda_graph`)."""
    states: str = "fp32"
    """The optimizer's state layout (`optimizer_states`; a line older than
    the field kept fp32 states)."""
    fp8: bool = False
    """labml_zero's linears in fp8 (`fp8` among the line's `kernels`): its own
    configuration, never mistaken for the bf16 one."""
    recompute: bool | None = None
    """`None` where the line recomputes activations as its workload does;
    else whether it did (`bench.run --recompute`): W1 recomputed is a
    configuration of its own."""
    gpu: str = ""
    """The kind of GPU, a short name of the planner's table (`h200`, `h100`;
    `gpu_of`), "" on a CPU or an unknown device: the same step on an H100 is
    another measurement, never a later one of the H200's."""
    depth: int = 1
    """labml_zero's prefetch depth (`--prefetch-depth`; the peers ignore it)."""

    @property
    def anchor(self) -> str:
        tail = (("-compiled" if self.compiled else "") + f"-{self.gpus}gpu"
                + f"-b{self.batch}" + ("-graph" if self.graphed else "")
                + ("" if self.states == "fp32" else f"-{self.states}")
                + ("-fp8" if self.fp8 else "")
                + {None: "", True: "-recompute", False: "-no-recompute"}[self.recompute]
                + (f"-{self.gpu}" if self.gpu else "")
                + ("" if self.depth == 1 else f"-depth{self.depth}"))
        return f"result-{self.workload}-{self.engine}{tail}".lower().replace(" ", "-")


@dataclass(frozen=True)
class Measurement:
    key: Key
    line: dict
    file: str
    date: str


def _file_order(path: Path) -> tuple[str, int, str]:
    match = FILE_NAME.match(path.name)
    if not match:
        return ("", 0, path.name)
    return (match.group(1), int(match.group(2) or 0), path.name)


def workload_name(line: dict) -> str:
    """The line's workload, with its depth where `bench.run --layers` changed
    it (`W2-1 L8`): another model, never the same row as the full depth."""
    from bench.workloads import workloads

    workload = workloads().get(line["workload"])
    depth = (line.get("model") or {}).get("n_layers")
    if workload is None or not depth or depth == workload.model.n_layers:
        return line["workload"]
    return f"{line['workload']} L{depth}"


def gpu_of(line: dict) -> str:
    """`Key.gpu` of a line: the planner's short name found in its `device`
    (`NVIDIA H100 80GB HBM3` -> `h100`), "" for none."""
    from labml_zero.planner.devices import GPUS

    device = (line.get("device") or "").lower()
    return next((name for name in GPUS if name in device), "")


def depth_of(line: dict) -> int:
    """`Key.depth` of a line: labml_zero's prefetch depth, 1 for the peers
    (`bench.run` writes its flag on every engine's line)."""
    if line.get("engine") != "labml_zero":
        return 1
    return int(line.get("prefetch_depth") or 1)


def recompute_of(line: dict) -> bool | None:
    """`Key.recompute` of a line: `None` where it recomputes as its workload
    does (or says nothing of it)."""
    from bench.workloads import workloads as known

    ran = line.get("activation_checkpointing")
    workload = known().get(line["workload"])
    if ran is None or workload is None or ran == workload.activation_checkpointing:
        return None
    return bool(ran)


def load_results(root: Path) -> dict[Key, Measurement]:
    """The latest measurement of each configuration, ordered by key."""
    folder = root / RESULTS_DIR
    latest: dict[Key, Measurement] = {}
    if not folder.is_dir():
        return {}
    for path in sorted(folder.glob("*.jsonl"), key=_file_order):
        date = _file_order(path)[0]
        for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError as exc:
                raise BuildError(f"{RESULTS_DIR}/{path.name}:{n}: not JSON ({exc})")
            if "status" not in line or "workload" not in line:
                continue
            key = Key(workload_name(line), line["engine"], bool(line.get("compiled")),
                      int(line.get("world_size") or 1),
                      int(line.get("batch_per_gpu") or 0),
                      bool(line.get("cuda_graph")),
                      line.get("optimizer_states") or "fp32",
                      "fp8" in (line.get("kernels") or "").split(","),
                      recompute_of(line), gpu_of(line), depth_of(line))
            latest[key] = Measurement(key, line, path.name, date)
    order = {w: i for i, w in enumerate(("labml_zero", "fsdp2", "ddp", "deepspeed"))}
    return dict(sorted(latest.items(), key=lambda kv: (
        kv[0].workload, kv[0].gpu, kv[0].gpus, kv[0].compiled, kv[0].batch,
        order.get(kv[0].engine, 9), kv[0].engine, kv[0].graphed,
        kv[0].states != "fp32", kv[0].states, kv[0].fp8,
        kv[0].recompute is not None, bool(kv[0].recompute), kv[0].depth)))


def command(m: Measurement) -> str:
    """The `bench.run` command line that measures this configuration."""
    line = m.line
    parts = ["python -m bench.run", f"--workloads {line['workload']}",
             f"--engines {m.key.engine}"]
    if m.key.workload != line["workload"]:  # another depth
        parts.append(f"--layers {line['model']['n_layers']}")
    if "steps" in line:
        parts.append(f"--steps {line['steps']} --warmup {line['warmup']}")
    if m.key.gpus != 2:
        parts.append(f"--world-size {m.key.gpus}")
    if m.key.batch:
        parts.append(f"--batch {m.key.batch}")
    if m.key.compiled:
        parts.append("--compile")
    if m.key.graphed:
        parts.append("--cuda-graph")
    if m.key.states != "fp32":
        parts.append(f"--optimizer-states {m.key.states}")
    if m.key.recompute is not None:
        parts.append(f"--recompute {'yes' if m.key.recompute else 'no'}")
    if line.get("kernels") not in (None, "none"):
        parts.append(f"--kernels {line['kernels']}")
    if m.key.engine == "labml_zero" and line.get("prefetch_depth", 1) != 1:
        parts.append(f"--prefetch-depth {line['prefetch_depth']}")
    if m.key.engine == "labml_zero" and line.get("peer_gather"):
        parts.append("--peer-gather")
    if m.key.engine == "labml_zero" and line.get("peer_reduce"):
        parts.append("--peer-reduce")
    return " ".join(parts)


def lookup(results: dict[Key, Measurement], spec: str) -> tuple[str, Key]:
    """
    `W2 labml_zero [compiled] [graph] [fp8] [recompute|no-recompute] [gpus=N]
    [gpu=NAME] [batch=B] [depth=D] [states=NAME] FIELD`
    -> (formatted value, its key).

    Raises `BuildError` for an unknown field or a configuration never measured.
    """
    words = spec.split()
    if len(words) < 3:
        raise BuildError(f"bench directive {spec!r}: write WORKLOAD ENGINE FIELD")
    workload, engine, *mods, name = words
    compiled = "compiled" in mods
    graphed = "graph" in mods
    fp8 = "fp8" in mods
    recompute = (True if "recompute" in mods
                 else False if "no-recompute" in mods else None)
    gpus, batch, states, gpu, depth = 2, None, "fp32", None, 1
    for mod in mods:
        if mod.startswith("gpus="):
            gpus = int(mod[5:])
        elif mod.startswith("gpu="):
            gpu = mod[4:]
        elif mod.startswith("batch="):
            batch = int(mod[6:])
        elif mod.startswith("depth="):
            depth = int(mod[6:])
        elif mod.startswith("states="):
            states = mod[7:]
        elif mod not in ("compiled", "graph", "fp8", "recompute", "no-recompute"):
            raise BuildError(f"bench directive {spec!r}: unknown word {mod!r}")
    if name not in FIELDS:
        raise BuildError(f"bench directive {spec!r}: field {name!r} is not one of "
                         f"{', '.join(FIELDS)}")
    # the configurations the words name, batch and GPU kind left open
    named = [k for k in results
             if (k.workload, k.engine, k.compiled, k.gpus, k.graphed, k.states,
                 k.fp8, k.recompute, k.depth)
             == (workload, engine, compiled, gpus, graphed, states, fp8,
                 recompute, depth)]
    kinds = sorted({k.gpu for k in named})
    if gpu is None and len(kinds) > 1:
        raise BuildError(f"bench directive {spec!r}: measured on GPUs "
                         f"{kinds}; add gpu=NAME")
    if gpu is None:
        gpu = kinds[0] if kinds else ""
    batches = sorted(k.batch for k in named if k.gpu == gpu)
    if batch is None and len(batches) > 1:
        raise BuildError(f"bench directive {spec!r}: measured at batch sizes "
                         f"{batches}; add batch=B")
    if batch is None:
        batch = batches[0] if batches else 0
    key = Key(workload, engine, compiled, gpus, batch, graphed, states, fp8,
              recompute, gpu, depth)
    m = results.get(key)
    if m is None or m.line.get("status") != "ok":
        raise BuildError(f"bench directive {spec!r}: no successful measurement of "
                         f"that configuration in {RESULTS_DIR}")
    return FIELDS[name](m.line), key


def _cell(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _workload(line: dict) -> str:
    model = line.get("model") or {}
    shape = (f"{model.get('n_layers')} layers, $d = {model.get('d_model')}$"
             if model else "")
    return (f"{line.get('batch_per_gpu')} × {line.get('seq')} tokens per GPU, "
            f"fine-tunes {line.get('finetune')}, {shape}")


def setting(key: Key) -> str:
    """How a configuration ran: eager, compiled, a CUDA graph (or both), and
    the optimizer's states where they are not fp32."""
    words = (["compiled"] if key.compiled else []) + (
        ["CUDA graph"] if key.graphed else [])
    states = [] if key.states == "fp32" else [f"{key.states} states"]
    recompute = {None: [], True: ["recomputed"],
                 False: ["not recomputed"]}[key.recompute]
    depth = [] if key.depth == 1 else [f"prefetch depth {key.depth}"]
    return " + ".join((words or ["eager"]) + states
                      + (["fp8 products"] if key.fp8 else []) + recompute + depth)


def best_settings(results: dict[Key, Measurement]
                  ) -> dict[tuple[str, str, int, int], dict[str, Measurement]]:
    """
    For each (workload, kind of GPU, GPUs, batch): each engine's fastest successful
    configuration, by tokens per second. labml_zero's fp8 lines are left out:
    the peers here multiply in bf16 (FSDP2 with fp8 is an engine of its own).
    """
    best: dict[tuple[str, str, int, int], dict[str, Measurement]] = {}
    for key, m in results.items():
        if (m.line.get("status") != "ok" or key.engine in BOUND_ENGINES
                or key.fp8):
            continue
        engines = best.setdefault((key.workload, key.gpu, key.gpus, key.batch), {})
        held = engines.get(key.engine)
        if held is None or m.line["tokens_per_s"] > held.line["tokens_per_s"]:
            engines[key.engine] = m
    return best


def best_markdown(results: dict[Key, Measurement]) -> list[str]:
    """The "Best settings" table: each engine at its best beside labml_zero's."""
    out = ["", "## Best settings", "",
           "Each engine's fastest configuration of a workload at one batch size; "
           "`× labml_zero` is its tokens per second over labml_zero's best.", "",
           DATA_OPEN, "",
           "| workload | GPUs | B | engine | best setting | tokens/s | MFU "
           "| × labml_zero |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (workload, gpu, gpus, batch), engines in best_settings(results).items():
        if len(engines) < 2:
            continue  # nothing to compare with
        ours = engines.get("labml_zero")
        for engine, m in engines.items():
            ratio = ("" if ours is None else
                     f"{m.line['tokens_per_s'] / ours.line['tokens_per_s']:.3f}")
            # the kernels may differ between the best lines: say which
            kernels = m.line.get("kernels") or "none"
            kind = f"{gpus} × {gpu.upper()}" if gpu else f"{gpus}"
            out.append(f"| {workload} | {kind} | {batch} | {engine} | "
                       f"[{setting(m.key)}](#{m.key.anchor}), kernels {kernels} | "
                       f"{m.line['tokens_per_s']:,.0f} | {_mfu_cell(m.line)} "
                       f"| {ratio} |")
    return out + ["", DATA_CLOSE]


# The tables of measured figures are figures, not notes: a reader looks a row up
# (its anchor is what a note's `{{bench: …}}` links to) rather than reads the
# table through, and the notes' counter (`docsite/notes_beside_code.py`) counts
# no figure's content as note words. The blank lines let the Markdown table
# inside the HTML block be parsed as a table.
DATA_OPEN = '<figure class="data">'
DATA_CLOSE = "</figure>"


# The page's notes, each beside the code that computes what it explains: a
# list of (Markdown, file, function or class, lines shown, first line shown).
Row = tuple[str, str, str, int, str]

# What the page says to its reader first (the docstring above is for the
# builder's), full width above its rows
READER_INTRO = """\
Every measured figure of the notes comes from this page: one row per workload,
engine and setting, the latest measurement of each, taken by the benchmark
(`python -m bench.run`). A figure quoted on another page links to its row here.
First each column of the tables, beside the code that computes it; then the
tables.
"""

COLUMN_ROWS: list[Row] = [
    ("### workload and B × T\n\n"
     "The model and job measured: the model's shape, the sequences per GPU $B$ "
     "and the tokens per sequence $T$ of one step, and which parameters train "
     "(every one, only the biases, or adapters). Each workload of the tables:",
     "bench/workloads.py", "workloads", 0, ""),
    ("### engine\n\n"
     "What trains the workload: `labml_zero`, PyTorch's FSDP2 (also as "
     "`fsdp2_float8`, with torchao's float8 linears), DDP, or "
     "DeepSpeed; or one of the two one-device bounds of `bench/bounds.py`, "
     "`model_only` (the model's forward and backward passes alone, no update) "
     "and `update_floor` (the same with AdamW's update in one pass over fp32 "
     "masters and moments, the least step any engine with `AdamFP16`'s numerics "
     "can take).",
     "bench/pair.py", "builder", 0, ""),
    ("### compiled, GPUs and settings\n\n"
     "Each line records how it ran: whether the layers ran through "
     "`torch.compile`, how many GPUs of which kind, and the engine's options; "
     "*settings* lists those that differ from labml_zero's defaults (peer "
     "gather, peer reduce, the prefetch depth, the step replayed as one CUDA "
     "graph, and an optimizer state layout other than fp32, such as "
     "`bf16-moments`). The other engines ignore these options and keep fp32 "
     "states, as `model_only` does; `update_floor` keeps labml_zero's.",
     "bench/pair.py", "describe", 0, ""),
    ("### step s (± std)\n\n"
     "Each rank runs `warmup` untimed steps, then `steps` timed ones, and "
     "times each on the device's clock. The column is the mean step time of the "
     "slowest rank (every rank waits for it at the next collective) and the "
     "largest standard deviation of the ranks' timed steps.",
     "bench/measure.py", "time_steps", 0, ""),
    ("### tokens/s\n\n"
     "The tokens of all GPUs together, $N_d \\cdot B \\cdot T$, over the mean "
     "step time of the slowest rank.",
     "bench/pair.py", "merge", 2, "step_s = max"),
    ("### MFU\n\n"
     "Model FLOPs utilisation: the model's FLOPs per token times the tokens per "
     "second, over the GPUs' dense bf16 peak from the data sheet (the same peak "
     "for an H100 and an H200). The page computes it again from each line's "
     "tokens per second, so lines written over another peak read alike.",
     "docsite/results.py", "line_mfu", 0, ""),
    ("The FLOPs per token count the matrix products only: $6N + 12LTd$ with $N$ "
     "the weights of the matrix products, $L$ the layers and $T$ the sequence "
     "length, and $4N$ in place of $6N$ when only the biases train (no weight "
     "gradient is computed).",
     "bench/workloads.py", "flops_per_token", 0, ""),
    ("### peak GiB\n\n"
     "The most memory the caching allocator held for tensors on any one GPU, "
     "while building the model or while training, whichever is higher; memory "
     "the allocator does not see (peer buffers) is added.",
     "bench/measure.py", "peak_memory", 0, ""),
    ("### loss\n\n"
     "The training loss of the last timed step, averaged over the ranks, after "
     "`warmup + steps` updates. The tokens are random, so the loss starts near "
     "$\\ln V$ for a vocabulary of $V$ tokens ({vocab_loss} for GPT-NeoX's "
     "{vocab:,}) and falls only "
     "as the model learns the tokens' flat distribution; it checks that training "
     "ran, not how well a model learns.",
     "bench/engine.py", "random_batches", 0, ""),
    ("### Why engines' losses differ on one workload\n\n"
     "Every engine now starts from the same weights, drawn here layer by layer, "
     "and reads the same batches, so the first step's loss is one number up to "
     "bf16 roundings (the test `test_engines_start_alike` in "
     "`tests/test_bench_start.py`). Lines measured before this existed started "
     "each engine from its own draw of the weights: their losses differ by their "
     "start, not by their arithmetic. Rows of one workload differ too where they "
     "ran a different batch or number of steps (the command of each row is in "
     "the last table), and `model_only` never updates, so its loss stays at its "
     "start.\n\n"
     "From one start, Adam moves a weight by about the learning rate whatever "
     "the gradient's scale, so a relative rounding difference $\\rho$ between "
     "two engines' arithmetic changes the loss after $k$ steps by at most "
     "$(k + 1)\\rho$ of itself (the rule of `tests/tolerance.py`). A gap in the "
     "second decimal after a dozen steps is a gap of start or of data, not of "
     "rounding.",
     "bench/engine.py", "InitialWeights", 24, ""),
]


def results_rows(results: dict[Key, Measurement]) -> list[Row]:
    """The Results page's rows after its opening, each (Markdown, file,
    function, lines, start) of the code it sits beside ("" for none)."""
    if not results:
        return [("No measurements in `bench/results/` yet.", "", "", 0, "")]
    workloads, seen = [], set()
    for key, m in results.items():
        if key.workload not in seen:
            seen.add(key.workload)
            # the glossary defines the workload; its depth is in the line
            workloads.append(f"* {{{{term: {m.line['workload']}}}}}"
                             f"{key.workload[len(m.line['workload']):]}: "
                             f"{_workload(m.line)}.")
    from bench.workloads import workloads as known

    vocab = known()["W1"].model.n_vocab
    doc, *rest = COLUMN_ROWS[0]
    rows: list[Row] = [(doc + "\n\n" + "\n".join(workloads), *rest)]
    rows += [(doc.format(vocab_loss=f"{math.log(vocab):.1f}", vocab=vocab)
              if "{vocab" in doc else doc, *rest) for doc, *rest in COLUMN_ROWS[1:]]
    # each table full width in a row of its own, under its heading and what it
    # holds, which sit beside the code that makes the table where there is one
    tables = _tables_markdown(results).split("\n## ")[1:]
    beside = [("", ""), ("docsite/results.py", "best_settings"),
              ("docsite/results.py", "command"),
              ("docsite/quality_curves.py", "quality_markdown"),
              ("bench/predictions.py", "prediction_markdown")]
    assert len(tables) == len(beside), "a table of the page has no row"
    for table, (file, name) in zip(tables, beside):
        if DATA_OPEN not in table:  # the quality curves: drawings, not a table
            rows.append(("## " + table.strip(), file, name, 0, ""))
            continue
        words, figure = table.split(DATA_OPEN, 1)
        if file:
            rows += [("## " + words.strip(), file, name, 0, ""),
                     (DATA_OPEN + figure, "", "", 0, "")]
        else:
            rows.append(("## " + words.strip() + "\n\n" + DATA_OPEN + figure,
                         "", "", 0, ""))
    return rows


def results_markdown(results: dict[Key, Measurement]) -> str:
    """The Results page's body, in Markdown, its rows one after another."""
    return "\n\n".join([READER_INTRO.strip()] + [
        row[0] for row in results_rows(results)]) + "\n"


def _tables_markdown(results: dict[Key, Measurement]) -> str:
    out = [""]
    out += ["## Measurements", "", DATA_OPEN, "", "| workload | engine | compiled | GPUs | B × T | tokens/s "
            "| step s (± std) | MFU | peak GiB | loss | settings |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, m in results.items():
        line = m.line
        settings = []
        # bench.run writes its flags on every line; they change only labml_zero.
        if key.engine != "labml_zero":
            line = {k: v for k, v in line.items()
                    if k not in ("peer_gather", "peer_reduce", "prefetch_depth")}
        if line.get("peer_gather"):
            settings.append("peer gather")
        if line.get("peer_reduce"):
            settings.append("peer reduce")
        if line.get("prefetch_depth", 1) != 1:
            settings.append(f"prefetch depth {line['prefetch_depth']}")
        if key.graphed:
            settings.append("CUDA graph")
        if key.states != "fp32":
            settings.append(f"{key.states} optimizer states")
        if key.fp8:
            settings.append("fp8 products")
        if key.recompute is not None:
            settings.append("recomputed" if key.recompute else "not recomputed")
        gpus = f"{key.gpus} × {line.get('device') or 'GPU'}"
        anchor = f'<span id="{key.anchor}"></span>'
        shape = f"{key.batch} × {line.get('seq')}"
        if line.get("status") != "ok":
            where = f" ({line['where']})" if line.get("where") else ""
            row = [f"{anchor}{key.workload}", key.engine,
                   "yes" if key.compiled else "no", gpus, shape,
                   f"{line['status']}{where}", "", "", "", "", ""]
        else:
            step = (f"{line['step_time_mean_s']:.3f} ± "
                    f"{line['step_time_std_s']:.3f}")
            row = [f"{anchor}{key.workload}", key.engine,
                   "yes" if key.compiled else "no", gpus, shape,
                   _cell(line.get("tokens_per_s"), ",.0f"), step,
                   _mfu_cell(line), _cell(line.get("peak_mem_gib"), ".1f"),
                   _cell(line.get("loss"), ".2f"), ", ".join(settings)]
        out.append("| " + " | ".join(row) + " |")
    out += ["", DATA_CLOSE]
    out += best_markdown(results)
    out += ["", "## Where each row comes from", "",
            "The date of the file each row was read from, the PyTorch it ran on "
            "and the command that measures it again.", "",
            DATA_OPEN, "", "| workload | engine | compiled | GPUs | B | date | PyTorch | file "
            "| command |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, m in results.items():
        out.append(
            f"| {key.workload} | {key.engine} | {'yes' if key.compiled else 'no'} "
            f"| {key.gpus} | {key.batch} | {m.date} | {m.line.get('torch', '')} "
            f"| `{m.file}` "
            f"| `{command(m)}` |")
    return ("\n".join(out + ["", DATA_CLOSE]) + "\n" + quality_markdown(REPO)
            + prediction_markdown(REPO / "bench" / "results"))
