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
