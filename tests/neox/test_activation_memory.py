"""`labml_zero/neox/activation_memory.py`: the count against what autograd keeps.

Tiny bf16 models on the CPU. Two ways of looking:

* `saved_bytes`: `saved_tensors_hooks` see every tensor autograd saves; we count
  each storage once (a view saves its whole storage) and leave out parameters,
  which live in the engine's chunks.
* `LiveStorages`: a dispatch mode that holds weak references to every storage an
  operation creates, so it knows what is still alive at any moment: what
  recomputation keeps, and the peak of the loss's forward and backward.

The CPU differs from CUDA in one thing the count models: its layer norm keeps
mean and $1/\\sigma$ in bf16, CUDA in fp32. Each test adds the difference back,
naming it.
"""

import re
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from bench.workloads import workloads as bench_workloads
from docsite.directives import SEE, Directives
from docsite.paths import REPO
from labml_zero.neox import activation_memory as A
from labml_zero.neox import model as M
from labml_zero.neox.finetuners import finetuner
from labml_zero.neox.lora import TARGETS

BF16 = torch.bfloat16
FINETUNES = ("all", "ffn", "biases")
MiB, GiB = 2**20, 2**30

# Odd sizes on purpose: head widths 18 and 24 (rotary dims 4 and 6), an MLP
# width that is not 4d, the exact GELU, every rotary dim rotated, none rotated.
CONFIGS = {
    "d72": M.NeoXConfig(n_vocab=512, d_model=72, n_heads=4, n_layers=3),
    "d96_ff100": M.NeoXConfig(n_vocab=512, d_model=96, n_heads=4, n_layers=3,
                              d_ff=100, gelu_approximate="none"),
    "d64_rot1": M.NeoXConfig(n_vocab=512, d_model=64, n_heads=4, n_layers=3,
                             rotary_pct=1.0),
    "d64_rot0": M.NeoXConfig(n_vocab=512, d_model=64, n_heads=4, n_layers=3,
                             rotary_pct=0.0),
}
SIZES = [(2, 24), (3, 17)]
# LoRA: every single target, pairs that share an input row or not, all four
# (not rank 1: its A x, [B, T, 1] bf16, would pass for a layer norm statistic
# in `ln_stats_on_cpu`)
LORA_RANKS = (2, 5, 16)
LORA_TARGETS = [(t,) for t in TARGETS] + [
    ("query_key_value", "dense"), ("dense_h_to_4h", "dense_4h_to_h"), tuple(TARGETS)]


# the fine-tuners, and LoRA at three ranks and target sets
WHOLE = [(f, {}) for f in FINETUNES] + [
    ("lora", {"lora_rank": 2, "lora_targets": ("dense",)}),
    ("lora", {"lora_rank": 5, "lora_targets": ("dense_h_to_4h", "dense_4h_to_h")}),
    ("lora", {"lora_rank": 16, "lora_targets": tuple(TARGETS)})]


def whole_id(case):
    finetune, options = case
    return "-".join([finetune, str(options.get("lora_rank", "")),
                     *options.get("lora_targets", ())]).rstrip("-")


def lora_options(options):
    """`activation_bytes`'s LoRA arguments as `FineTuneLoRA`'s fields."""
    return {key.removeprefix("lora_"): value for key, value in options.items()}


def model(config, finetune, **options):
    torch.manual_seed(0)
    layers = M.build_layers(config, dtype=BF16)
    finetuner(finetune, **options)(layers)
    return layers


def rotary_tables(layers, seq):
    """The model's rotary cos and sin for `seq` bf16 positions, built now. One
    table serves every layer and outlives the backward pass, so the count leaves
    it out as it leaves out the parameters; built before a test watches, it is
    neither a storage the forward creates nor one it saves anew."""
    blocks = [layer for layer in layers if isinstance(layer, M.TransformerLayer)]
    tables = blocks[0].attention.rotary_tables
    assert all(block.attention.rotary_tables is tables for block in blocks)
    if blocks[0].config.rotary_dim == 0:
        return []
    return list(tables(seq, torch.device("cpu"), BF16))


