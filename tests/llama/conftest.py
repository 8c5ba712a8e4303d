"""Fixtures for the Llama-family tests: tiny random checkpoints that transformers
writes for each architecture, tied and untied."""

import pytest
import torch

# Odd sizes on purpose: vocab 97, 6 query heads of 8 over 2 key-value heads,
# d_ff 100, 3 layers. Llama's case uses Llama 3's rotary scaling with a short
# pretraining context, so every branch of the scaling is taken.
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=100,
              num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=False, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32})),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(tie_word_embeddings=False, sliding_window=48)),
}


def hf_model(case: str):
    """transformers' model in fp32 with every parameter drawn at a scale that
    makes each branch matter (norm weights away from one, biases non-zero)."""
    import transformers

    config_class, model_class, extra = CASES[case]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(1234)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="session", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    """`(case, model, directory)`: the model saved by `save_pretrained` in
    small shards, so the index path is exercised."""
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp("hf") / request.param
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    return request.param, model, path
