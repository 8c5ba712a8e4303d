"""`labml_zero/neox/lora_export.py`: the merged Hugging Face checkpoint and the PEFT
adapter, written from a sharded model, load in transformers and peft with our
logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from labml_zero.neox import model as M
from labml_zero.neox.hf_checkpoint import HFCheckpoint
from labml_zero.neox.lora import FineTuneLoRA, load_hf_layer
from labml_zero.neox.lora_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPORT_MARKER,
                                         peft_adapter_config, peft_name,
                                         save_merged_checkpoint, save_peft_adapter,
                                         write_adapter_dir)
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from tests import tolerance
from tests.distributed import run_distributed

# ## From a sharded model to transformers and peft

LORA = FineTuneLoRA(rank=4, alpha=8)


def probe_ids(n_vocab: int) -> torch.Tensor:
    return torch.randint(0, n_vocab, (2, 11),
                         generator=torch.Generator().manual_seed(7))


def train_and_export(ctx, checkpoint_dir: str, out: str):
    """Load the checkpoint under LoRA, train a few fp32 steps, export both ways."""
    hf = HFCheckpoint(checkpoint_dir)
    layers = M.build_layers(hf.config, device="meta")
    LORA(layers)
    torch.manual_seed(0)
    sharded = zero3_layers(layers, device=ctx.device,
                           config=ZeroConfig(dtype=torch.float32, chunk_numel=3000),
                           init_param=LORA.init_param(lambda name, p: None))
    for layer in sharded:
        load_hf_layer(layer, hf)
    model = Zero3Sequential(sharded)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-2)
    ids = torch.randint(0, hf.config.n_vocab, (2 * ctx.world_size, 9),
                        generator=torch.Generator().manual_seed(1))
    mine = ids[2 * ctx.rank:2 * ctx.rank + 2]
    for _ in range(3):
        F.cross_entropy(model(mine[:, :-1]).flatten(0, 1),
                        mine[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = model(probe_ids(hf.config.n_vocab))
    adapter = save_peft_adapter(f"{out}/adapter", model, LORA, optimizer,
                                base_model_name_or_path=checkpoint_dir)
    merged_dir = save_merged_checkpoint(f"{out}/merged", model, LORA, hf.config,
                                        optimizer)
    return {"logits": logits, "adapter": adapter and str(adapter),
            "merged": merged_dir and str(merged_dir)}


@pytest.mark.distributed
def test_exports_load_in_transformers_and_peft(hf_checkpoint_dir, hf_model,
                                               tmp_path):
    from peft import PeftModel
    from transformers import GPTNeoXForCausalLM

    reports = run_distributed(train_and_export, 2, str(hf_checkpoint_dir),
                              str(tmp_path))
    assert reports[1]["adapter"] is None and reports[1]["merged"] is None
    ours = reports[0]["logits"]
    ids = probe_ids(hf_model.config.vocab_size)
    with torch.no_grad():
        base_logits = hf_model(ids).logits
    # three steps at a high rate moved the model away from the base
    assert (ours - base_logits).abs().max() > 1e-2

    adapter_dir = tmp_path / "adapter"
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPORT_MARKER]
    assert json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["r"] == 4
    base = GPTNeoXForCausalLM.from_pretrained(hf_checkpoint_dir)
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    # fp32 logits of two implementations; merged, each weight adds B A's sum
    # over the rank and one addition (tests/tolerance.py)
    close = tolerance.parity(torch.float32, terms=tolerance.neox_terms(
        HFCheckpoint(hf_checkpoint_dir).config, seq=ids.shape[1]) + LORA.rank + 1)
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, ours, **close)

    merged_model = GPTNeoXForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged_model(ids).logits, ours, **close)
    assert not any("lora" in n for n, _ in merged_model.named_parameters())


def test_an_adapter_of_some_layers_loads_on_those_only(hf_checkpoint_dir, tmp_path):
    from peft import PeftModel
    from transformers import GPTNeoXForCausalLM

    lora = FineTuneLoRA(rank=2, alpha=4, targets=("dense",))
    g = torch.Generator().manual_seed(0)
    d = HFCheckpoint(hf_checkpoint_dir).config.d_model
    tensors = {peft_name(f"gpt_neox.layers.{i}.attention.dense.{m}"):
               torch.randn(*shape, generator=g)
               for i in (0, 2) for m, shape in (("lora_A", (2, d)),
                                                ("lora_B", (d, 2)))}
    out = tmp_path / "adapter"
    write_adapter_dir(out, peft_adapter_config(lora, [2, 0], 3), tensors,
                      overwrite=False)
    with pytest.raises(FileExistsError, match="adapter directory exists"):
        write_adapter_dir(out, {}, tensors, overwrite=False)
    # replaced whole; no temporary or old directory is left beside it
    write_adapter_dir(out, peft_adapter_config(lora, [0, 2], 3), tensors,
                      overwrite=True)
    adapted = PeftModel.from_pretrained(
        GPTNeoXForCausalLM.from_pretrained(hf_checkpoint_dir), out)
    layers = adapted.base_model.model.gpt_neox.layers
    assert not hasattr(layers[1].attention.dense, "lora_A")
    for i in (0, 2):
        dense = layers[i].attention.dense
        torch.testing.assert_close(
            dense.lora_B["default"].weight,
            tensors[peft_name(f"gpt_neox.layers.{i}.attention.dense.lora_B")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
