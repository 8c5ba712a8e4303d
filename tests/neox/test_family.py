"""`labml_zero/neox/family.py`: the job's path through the GPT-NeoX family,
from a snapshot transformers wrote to transformers' (and PEFT's) logits."""

import pytest
import torch
from torch import nn

from labml_zero.neox import config as neox_config
from labml_zero.neox.activation_memory import activation_bytes
from labml_zero.neox.family import NEOX
from labml_zero.neox.lora import FineTuneLoRA
from labml_zero.neox.tokenizer import BUNDLED_TOKENIZER, end_of_text_id
from tests import tolerance


def logits(layers, ids):
    with torch.no_grad():
        return nn.Sequential(*layers)(ids)


def probe(config, seq):
    return torch.randint(0, config.n_vocab, (1, seq),
                         generator=torch.Generator().manual_seed(3))


def test_the_jobs_path_through_the_family(hf_checkpoint_dir, hf_model):
    config = NEOX.check_snapshot(hf_checkpoint_dir)
    layers = NEOX.build(config, device="meta")
    NEOX.materialize(layers, "cpu")
    checkpoint = NEOX.open_checkpoint(hf_checkpoint_dir)
    for layer in layers:
        layer.load_state_dict(NEOX.load_layer(checkpoint, layer))
    ids = probe(config, 19)
    with torch.no_grad():
        want = hf_model(ids).logits
    torch.testing.assert_close(logits(layers, ids), want, **tolerance.parity(
        torch.float32, terms=tolerance.neox_terms(config, seq=ids.shape[1])))
    assert NEOX.count_parameters(layers) == sum(
        p.numel() for p in hf_model.parameters())


def test_materialize_initialises_as_the_build_does():
    # same seed, same draws: meta then materialize is the eager build's init
    config = neox_config.tiny()
    eager = NEOX.build(config)
    torch.manual_seed(5)
    for layer in eager:
        layer.reset_parameters()
    torch.manual_seed(5)
    meta = NEOX.build(config, device="meta")
    NEOX.materialize(meta, "cpu")
    for a, b in zip(eager, meta):
        for (name, s), t in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(s, t), name


def test_the_lora_path_and_both_exports(hf_checkpoint_dir, tmp_path):
    """Meta build, LoRA on every target, base weights loaded around the
    adapters, B moved off zero; the merged export in transformers and the
    adapter in PEFT give our logits."""
    from peft import PeftModel
    from transformers import GPTNeoXForCausalLM

    config = NEOX.check_snapshot(hf_checkpoint_dir)
    layers = NEOX.build(config, device="meta")
    lora = NEOX.finetuner("lora", rank=2, alpha=4.0, targets=NEOX.lora_targets)
    count = lora(layers)
    NEOX.materialize(layers, "cpu")
    checkpoint = NEOX.open_checkpoint(hf_checkpoint_dir)
    torch.manual_seed(11)
    for layer in layers:
        for name, p in layer.named_parameters():
            # PEFT's init, not what `to_empty` left: B zero, A within 1/sqrt(d_in)
            if name.endswith("lora_B"):
                assert not p.any()
            if name.endswith("lora_A"):
                assert 0 < p.abs().max() <= p.shape[1] ** -0.5
        missing, unexpected = layer.load_state_dict(
            NEOX.load_layer(checkpoint, layer), strict=False)
        assert not unexpected and all("lora_" in m for m in missing)
        for name, p in layer.named_parameters():
            assert p.requires_grad == ("lora_" in name)
            if name.endswith("lora_B"):
                with torch.no_grad():
                    p.normal_(0.0, 0.15)
    assert count.trainable == sum(p.numel() for layer in layers
                                  for p in layer.parameters() if p.requires_grad)
    ids = probe(config, 13)
    ours = logits(layers, ids)
    # each adapted projection adds B (A x)'s reductions over d_in and r
    terms = tolerance.neox_terms(config, seq=ids.shape[1]) + config.n_layers * len(
        lora.targets) * (max(config.ff_dim, config.d_model) + lora.rank)
    tol = tolerance.parity(torch.float32, terms=terms)
    merged = NEOX.save_merged(tmp_path / "merged", config,
                              NEOX.named_tensors(layers), lora)
    adapter = NEOX.save_adapter(tmp_path / "adapter", layers, lora)
    with torch.no_grad():
        torch.testing.assert_close(
            GPTNeoXForCausalLM.from_pretrained(merged)(ids).logits, ours, **tol)
        peft_model = PeftModel.from_pretrained(
            GPTNeoXForCausalLM.from_pretrained(hf_checkpoint_dir), adapter)
        torch.testing.assert_close(peft_model(ids).logits, ours, **tol)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        NEOX.save_adapter(tmp_path / "none", NEOX.build(config), lora)


