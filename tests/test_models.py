import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from posttrain.errors import ModelError
from posttrain.models import check_model_dir, ensure_tiny_model, load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_tiny_model

SMALL = TinySpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                 sft_max_steps=3, sft_eval_every=1000)


def test_tokenizer_reloads_through_autotokenizer_as_bytes(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))  # config.json says qwen2
    text = "Hello  world\n\ttabs, spaces  and é ünïcode 12+34="
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # one token per byte, none lost
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.encode("7<|im_end|>", add_special_tokens=False) == [ord("7"), tok.eos_token_id]


def test_chat_template(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "23+45="}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\n23+45=<|im_end|>\n<|im_start|>assistant\n"


def test_loader_errors(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="not a directory"):
        check_model_dir(tmp_path / "file")
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(ModelError, match="config.json"):
        check_model_dir(d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (d / "pytorch_model.bin").write_text("pickle")
    with pytest.raises(ModelError, match="safetensors"):
        check_model_dir(d)
    (d / "model.safetensors").write_text("x")
    with pytest.raises(ModelError, match="tokenizer"):
        check_model_dir(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError, match="cannot load the model"):
        load_model(d)


def test_build_is_deterministic_by_seed_and_loads_back(tmp_path):
    metas = [build_tiny_model(tmp_path / name, seed=seed, spec=SMALL, progress=False)
             for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert metas[0]["sft_steps"] == 3
    model, tok = load_model(tmp_path / "a"), load_tokenizer(tmp_path / "a")
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_ensure_reuses_the_cache(tmp_path, monkeypatch):
    calls = []
    import posttrain.models.tiny as tiny

    real = tiny.build_tiny_model
    monkeypatch.setattr(tiny, "build_tiny_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = ensure_tiny_model(cache_dir=tmp_path, spec=SMALL, progress=False)
    second = ensure_tiny_model(cache_dir=tmp_path, spec=SMALL, progress=False)
    assert first == second and len(calls) == 1
    assert (first / "posttrain_tiny.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # built aside, renamed into place


@pytest.mark.slow
def test_default_model_starts_competent_but_imperfect(trained_tiny_model_dir):
    meta = json.loads((trained_tiny_model_dir / "posttrain_tiny.json").read_text())
    assert 0.3 <= meta["dev_accuracy"] <= 0.75
    assert 0.15 <= meta["test_accuracy"] <= 0.75
