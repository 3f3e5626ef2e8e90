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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small, barely trained model directory in the embedded model's format (seconds to build)."""
    from posttrain.models.tiny import TinySpec, build_tiny_model

    out = tmp_path_factory.mktemp("tiny-untrained")
    build_tiny_model(out, seed=0, spec=TinySpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                                intermediate_size=64, sft_max_steps=2, sft_eval_every=1000),
                     progress=False)
    return out


@pytest.fixture(scope="session")
def trained_tiny_model_dir():
    """The embedded tiny model itself (built once into the user cache, about 100 s)."""
    from posttrain.models import ensure_tiny_model

    return ensure_tiny_model()
