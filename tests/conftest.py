import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def random_qwen2():
    """A randomly initialised 2-layer Qwen2 with a 40-token vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )
    return Qwen2ForCausalLM(cfg).eval()
