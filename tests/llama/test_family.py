"""`labml_zero/llama/family.py`: the job's path through the family object, from
a snapshot transformers wrote to transformers' logits."""

import torch

from labml_zero.llama.family import LLAMA
from labml_zero.llama.model import LlamaChain
from tests import tolerance
from tests.llama.test_model import llama_terms


def test_the_jobs_path_through_the_family(hf_case):
    case, model, path = hf_case
    config = LLAMA.check_snapshot(path)
    layers = LLAMA.build(config, device="meta")
    LLAMA.materialize(layers, "cpu")
    # materialising kept the tie that `to_empty` breaks
    tied = layers[0].embed_tokens.weight is layers[-1].lm_head.weight
    assert tied == config.tie_embeddings
    checkpoint = LLAMA.open_checkpoint(path)
    for layer in layers:
        layer.load_state_dict(LLAMA.load_layer(checkpoint, layer))
    ids = torch.randint(0, config.n_vocab, (1, 17),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = LlamaChain(*layers)(ids)
    torch.testing.assert_close(ours, model(ids).logits, **tolerance.parity(
        torch.float32, terms=llama_terms(config, seq=ids.shape[1])))
    assert LLAMA.count_parameters(layers) == sum(p.numel() for p in model.parameters())


def test_the_jobs_lora_path_and_exports_through_the_family(hf_case, tmp_path):
    """Meta build, LoRA on the family's targets, base weights loaded around the
    adapters, then both exports: PEFT and transformers agree with our logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.llama.test_lora import lora_terms

    case, _, path = hf_case
    config = LLAMA.check_snapshot(path)
    layers = LLAMA.build(config, device="meta")
    lora = LLAMA.finetuner("lora", rank=2, alpha=4.0, targets=LLAMA.lora_targets)
    count = lora(layers)
    LLAMA.materialize(layers, "cpu")
    # PEFT's init, not what `to_empty` left: A within 1/sqrt(d_in), B zero
    for layer in layers:
        for module in layer.modules():
            if hasattr(module, "lora_A"):
                bound = module.in_features ** -0.5
                assert 0 < module.lora_A.abs().max() <= bound
                assert not module.lora_B.any()
    checkpoint = LLAMA.open_checkpoint(path)
    torch.manual_seed(11)
    for layer in layers:
        missing, unexpected = layer.load_state_dict(
            LLAMA.load_layer(checkpoint, layer), strict=False)
        assert not unexpected and all("lora_" in m for m in missing)
        for name, p in layer.named_parameters():
            assert p.requires_grad == ("lora_" in name)
            if name.endswith("lora_B"):
                with torch.no_grad():
                    p.normal_(0.0, 0.15)
    assert count.trainable == sum(p.numel() for layer in layers
                                  for p in layer.parameters() if p.requires_grad)
    ids = torch.randint(0, config.n_vocab, (1, 13),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = LlamaChain(*layers)(ids)
    tol = tolerance.parity(torch.float32,
                           terms=lora_terms(config, lora, seq=ids.shape[1]))
    merged = LLAMA.save_merged(tmp_path / "merged", config,
                               LLAMA.named_tensors(layers), lora)
    adapter = LLAMA.save_adapter(tmp_path / "adapter", layers, lora)
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(merged)(ids).logits, ours, **tol)
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(path), adapter)
        torch.testing.assert_close(peft_model(ids).logits, ours, **tol)


def test_the_familys_full_fine_tune_saves_what_it_loaded(hf_case, tmp_path):
    import pytest

    from labml_zero.llama.hf_checkpoint import load_layers

    _, _, path = hf_case
    config = LLAMA.check_snapshot(path)
    layers = LLAMA.build(config)
    load_layers(LLAMA.open_checkpoint(path), layers)
    LLAMA.finetuner("all")(layers)
    out = LLAMA.save_hf(tmp_path / "out", config, LLAMA.named_tensors(layers))
    back = LLAMA.build(config)
    load_layers(LLAMA.open_checkpoint(out), back)
    for x, y in zip(layers, back):
        for s, t in zip(x.state_dict().values(), y.state_dict().values()):
            assert torch.equal(s, t)
    with pytest.raises(ValueError, match="unknown fine-tuner 'ffn'"):
        LLAMA.finetuner("ffn")
    with pytest.raises(ValueError, match="takes no options, got rank"):
        LLAMA.finetuner("all", rank=4)
