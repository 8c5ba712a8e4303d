"""`labml_zero/llama/lora.py`: adapters on a transformers snapshot of each
family; PEFT loads our adapter onto transformers' model with our logits, and
the merged export's logits are the same."""

import json

import pytest
import torch

from labml_zero.llama.hf_checkpoint import LlamaCheckpoint, load_layers
from labml_zero.llama.hf_export import hf_named_tensors
from labml_zero.llama.lora import (TARGETS, LlamaLoRA, base_layer,
                                   save_llama_adapter, save_merged_llama)
from labml_zero.llama.model import LlamaChain, build_layers
from labml_zero.neox.lora import LoRALinear
from tests import tolerance
from tests.llama.test_model import llama_terms


def adapted(path, lora: LlamaLoRA):
    """Our layers from the snapshot, with adapters whose B is drawn too (a
    zero B would make every comparison below trivially the base model's)."""
    checkpoint = LlamaCheckpoint(path)
    layers = build_layers(checkpoint.config)
    load_layers(checkpoint, layers)
    count = lora(layers)
    torch.manual_seed(7)
    with torch.no_grad():
        for layer in layers:
            for name, p in layer.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0.0, 0.15)
    return checkpoint.config, layers, count


def lora_terms(config, lora: LlamaLoRA, *, seq: int) -> int:
    """`llama_terms` plus, on each adapted projection's path, the reductions of
    A x over $d_{in}$ and of B (A x) over $r$ (at most $d_{ff} + r$ a
    projection, seven a layer)."""
    return llama_terms(config, seq=seq) + config.n_layers * len(lora.targets) * (
        max(config.d_ff, config.n_heads * config.head_width) + lora.rank)


@pytest.mark.parametrize("targets", [tuple(TARGETS), ("q_proj", "v_proj")])
def test_peft_loads_our_adapter_and_the_merged_export_agrees(hf_case, tmp_path,
                                                             targets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    case, _, path = hf_case
    lora = LlamaLoRA(rank=4, alpha=8.0, targets=targets)
    config, layers, _ = adapted(path, lora)
    ids = torch.randint(0, config.n_vocab, (2, 19),
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = LlamaChain(*layers)(ids)
        base = AutoModelForCausalLM.from_pretrained(path).eval()
        assert not torch.allclose(base(ids).logits, ours), "the adapter must matter"
    tol = tolerance.parity(torch.float32, terms=lora_terms(config, lora,
                                                           seq=ids.shape[1]))

    adapter = save_llama_adapter(tmp_path / "adapter", layers, lora)
    keys = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(keys["target_modules"]) == sorted(targets)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        theirs = peft_model(ids).logits
    torch.testing.assert_close(theirs, ours, **tol)

    out = save_merged_llama(tmp_path / "merged", config, hf_named_tensors(layers),
                            lora)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, ours, **tol)


def test_peft_names_every_adapter_it_loads(hf_case, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    _, _, path = hf_case
    lora = LlamaLoRA(rank=2, alpha=2.0)
    _, layers, _ = adapted(path, lora)
    adapter = save_llama_adapter(tmp_path / "a", layers, lora)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        ours = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in ours
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path), adapter)
    # PEFT's own keys of the adapters it created, in the file's spelling
    theirs = {k.replace(".default", "") for k, _ in peft_model.named_parameters()
              if "lora_" in k}
    assert ours == theirs


def test_counts_and_refusals(hf_case):
    _, _, path = hf_case
    lora = LlamaLoRA(rank=3)
    config, layers, count = adapted(path, lora)
    d, n_kv = config.d_model, config.n_kv_heads * config.head_width
    q = config.n_heads * config.head_width
    # r (d_in + d_out) for each of q, k, v, o, gate, up, down
    per_layer = lora.rank * (2 * (d + q) + 2 * (d + n_kv) + 3 * (d + config.d_ff))
    assert count.trainable == config.n_layers * per_layer
    assert isinstance(layers[1].mlp.down_proj, LoRALinear)
    assert set(base_layer(layers[1]).state_dict()) == set(
        build_layers(config, device="meta")[1].state_dict())
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        lora(layers)
    with pytest.raises(ValueError, match="unknown LoRA target 'dense'"):
        LlamaLoRA(targets=("dense",))
    with pytest.raises(ValueError, match="twice"):
        LlamaLoRA(targets=("q_proj", "q_proj"))
    with pytest.raises(ValueError, match="rank"):
        LlamaLoRA(rank=0)


def test_the_engines_initialiser_gives_adapters_peft_init():
    """`init_param` (GPT-NeoX's, through `LlamaLoRA`) runs in each chunk: A
    within 1/sqrt(d_in), B zero, every other parameter to the base init."""
    seen = []
    init = LlamaLoRA().init_param(lambda name, p: seen.append(name))
    a, b, w = torch.full((4, 64), 9.0), torch.ones(32, 4), torch.ones(32, 64)
    init("self_attn.q_proj.lora_A", a)
    init("self_attn.q_proj.lora_B", b)
    init("self_attn.q_proj.weight", w)
    assert 0 < a.abs().max() <= 64 ** -0.5 and not b.any()
    assert seen == ["self_attn.q_proj.weight"]
