"""Fixtures for the GPT-NeoX tests: a tiny random Hugging Face model and its
sharded safetensors checkpoint, and the bundled tokenizer."""

import pytest
import torch

from labml_zero.neox.tokenizer import load_tokenizer


def tiny_hf_config():
    """Odd sizes on purpose: vocab 97, 3 heads of 24 (6 rotary dims), d_ff 100."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=97, hidden_size=72, num_hidden_layers=3,
                         num_attention_heads=3, intermediate_size=100,
                         rotary_pct=0.25, rotary_emb_base=10000,
                         use_parallel_residual=True, max_position_embeddings=64,
                         hidden_act="gelu", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def hf_model():
    """`GPTNeoXForCausalLM` in fp32 with every parameter, biases and layer norms
    included, drawn at a scale that makes each branch matter (HF's own init
    leaves biases zero and norms one, which would hide a swapped bias)."""
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(1234)
    model = GPTNeoXForCausalLM(tiny_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight")
                        else 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint_dir(hf_model, tmp_path_factory):
    """`save_pretrained` with small shards, so the index path is exercised."""
    path = tmp_path_factory.mktemp("hf") / "tiny-neox"
    hf_model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
    return path


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()