def ln_stats_on_cpu(storages: dict[int, torch.Tensor], batch: int, seq: int):
    """The layer norms' mean and 1/σ among saved storages: `[B, T, 1]`, in bf16 on
    the CPU where CUDA has fp32. Returns the bytes the count has on top of them."""
    stats = [t for t in storages.values() if tuple(t.shape) == (batch, seq, 1)]
    assert all(t.dtype == BF16 for t in stats)
    return len(stats) * batch * seq * (A.FP32 - 2)


def saved_bytes(fn, *, exclude=()):
    """
    Run `fn` and return its result, the bytes of distinct storages that autograd
    saved (parameters in `exclude` and int64 / 0-dim tensors, the loss's targets
    and scalars, left out) and those storages by key.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, torch.Tensor] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip and t.dtype != torch.int64 and t.dim() > 0:
            storages[key] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    nbytes = sum(t.untyped_storage().nbytes() for t in storages.values())
    return out, nbytes, storages


class LiveStorages(TorchDispatchMode):
    """
    Weak references to the storages that operations allocate while active;
    `live()` sums those still alive, each once, and `peak` is the largest sum
    seen after any operation (inputs and outputs alive together; kernels'
    internal scratch is not seen). Int64 and 0-dim tensors are left out.
    """

    def __init__(self):
        super().__init__()
        self.refs = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: not new. So
        # `weight.t()` does not count the parameters.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype != torch.int64 and t.dim():
                storage = t.untyped_storage()
                if storage._cdata not in inputs:
                    self.refs[storage._cdata] = (storage_weak_ref(storage),
                                                 storage.nbytes())
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def storage_weak_ref(storage):
    # `StorageWeakRef` is what torch.multiprocessing and torch.fx use to tell a
    # freed storage (unchanged from PyTorch 1.x to 2.13); tensors' own weakrefs
    # would not do, since a saved view outlives the tensor it was taken from.
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(storage)


# ## One layer


@pytest.mark.parametrize("finetune", FINETUNES)
@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("batch,seq", SIZES)
@pytest.mark.parametrize("name", CONFIGS)
def test_layer_saves_what_the_count_says(name, batch, seq, input_requires_grad,
                                         finetune):
    config = CONFIGS[name]
    layer = model(config, finetune)[1]
    x = torch.randn(batch, seq, config.d_model, dtype=BF16,
                    requires_grad=input_requires_grad)
    exclude = list(layer.parameters()) + rotary_tables([layer], seq)
    _, nbytes, storages = saved_bytes(lambda: layer(x), exclude=exclude)
    expected = A.layer_activation_bytes(config, batch=batch, seq=seq,
                                        finetune=finetune,
                                        input_requires_grad=input_requires_grad)
    assert nbytes + ln_stats_on_cpu(storages, batch, seq) == expected


@pytest.mark.parametrize("targets", LORA_TARGETS, ids="+".join)
@pytest.mark.parametrize("rank", LORA_RANKS)
@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("name", CONFIGS)
def test_lora_layer_saves_what_the_count_says(name, input_requires_grad, rank,
                                              targets):
    """LoRA's rows: each target's input and each adapter's A x, against the
    storages autograd saves, at several ranks and target sets; the first layer
    (input without grad) saves only what its targets need."""
    config = CONFIGS[name]
    B, T = SIZES[1]
    layer = model(config, "lora", rank=rank, targets=targets)[1]
    x = torch.randn(B, T, config.d_model, dtype=BF16,
                    requires_grad=input_requires_grad)
    exclude = list(layer.parameters()) + rotary_tables([layer], T)
    _, nbytes, storages = saved_bytes(lambda: layer(x), exclude=exclude)
    # each adapter's A x, [B, T, r] (saved as its [B·T, r] view), is among them
    assert sum(tuple(t.shape) == (B * T, rank)
               for t in storages.values()) == len(targets)
    expected = A.layer_activation_bytes(config, batch=B, seq=T, finetune="lora",
                                        lora_rank=rank, lora_targets=targets,
                                        input_requires_grad=input_requires_grad)
    assert nbytes + ln_stats_on_cpu(storages, B, T) == expected


def test_layer_counts_by_finetuner():
    """The multiples of nd of the intro's table: 16, 14, 9; 8 and 9 for a first
    layer behind a frozen embedding; LoRA on all four projections 16 and 4nr."""
    config = M.tiny()
    B, T, d, n_h = 2, 32, config.d_model, config.n_heads
    n = B * T
    nd = n * d * 2
    small = 4 * n * A.FP32 + n_h * n * A.FP32  # + LN stats, lse

    def count(finetune, input_requires_grad=True):
        return A.layer_activation_bytes(config, batch=B, seq=T, finetune=finetune,
                                        input_requires_grad=input_requires_grad)

    assert count("all") == 16 * nd + small
    assert count("ffn") == 14 * nd + small
    assert count("biases") == 9 * nd + small
    assert count("biases", False) == 8 * nd + n_h * n * A.FP32
    assert count("ffn", False) == 9 * nd
    for r in LORA_RANKS:
        lora = A.layer_activation_bytes(config, batch=B, seq=T, finetune="lora",
                                        lora_rank=r)
        assert lora == 16 * nd + 4 * n * r * 2 + small
        one = A.layer_activation_bytes(config, batch=B, seq=T, finetune="lora",
                                       lora_rank=r, lora_targets=("dense",))
        assert one == count("biases") + nd + n * r * 2
    assert A.layer_activation_bytes(config, batch=B, seq=T, finetune="ffn",
                                    checkpointing=True) == nd


def test_gpt_neox_20b_bias_only_layer():
    """216 MiB of bf16 per layer at 16 × 128 tokens, and 544 KiB besides: LN
    statistics 4·2048·4 B, log-sum-exp 64·2048·4 B (the rotary tables are the
    model's, not the layer's). The notes say it of the benchmark's W3, which is
    that job."""
    job = bench_workloads()["W3"]
    assert (job.model, job.batch, job.seq, job.finetune) == (
        M.gpt_neox_20b(), 16, 128, "biases")
    config = M.gpt_neox_20b()
    per_layer = A.layer_activation_bytes(config, batch=16, seq=128,
                                         finetune="biases")
    n = 16 * 128
    assert per_layer == 216 * MiB + 4 * n * 4 + 64 * n * 4
    assert per_layer - 216 * MiB == 544 * 1024
    # the notes' parts: 32 KiB of LN statistics, 512 of log-sum-exp
    assert (4 * n * 4, 64 * n * 4) == (32 * 1024, 512 * 1024)


# ## Recomputation


@pytest.mark.parametrize("case", WHOLE, ids=whole_id)
def test_checkpointed_layer_keeps_its_input_and_recomputes_the_full_set(case):
    finetune, options = case
    config = CONFIGS["d72"]
    B, T = 2, 24
    layer = model(config, finetune, **lora_options(options))[1]
    rotary_tables([layer], T)
    x = torch.randn(B, T, config.d_model, dtype=BF16, requires_grad=True)
    x_ref = storage_weak_ref(x.untyped_storage())
    forward = LiveStorages()
    after_recompute = {}

    class Recompute(LiveStorages):
        def __exit__(self, *exc):
            # The recomputed forward has returned (its output dropped); what it
            # created and is still alive is what backward will read.
            after_recompute["sizes"] = [n for ref, n in recompute.refs.values()
                                        if not ref.expired()]
            return super().__exit__(*exc)

    recompute = Recompute()
    with forward:
        # early_stop=False: recompute the whole forward, so the context ends
        # after it; early stopping changes when it ends, not what is saved.
        out = checkpoint(layer, x, use_reentrant=False, early_stop=False,
                         context_fn=lambda: (nullcontext(), recompute))
    del x
    out_key = out.untyped_storage()._cdata
    kept = sum(n for key, (ref, n) in forward.refs.items()
               if not ref.expired() and key != out_key)
    # Nothing of the forward's own is kept, but the input is, by checkpoint.
    assert kept == 0
    assert not x_ref.expired()
    assert A.layer_activation_bytes(config, batch=B, seq=T, finetune=finetune,
                                    checkpointing=True,
                                    **options) == B * T * config.d_model * 2

    out.sum().backward()
    full = A.layer_activation_bytes(config, batch=B, seq=T, finetune=finetune,
                                    **options)
    input_bytes = B * T * config.d_model * 2
    # The four layer-norm statistics, [B, T, 1] bf16 on the CPU (no other
    # storage of this layer has B·T·2 bytes; LoRA's A x has B·T·r·2, r > 1)
    sizes = after_recompute["sizes"]
    assert sizes.count(B * T * 2) == 4
    cpu_stats = 4 * B * T * (A.FP32 - 2)
    assert sum(sizes) + cpu_stats == full - input_bytes


# ## Readout and loss


def lm_loss(logits, targets):
    """The benchmark's loss (`bench/engine.py`)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("finetune", FINETUNES)
