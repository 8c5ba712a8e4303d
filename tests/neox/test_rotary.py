"""The model's plain rotary path (`labml_zero/neox/model.py`): the angle tables
built once per model (`RotaryTables`) and q and k rotated in one pass, against
the formula that rotates each alone with angles recomputed in every layer.

Bit for bit: the joint pass computes each element with the same ops as the
rotation of each, so outputs and gradients are `torch.equal`, not close.
Launches are counted as the model's `plain_launches` counts them: every ATen op
that is not a view, on the meta device.
"""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.workloads import workloads
from labml_zero.neox import kernels as K
from labml_zero.neox import model as M
from labml_zero.neox import rotary
from labml_zero.neox.kernels import ModelKernels

DTYPES = [torch.float32, torch.bfloat16]
# d_h 16 with d_r 4, d_h 24 with d_r 6 (halves of 3), all rotated, none rotated
CONFIGS = {
    "d64": M.NeoXConfig(n_vocab=64, d_model=64, n_heads=4, n_layers=2),
    "d72_h3": M.NeoXConfig(n_vocab=64, d_model=72, n_heads=3, n_layers=2),
    "rot1": M.NeoXConfig(n_vocab=64, d_model=64, n_heads=4, n_layers=2,
                         rotary_pct=1.0),
    "rot0": M.NeoXConfig(n_vocab=64, d_model=64, n_heads=4, n_layers=2,
                         rotary_pct=0.0),
}


# ## The formula that rotates q and k apart


