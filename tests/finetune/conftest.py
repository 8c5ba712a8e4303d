"""The fine-tune's tests share the GPT-NeoX tests' fixtures: the tiny random
Hugging Face model, its safetensors checkpoint and the bundled tokenizer."""

from tests.neox.conftest import hf_checkpoint_dir, hf_model, tokenizer  # noqa: F401