def test_readout_and_loss_peaks(finetune):
    config = M.NeoXConfig(n_vocab=1000, d_model=64, n_heads=4, n_layers=1)
    B, T = 2, 24
    layers = model(config, finetune)
    norm, readout = layers[2], layers[3]
    x_last = torch.randn(B, T, config.d_model, dtype=BF16, requires_grad=True)
    batch = torch.randint(0, config.n_vocab, (B, T + 1))
    params = list(norm.parameters()) + list(readout.parameters())

    forward = LiveStorages()
    with forward:
        def run():
            logits = readout(norm(x_last))  # held, as the benchmark's step does
            return logits, lm_loss(logits, batch[:, 1:])

        (logits, loss), saved, storages = saved_bytes(run, exclude=params)
    count = A.readout_loss_bytes(config, batch=B, seq=T, finetune=finetune)
    n, V = B * T, config.n_vocab
    cpu_stats = ln_stats_on_cpu(storages, B, T)
    x_bytes = x_last.untyped_storage().nbytes()
    # Saved: x_L, the norm's statistics, the readout's input if it trains (the
    # count's `saved`), and the log-probabilities.
    assert saved + cpu_stats == count.saved + n * V * A.FP32
    # x_L was made outside the dispatch mode; it is alive throughout.
    assert forward.peak + x_bytes + cpu_stats == count.forward_peak
    assert count.logits == logits.untyped_storage().nbytes() == n * V * 2

    # What forward left: logits, log-probs, the norm's and readout's saved ones:
    # 6nV besides the count's `saved` (the fp32 copy of the logits is gone).
    left = forward.live()
    assert left + x_bytes + cpu_stats == count.saved + 6 * n * V
    backward = LiveStorages()
    with backward:
        loss.backward()
    # At the backward's peak two fp32 [n, V] gradients join them.
    assert backward.peak + left + x_bytes + cpu_stats == count.backward_peak