def test_save_hf_round_trips_with_the_tokenizer(hf_checkpoint_dir, tmp_path):
    config = NEOX.check_snapshot(hf_checkpoint_dir)
    layers = NEOX.build(config)
    out = NEOX.save_hf(tmp_path / "out", config, NEOX.named_tensors(layers),
                       tokenizer=BUNDLED_TOKENIZER, snapshot=hf_checkpoint_dir)
    assert (out / "tokenizer.json").is_file()
    assert NEOX.check_snapshot(out) == config
    back = NEOX.build(config, device="meta")
    NEOX.materialize(back, "cpu")
    checkpoint = NEOX.open_checkpoint(out)
    for a, b in zip(layers, back):
        b.load_state_dict(NEOX.load_layer(checkpoint, b))
        for s, t in zip(a.state_dict().values(), b.state_dict().values()):
            assert torch.equal(s, t)


def test_config_json_both_ways_and_the_presets():
    assert NEOX.model_types == ("gpt_neox",)
    for name, preset in NEOX.presets.items():
        config = preset()
        hf = NEOX.write_config(config)
        assert hf["model_type"] in NEOX.model_types
        assert NEOX.read_config(hf) == config, name
    with pytest.raises(ValueError, match="model_type 'llama'"):
        NEOX.read_config({**NEOX.write_config(neox_config.tiny()),
                          "model_type": "llama"})


def test_the_tokenizer_is_the_snapshots_or_the_bundled_one(hf_checkpoint_dir,
                                                            tmp_path):
    tok, eot = NEOX.tokenizer(None, neox_config.tiny())
    assert eot == end_of_text_id(tok) == tok.token_to_id("<|endoftext|>")
    # a snapshot's own tokenizer.json wins: one of a single token
    from tokenizers import Tokenizer, models
    own = Tokenizer(models.WordLevel({"<|endoftext|>": 7}, unk_token=None))
    own.save(str(tmp_path / "tokenizer.json"))
    tok, eot = NEOX.tokenizer(tmp_path, neox_config.tiny())
    assert (tok.get_vocab_size(), eot) == (1, 7)


def test_flops_are_the_jobs_palm_count():
    # the job's figure for a whole model: every parameter but the embedding
    for preset in (neox_config.tiny, neox_config.pythia_160m):
        config = preset()
        psi = NEOX.count_parameters(NEOX.build(config, device="meta"))
        # 6 Psi_m for the weights' forward and backward, 12 L d T for attention
        want = (6 * (psi - config.n_vocab * config.d_model)
                + 12 * config.n_layers * config.d_model * 512)
        assert NEOX.flops_per_token(config, 512) == want


def test_activation_memory_is_the_activation_pages_total():
    config = neox_config.pythia_160m()
    for checkpointing in (False, True):
        assert NEOX.activation_memory(config, batch=2, seq=512, finetune="lora",
                                      checkpointing=checkpointing) == \
            activation_bytes(config, batch=2, seq=512, finetune="lora",
                             checkpointing=checkpointing).total


def test_beside_the_gradients_are_the_layers_and_the_held_logits():
    """What is alive while the layers' gradients are made: the layers' own
    (with recomputation their inputs and one layer recomputed) and the
    logits a plain loss holds, without the loss's peak."""
    config = neox_config.pythia_160m()
    for checkpointing in (False, True):
        for kernels in (None, NEOX.resolve_kernels("auto", "cuda")):
            count = activation_bytes(config, batch=2, seq=512, finetune="all",
                                     checkpointing=checkpointing, kernels=kernels)
            assert count.beside_gradients == (count.layers
                                              + count.readout_loss.logits)
            assert count.beside_gradients <= count.total
            assert NEOX.activation_memory(
                config, batch=2, seq=512, checkpointing=checkpointing,
                kernels=kernels, beside_gradients=True) == count.beside_gradients


def test_the_finetuners_by_name():
    assert isinstance(NEOX.finetuner("lora", rank=4), FineTuneLoRA)
    with pytest.raises(ValueError, match="unknown fine-tuner 'qkv'"):
        NEOX.finetuner("qkv")
    with pytest.raises(ValueError, match="takes no options, got rank"):
        NEOX.finetuner("biases", rank=4)