def reference_cos_sin(n_positions, config, device, dtype):
    """The tables as the model computed them before `RotaryTables`, written
    out here on purpose: a frozen oracle, so a change to `rotary_cos_sin`
    cannot pass by being compared with itself."""
    d_r = config.rotary_dim
    inv_freq = 1.0 / config.rotary_base ** (
        torch.arange(0, d_r, 2, device=device, dtype=torch.float32) / d_r)
    angles = torch.outer(torch.arange(n_positions, device=device,
                                      dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def reference_rotate(x, cos, sin):
    d_r = cos.shape[-1]
    x_rot, x_pass = x[..., :d_r], x[..., d_r:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    x_rot = x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([x_rot, x_pass], dim=-1)


def reference_split(qkv_out, config):
    """q, k, v of the fused QKV output `[B, T, 3d]`, split apart."""
    B, T, _ = qkv_out.shape
    n_h, d_h = config.n_heads, config.head_dim
    qkv = qkv_out.view(B, T, n_h, 3 * d_h).transpose(1, 2)  # [B, n_h, T, 3 d_h]
    return qkv.split(d_h, dim=-1)


def reference_rotate_each(q, k, config):
    """q and k, each rotated alone with angles computed here."""
    if config.rotary_dim == 0:
        return q, k
    cos, sin = reference_cos_sin(q.shape[-2], config, q.device, q.dtype)
    return reference_rotate(q, cos, sin), reference_rotate(k, cos, sin)


def reference_qk(qkv_out, config):
    q, k, _ = reference_split(qkv_out, config)
    return reference_rotate_each(q, k, config)


def reference_attention(attention, x):
    """`Attention.forward` with the reference rotation."""
    B, T, d = x.shape
    q, k, v = reference_split(attention.query_key_value(x), attention.config)
    v = v.contiguous()
    q, k = reference_rotate_each(q, k, attention.config)
    y = K.attention(q, k, v, attention.backend)
    return attention.dense(y.transpose(1, 2).reshape(B, T, d))


def model_qk(qkv_out, config, tables, rotate=M.rotary_joint_plain):
    """q and k as `Attention.forward` makes them."""
    B, T, _ = qkv_out.shape
    qkv = qkv_out.view(B, T, config.n_heads, 3, config.head_dim)
    qk, _ = qkv.split([2, 1], dim=3)
    qk = qk.permute(3, 0, 2, 1, 4)
    if config.rotary_dim == 0:
        return qk.unbind(0)
    return rotate(qk, config, tables)


def outputs_and_grads(fn, inputs, grads):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [t.grad for t in inputs]


def assert_equal_bits(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert torch.equal(g, w), (i, (g.double() - w.double()).abs().max())


# ## Bit for bit


@pytest.mark.parametrize("T", [13, 64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_joint_rotation_is_the_rotation_of_each(name, dtype, T):
    """q and k from the QKV output, forward and backward."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    qkv_out = torch.randn(2, T, 3 * config.d_model, dtype=dtype)
    shape = (2, config.n_heads, T, config.head_dim)
    grads = [torch.randn(shape, dtype=dtype) for _ in range(2)]
    tables = M.RotaryTables(config)
    got = outputs_and_grads(lambda t: model_qk(t, config, tables), [qkv_out],
                            grads)
    want = outputs_and_grads(lambda t: reference_qk(t, config), [qkv_out], grads)
    assert_equal_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_attention_is_the_attention_with_each_rotated(name, dtype):
    """The whole attention block, its input's and parameters' gradients too."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    attention = M.Attention(config, dtype=dtype)
    x = torch.randn(2, 17, config.d_model, dtype=dtype)
    grad = torch.randn(2, 17, config.d_model, dtype=dtype)
    results = []
    for forward in (M.Attention.forward, reference_attention):
        attention.zero_grad(set_to_none=True)
        got = outputs_and_grads(lambda x: forward(attention, x), [x], [grad])
        results.append(got + [p.grad for p in attention.parameters()])
    assert_equal_bits(*results)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_plain_twin_is_the_rotation_of_each(dtype):
    """The twin with q and k given apart (as the kernel tests and the bench
    call it), with its own angles or the model's tables."""
    config = CONFIGS["d72_h3"]
    torch.manual_seed(0)
    qkv_out = torch.randn(2, 11, 3 * config.d_model, dtype=dtype)
    q, k, _ = reference_split(qkv_out, config)  # strided views
    grads = [torch.randn(q.shape, dtype=dtype) for _ in range(2)]
    cos, sin = reference_cos_sin(11, config, q.device, dtype)
    want = outputs_and_grads(lambda q, k: (reference_rotate(q, cos, sin),
                                           reference_rotate(k, cos, sin)),
                             [q, k], grads)
    for tables in (None, M.RotaryTables(config)):
        got = outputs_and_grads(lambda q, k: M.rotary_plain(q, k, config, tables),
                                [q, k], grads)
        assert_equal_bits(got, want)


def test_layouts_attention_receives():
    """Plain and fused alike: q and k contiguous, the two halves of one tensor
    (the layout the attention output inherits)."""
    config = CONFIGS["d64"]
    qkv_out = torch.randn(2, 9, 3 * config.d_model)
    for rotate in (M.rotary_joint_plain, M.rotary_joint_fused):
        q, k = model_qk(qkv_out, config, M.RotaryTables(config), rotate)
        assert q.is_contiguous() and k.is_contiguous()
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        assert k.storage_offset() == q.numel()


def test_model_with_fused_rotary_still_matches_plain():
    config = CONFIGS["d72_h3"]
    torch.manual_seed(0)
    plain = M.build_layers(config)
    fused = M.build_layers(config, kernels=ModelKernels(rotary=True))
    for a, b in zip(plain, fused):
        b.load_state_dict(a.state_dict())
    ids = torch.randint(0, config.n_vocab, (2, 10))
    with torch.no_grad():
        assert torch.equal(M.NeoXChain(*plain)(ids), M.NeoXChain(*fused)(ids))


# ## Launches


class CountOps(TorchDispatchMode):
    """Non-view ATen ops, as `kernels.forward_launches` counts them."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in K.VIEW_OPS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def forward_backward_ops(fn, inputs, grads):
    """Ops of `fn(*inputs)`, then of its backward with `grads`; fresh leaves,
    so no gradient is accumulated into an earlier one."""
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    with CountOps() as forward:
        outs = fn(*inputs)
    with CountOps() as backward:
        torch.autograd.backward(list(outs), grads)
    return forward.ops, backward.ops


def test_rotation_launches():
    """Rotating q and k of one layer: the angles once per model, one launch per
    op for q and k together, forward and backward (meta device, Pythia-160M's
    shapes). Per rotated tensor the backward runs 2 `mul`, a `neg`, the `cat`
    of the halves' gradients, 2 `add` and 2 `slice_backward`; both ways
    add the QKV split's `cat` and the zeros of v's missing gradient."""
    config = M.pythia_160m()
    meta = dict(device="meta", dtype=torch.bfloat16)
    qkv_out = torch.empty(1, 16, 3 * config.d_model, **meta)
    shape = (1, config.n_heads, 16, config.head_dim)
    grads = [torch.empty(shape, **meta) for _ in range(2)]
    # Apart: the angles (12), then per tensor 2 mul, neg, 2 cat, add; the
    # backward's gradient of `[B, n_h, T, 3 d_h]` needs a copy to be the
    # linear's `[B, T, 3d]`.
    assert forward_backward_ops(lambda t: reference_qk(t, config), [qkv_out],
                                grads) == (12 + 2 * 6, 2 * 8 + 2 + 1)
    tables = M.RotaryTables(config)
    # Together: the first layer builds the table, every later one reads it; the
    # backward stacks the two gradients that attention returns apart.
    joint_backward = 8 + 2 + 1
    assert forward_backward_ops(lambda t: model_qk(t, config, tables), [qkv_out],
                                grads) == (12 + 6, joint_backward)
    assert forward_backward_ops(lambda t: model_qk(t, config, tables), [qkv_out],
                                grads) == (6, joint_backward)
    # the figures the kernels page prints
    assert M.plain_launches("rotary", config) == 6
    assert M.plain_launches("rotary_tables", config) == 12


def test_layer_launches(monkeypatch):
    """One transformer layer's forward and backward on the meta device, in the
    steady state (its tables built by an earlier layer), against the layer
    rotating q and k apart: 18 forward ops fewer (the angles' 12, 6 of the
    rotation's) and 8 backward. (On meta the attention runs PyTorch's math
    composite, so the totals are not CUDA's; the differences are the
    rotation's.)"""
    config = M.pythia_160m()
    meta = dict(device="meta", dtype=torch.bfloat16)
    layer = M.TransformerLayer(config, 0, **meta)
    x = torch.empty(1, 16, config.d_model, **meta)
    grad = torch.empty(1, 16, config.d_model, **meta)
    layer.attention.rotary_tables(16, x.device, x.dtype)
    new = forward_backward_ops(lambda x: [layer(x)], [x], [grad])
    layer.zero_grad(set_to_none=True)  # no accumulation into .grad either
    monkeypatch.setattr(M.Attention, "forward", reference_attention)
    apart = forward_backward_ops(lambda x: [layer(x)], [x], [grad])
    assert apart[0] - new[0] == 12 + 6
    assert apart[1] - new[1] == 8
    assert new == (33, 38)


# ## The tables


def count_builds(monkeypatch):
    built = []
    compute = M.rotary_cos_sin

    def counting(*args, **kwargs):
        built.append(args[0])
        return compute(*args, **kwargs)

    # patched where `RotaryTables` looks it up: the rotary page's module
    monkeypatch.setattr(rotary, "rotary_cos_sin", counting)
    return built


def test_build_layers_shares_one_table(monkeypatch):
    config = dataclasses.replace(CONFIGS["d64"], n_layers=3)
    layers = M.build_layers(config)
    tables = {id(layer.attention.rotary_tables) for layer in layers
              if isinstance(layer, M.TransformerLayer)}
    assert len(tables) == 1
    built = count_builds(monkeypatch)
    ids = torch.randint(0, config.n_vocab, (2, 10))
    for _ in range(2):
        M.NeoXChain(*layers)(ids).sum().backward()
    assert built == [10]  # once for three layers and two steps
    assert layers[1].attention.rotary_tables.keys() == [
        (10, torch.device("cpu"), torch.float32)]


def test_layer_built_alone_has_its_own_table():
    config = CONFIGS["d64"]
    a, b = M.TransformerLayer(config, 0), M.TransformerLayer(config, 1)
    assert a.attention.rotary_tables is not b.attention.rotary_tables
    x = torch.randn(1, 5, config.d_model)
    a(x)
    assert len(a.attention.rotary_tables.keys()) == 1
    assert b.attention.rotary_tables.keys() == []


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
def test_table_first_built_without_grad_trains_later(context):
    """`generate.py` may be the first to run a model (under `no_grad`, or a
    caller's `inference_mode`); a training step then saves the same table."""
    config = CONFIGS["d64"]
    torch.manual_seed(0)
    layers = M.build_layers(config)
    ids = torch.randint(0, config.n_vocab, (1, 8))
    with context():
        M.NeoXChain(*layers)(ids)
    (key,) = layers[1].attention.rotary_tables.keys()
    cos, sin = layers[1].attention.rotary_tables(*key)
    assert not cos.is_inference() and not sin.is_inference()
    assert not cos.requires_grad and cos.grad_fn is None
    loss = M.NeoXChain(*layers)(ids, ids)
    loss.backward()
    assert layers[1].attention.query_key_value.weight.grad is not None


def test_meta_model_then_real():
    """The engine builds on meta: a meta forward gets meta tables, and the
    materialised layers real ones beside them."""
    config = CONFIGS["d64"]
    layers = M.build_layers(config, device="meta")
    ids = torch.zeros(1, 6, dtype=torch.long)
    assert M.NeoXChain(*layers)(ids.to("meta")).device.type == "meta"
    for layer in layers:
        layer.to_empty(device="cpu")
        layer.reset_parameters()
    out = M.NeoXChain(*layers)(ids)
    assert torch.isfinite(out).all()
    assert layers[1].attention.rotary_tables.keys() == [
        (6, torch.device("meta"), torch.float32),
        (6, torch.device("cpu"), torch.float32)]


def test_entries_per_device_and_dtype_and_only_the_latest_kept():
    config = CONFIGS["d64"]
    tables = M.RotaryTables(config, max_entries=2)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    fp32 = tables(8, cpu, torch.float32)
    bf16 = tables(8, cpu, torch.bfloat16)
    assert [t.dtype for t in fp32 + bf16] == [torch.float32] * 2 + [torch.bfloat16] * 2
    # the cast of the fp32 angles, not angles computed in bf16
    for got, want in zip(bf16, reference_cos_sin(8, config, cpu, torch.bfloat16)):
        assert torch.equal(got, want)
    assert tables(8, "cpu", torch.float32) is fp32  # read again: now the latest
    tables(8, meta, torch.float32)
    assert tables.keys() == [(8, cpu, torch.float32), (8, meta, torch.float32)]
    tables(9, cpu, torch.float32)
    assert tables.keys() == [(8, meta, torch.float32), (9, cpu, torch.float32)]


def graph_ops(layer, x) -> tuple[set[str], list]:
    """The ops of the graph Dynamo captures for `layer(x)`, in one graph, and
    the output."""
    ops = set()

    def backend(gm, example_inputs):
        ops.update(str(node.target) for node in gm.graph.nodes
                   if node.op in ("call_function", "call_method"))
        return gm.forward

    torch._dynamo.reset()
    return ops, torch.compile(layer, backend=backend, fullgraph=True)(x)


def test_compiled_layers_read_the_tables():
    """With an entry in the dict, a compiled layer reads its tables: no cosine
    or sine in the graph, the same output as eager, the entry reused."""
    config = CONFIGS["d64"]
    torch.manual_seed(0)
    layer = M.build_layers(config)[1]
    x = torch.randn(2, 12, config.d_model)
    want = layer(x)
    entry = layer.attention.rotary_tables(12, x.device, x.dtype)
    ops, got = graph_ops(layer, x)
    assert not any("cos" in op or "sin" in op for op in ops)
    assert torch.equal(got, want)
    assert layer.attention.rotary_tables(12, x.device, x.dtype) is entry


def test_a_miss_while_compiling_stores_nothing():
    """A miss under compilation computes the tables in the graph and leaves
    the dict as it was, so the next trace is the same graph."""
    config = CONFIGS["d64"]
    torch.manual_seed(0)
    layer = M.build_layers(config)[1]
    x = torch.randn(2, 12, config.d_model)
    want = layer(x)
    tables = layer.attention.rotary_tables
    tables._tables.clear()
    ops, got = graph_ops(layer.forward, x)  # the forward alone: no pre-hook
    assert any("cos" in op for op in ops)
    assert torch.equal(got, want)
    assert tables.keys() == []


@pytest.mark.parametrize("autocast", [False, True])
def test_a_compiled_forward_finds_its_entry_made(autocast):
    """`compile_layers` compiles a layer's forward; its pre-hook makes the
    entry first, in the dtype of the QKV product, so the graph reads it."""
    config = CONFIGS["d64"]
    torch.manual_seed(0)
    layer = M.build_layers(config)[1]
    layer.attention.rotary_tables._tables.clear()
    x = torch.randn(2, 12, config.d_model)
    ops = set()

    def backend(gm, example_inputs):
        ops.update(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    layer.forward = torch.compile(layer.forward, backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        layer(x)
    dtype = torch.bfloat16 if autocast else torch.float32
    assert layer.attention.rotary_tables.keys() == [(12, torch.device("cpu"), dtype)]
    assert not any("cos" in op or "sin" in op for op in ops)


def test_table_bytes_are_the_tensors_bytes():
    """The note's figure: on W4 (Pythia-160M, 1024 positions, bf16) one entry is
    64 KiB for all 12 layers."""
    config = M.pythia_160m()
    seq = workloads()["W4"].seq
    cos, sin = M.RotaryTables(config)(seq, torch.device("meta"), torch.bfloat16)
    assert cos.nbytes + sin.nbytes == M.rotary_table_bytes(config, seq)
    assert (seq, config.n_layers) == (1024, 12)
    assert M.rotary_table_bytes(config, seq) == 64 * 2**10