def test_readout_loss_options():
    config = M.NeoXConfig(n_vocab=1000, d_model=64, n_heads=4, n_layers=1)
    n, V, nd = 48, 1000, 48 * 64 * 2
    held = A.readout_loss_bytes(config, batch=2, seq=24, finetune="biases")
    let_go = A.readout_loss_bytes(config, batch=2, seq=24, finetune="biases",
                                  logits_held=False)
    assert held.backward_peak - let_go.backward_peak == n * V * 2
    assert let_go.forward_peak == held.forward_peak
    assert held.peak == held.backward_peak == held.saved + 14 * n * V
    assert held.forward_peak == held.saved + 10 * n * V
    recomputed = A.readout_loss_bytes(config, batch=2, seq=24, finetune="biases",
                                      checkpointing=True)
    assert recomputed.saved == 2 * nd


# ## The whole model


@pytest.mark.parametrize("case", WHOLE, ids=whole_id)
@pytest.mark.parametrize("name", ["d72", "d96_ff100"])
def test_whole_model_saves_layers_and_readout(name, case):
    """Every tensor saved by embedding, layers, final norm, readout and loss:
    the first layer's smaller set behind a frozen embedding included."""
    finetune, options = case
    config = CONFIGS[name]
    B, T = 3, 17
    layers = model(config, finetune, **lora_options(options))
    batch = torch.randint(0, config.n_vocab, (B, T + 1))
    params = [p for layer in layers for p in layer.parameters()]

    def run():
        x = batch[:, :-1]
        for layer in layers:
            x = layer(x)
        return lm_loss(x, batch[:, 1:])

    exclude = params + rotary_tables(layers, T)
    _, saved, storages = saved_bytes(run, exclude=exclude)
    count = A.activation_bytes(config, batch=B, seq=T, finetune=finetune,
                               **options)
    log_probs = B * T * config.n_vocab * A.FP32
    assert (saved + ln_stats_on_cpu(storages, B, T)
            == count.layers + count.readout_loss.saved + log_probs)
    assert count.total == count.layers + count.readout_loss.peak


@pytest.mark.parametrize("case", WHOLE, ids=whole_id)
def test_whole_model_checkpointed_keeps_inputs(case):
    """As labml_zero's engine runs it: every unit under `checkpoint`. After the
    loss, the layers' inputs, the final norm's and readout's inputs, the held
    logits and the log-probabilities are alive, nothing else."""
    finetune, options = case
    config = CONFIGS["d72"]
    B, T = 2, 24
    layers = model(config, finetune, **lora_options(options))
    rotary_tables(layers, T)
    batch = torch.randint(0, config.n_vocab, (B, T + 1))
    forward = LiveStorages()
    with forward:
        x = batch[:, :-1]
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False)
        logits = x
        loss = lm_loss(logits, batch[:, 1:])
    del x
    count = A.activation_bytes(config, batch=B, seq=T, finetune=finetune,
                               checkpointing=True, **options)
    n, nd = B * T, B * T * config.d_model * 2
    # (the 0-dim loss is not tracked)
    assert forward.live() == (config.n_layers * count.per_layer
                              + count.readout_loss.saved
                    + count.readout_loss.logits + n * config.n_vocab * A.FP32)
    full = A.layer_activation_bytes(config, batch=B, seq=T, finetune=finetune,
                                    **options)
    assert count.layers == config.n_layers * nd + full - nd
    loss.backward()


def test_bad_arguments():
    config = M.tiny()
    with pytest.raises(ValueError, match="LoRA rank"):
        A.layer_activation_bytes(config, batch=1, seq=8, finetune="lora",
                                 lora_rank=0)
    with pytest.raises(ValueError, match="unknown LoRA target"):
        A.activation_bytes(config, batch=1, seq=8, finetune="lora",
                           lora_targets=("embed_out",))
    with pytest.raises(ValueError, match="batch and seq"):
        A.activation_bytes(config, batch=0, seq=8, finetune="all")
    with pytest.raises(ValueError, match="max_position"):
        A.readout_loss_bytes(config, batch=1, seq=4096, finetune="all")


# ## The page's table


def workloads():
    return {
        "W1": (M.pythia_1_4b(), 8, 2048, "all", False),
        "W2": (M.pythia_6_9b(), 2, 2048, "all", False),
        "W3": (M.gpt_neox_20b(), 16, 128, "biases", False),
        "W4": (M.pythia_160m(), 16, 1024, "all", False),
        "W5": (M.gpt_neox_20b(), 4, 2048, "all", True),
    }


def test_page_table_matches_the_functions():
    """The table of `activation_bytes` as the site renders it (its figures are
    computed when the site is built): one row per benchmark job, with that job's
    model, size and fine-tuner, and the function's figures for it."""
    # the page's links to the workloads' definitions are not the table's business
    doc = SEE.sub(lambda m: m.group(1), A.activation_bytes.__doc__)
    page = Directives(REPO, {}).expand(doc, "neox/activation_memory.html")
    rows = re.findall(r"^\s*\| (W\d) \| (\w+) \| (\d+) × (\d+) \| ([^|]+?) \| "
                      r"([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      page, flags=re.MULTILINE)
    assert [row[0] for row in rows] == list(workloads())
    for name, preset, batch, seq, trains, *figures in rows:
        config, B, T, finetune, ckpt = workloads()[name]
        job = bench_workloads()[name]
        assert (job.model, job.batch, job.seq, job.finetune,
                job.activation_checkpointing) == (config, B, T, finetune, ckpt)
        assert getattr(M, preset)() == config
        assert (int(batch), int(seq)) == (B, T)
        assert trains == finetune + (", recomputed" if ckpt else "")
        a = A.activation_bytes(config, batch=B, seq=T, finetune=finetune,
                               checkpointing=ckpt)
        assert figures == [f"{a.per_layer / MiB:.2f}", f"{a.layers / GiB:.2f}",
                           f"{a.readout_loss.peak / GiB:.2f}",
                           f"{a.total / GiB:.2f}"], name


def test_figures_in_the_notes():
    """Note: the attention output is copied: one nd more, 64 MiB per layer on
    the benchmark's W1 (Pythia-1.4B at 8 x 2048); the loss's 14 nV is 10.75 GiB
    there, as much as 10.7 of its layers."""
    job = bench_workloads()["W1"]
    assert (job.model, job.batch, job.seq) == (M.pythia_1_4b(), 8, 2048)
    config, n = M.pythia_1_4b(), 8 * 2048
    assert n * config.d_model * 2 == 64 * MiB
    loss = 14 * n * config.n_vocab
    assert f"{loss / GiB:.2f}" == "10.75"
    layer = A.layer_activation_bytes(config, batch=8, seq=2048, finetune="all")
    assert f"{loss / layer:.1f}" == "10.7"


# ## With the fused kernels


@pytest.mark.parametrize("finetune", FINETUNES)
@pytest.mark.parametrize("rows", [16, 48, 1000])
def test_chunked_loss_keeps_its_two_gradients(finetune, rows):
    """The `loss` kernel: forward keeps $\\partial L / \\partial x$ (bf16) and
    $\\partial L / \\partial W$ (fp32, whether $W$ trains or not) besides the
    final norm's; no logits. Its backward makes both anew, scaled, and the
    weight's in bf16. (The forward's chunk work is the CUDA path's, compiled;
    on a CPU the chunk's loss runs eagerly and only these two are the same.)"""
    config = M.NeoXConfig(n_vocab=1000, d_model=64, n_heads=4, n_layers=1)
    kernels = M.ModelKernels(loss=True, loss_chunk_rows=rows)
    B, T = 2, 24
    torch.manual_seed(0)
    layers = M.build_layers(config, dtype=BF16, kernels=kernels)
    finetuner(finetune)(layers)
    norm, readout = layers[2], layers[3]
    x_last = torch.randn(B, T, config.d_model, dtype=BF16, requires_grad=True)
    targets = torch.randint(0, config.n_vocab, (B, T))
    params = list(norm.parameters()) + list(readout.parameters())
    forward = LiveStorages()
    with forward:
        loss, saved, storages = saved_bytes(
            lambda: readout(norm(x_last), targets), exclude=params)
    count = A.readout_loss_bytes(config, batch=B, seq=T, finetune=finetune,
                                 kernels=kernels)
    assert count == A.chunked_loss_bytes(config, batch=B, seq=T, chunk_rows=rows)
    cpu_stats = ln_stats_on_cpu(storages, B, T)
    x_bytes = x_last.untyped_storage().nbytes()
    n, d, V = B * T, config.d_model, config.n_vocab
    assert count.logits == 0
    # x_L, the statistics, and the Function's two gradients
    grads = [t for t in storages.values() if t.shape in ((n, d), (V, d))]
    assert {t.dtype for t in grads} == {BF16, torch.float32}
    assert sum(t.untyped_storage().nbytes() for t in grads) == 2 * n * d + 4 * V * d
    assert saved + cpu_stats == count.saved
    assert forward.live() + x_bytes + cpu_stats == count.saved
    backward = LiveStorages()
    with backward:
        loss.backward()
    assert (backward.peak + forward.live() + x_bytes + cpu_stats
            == count.backward_peak)


def test_chunked_loss_peaks_by_hand():
    """Pythia-1.4B's readout at the benchmark's W1 (8 × 2048 tokens, chunks of
    2048 rows): the forward's larger moment is the fp32 weight gradient's new
    copy beside the old; the plain loss holds 14nV at its peak."""
    config = M.pythia_1_4b()
    n, d, V = 8 * 2048, config.d_model, config.n_vocab
    nd, chunk, grad_w = 2 * n * d, 2 * 2048 * V, 4 * V * d
    fused = A.readout_loss_bytes(config, batch=8, seq=2048, finetune="all",
                                 kernels=M.ModelKernels(loss=True))
    norm = nd + 2 * n * A.FP32
    assert fused.forward_peak == norm + 2 * nd + 2 * chunk + 2 * grad_w
    assert fused.backward_peak == norm + 2 * nd + 2 * grad_w + 2 * V * d
    assert fused.peak == fused.forward_peak
    plain = A.readout_loss_bytes(config, batch=8, seq=2048, finetune="all")
    assert plain.peak == plain.saved + plain.logits + 3 * 4 * n * V


def test_fused_norms_save_one_pair_of_statistics():
    """`two_layer_norms` compiled (the CUDA path; here by the partitioner
    Inductor uses, on the CPU) saves x and one mean and 1/σ, `[B, T, 1]` fp32,
    for both norms: the layer's count is $2 \\cdot 4n$ bytes less than with
    the plain norms, which save a pair each."""
    from labml_zero.neox import kernels as K

    B, T, d = 2, 24, 64
    x = torch.randn(B, T, d, dtype=BF16, requires_grad=True)
    weights = [torch.randn(d, requires_grad=True) for _ in range(4)]
    fused = torch.compile(K.two_layer_norms, backend="aot_eager_decomp_partition")
    _, saved, storages = saved_bytes(lambda: fused(x, *weights, 1e-5),
                                     exclude=weights)
    stats = [t for t in storages.values() if tuple(t.shape) == (B, T, 1)]
    assert [t.dtype for t in stats] == [torch.float32] * 2
    assert saved == x.untyped_storage().nbytes() + 2 * B * T * A.FP32
    config = M.NeoXConfig(n_vocab=512, d_model=d, n_heads=4, n_layers=1)
    plain = A.layer_activation_bytes(config, batch=B, seq=T, finetune="all")
    norms = A.layer_activation_bytes(config, batch=B, seq=T, finetune="all",
                                     kernels=M.ModelKernels(norms=True))
    assert plain - norms == 2 * B * T * A.FP32


def test_whole_model_with_the_kernels():
    """The loss kernel changes only the last part; under recomputation the
    readout holds no logits beside the recomputed layer."""
    config = M.NeoXConfig(n_vocab=1000, d_model=64, n_heads=4, n_layers=3)
    kernels = M.ModelKernels(loss=True, norms=True, loss_chunk_rows=16)
    for checkpointing in (False, True):
        a = A.activation_bytes(config, batch=2, seq=24, finetune="all",
                               checkpointing=checkpointing, kernels=kernels)
        loss = A.chunked_loss_bytes(config, batch=2, seq=24, chunk_rows=16,
                                    checkpointing=checkpointing)
        assert a.readout_loss == loss
        layer = A.layer_activation_bytes(config, batch=2, seq=24, finetune="all",
                                         kernels=kernels)
        n, nd = 48, 48 * 64 * 2
        if checkpointing:
            assert a.total == 3 * nd + max(loss.peak, layer - nd)
        else:
            assert a.total == 3 * layer + loss.peak
