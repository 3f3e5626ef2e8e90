import json
from pathlib import Path
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from posttrain.errors import ModelError
from posttrain.files.cache import directory_digest
from posttrain.models import check_model_dir, load_model, load_tokenizer, shipped
from posttrain.tiny import arith
from posttrain.tiny.arith import TinySpec, build_tiny_model, ensure_tiny_model

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


def test_a_padded_vocabulary_keeps_the_byte_ids_and_decodes_every_padding_id(tmp_path):
    """write_tokenizer(vocab_size=...) for a model of a real vocabulary: text
    encodes as before, the special tokens come last, and every id decodes."""
    from posttrain.models.tokenizer import write_tokenizer

    write_tokenizer(tmp_path, vocab_size=70_000)  # past the 65,536 two-symbol tokens: three-symbol ones too
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # reloaded the Qwen2 way
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 70_000
    assert tok.eos_token_id == 69_999 and tok.pad_token_id == 69_997
    text = "ab 12+34=\n é"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    # id 256: bytes (0, 0) as GPT-2 symbols; id 69,996: triple 69,996 - 256 - 65,536 = 4,204 = (0, 16, 108)
    assert tok.convert_ids_to_tokens([256, 69_996]) == ["ĀĀ", "ĀĐl"]
    assert tok.decode([256, 300, 69_000]) != ""


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
    real = arith.build_tiny_model
    monkeypatch.setattr(arith, "build_tiny_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = ensure_tiny_model(cache_dir=tmp_path, spec=SMALL, progress=False)
    second = ensure_tiny_model(cache_dir=tmp_path, spec=SMALL, progress=False)
    assert first == second and len(calls) == 1
    assert (first / "posttrain_tiny.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # built aside, renamed into place


# The shipped weights, recorded here as well as in shipped.EMBEDDED_DIGEST: replacing them is a
# deliberate change of both, with the README's sample output run anew.
SHIPPED_WEIGHTS_SHA256 = "19893b85c28171073712ba209d5439027514594d65814b20a7e25ed05dcb0ed2"


def test_the_shipped_model_is_the_recorded_bytes(monkeypatch):
    import hashlib

    monkeypatch.setattr(arith, "build_tiny_model", lambda *a, **k: pytest.fail("the default must not be built"))
    path = ensure_tiny_model()
    assert path == shipped.EMBEDDED_DIR
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == SHIPPED_WEIGHTS_SHA256
    assert directory_digest(path) == shipped.EMBEDDED_DIGEST
    meta = json.loads((path / "posttrain_tiny.json").read_text())
    assert (meta["version"], meta["seed"], meta["spec"]) == (arith.VERSION, 0, asdict(TinySpec()))
    assert 0.3 <= meta["dev_accuracy"] <= 0.75 and 0.15 <= meta["test_accuracy"] <= 0.75  # competent, imperfect
    model = load_model(path)
    assert sum(p.numel() for p in model.parameters()) == meta["parameters"]


def test_a_changed_shipped_file_is_refused_with_the_fix(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "embedded"
    shutil.copytree(shipped.EMBEDDED_DIR, copy)
    monkeypatch.setattr(shipped, "EMBEDDED_DIR", copy)
    assert ensure_tiny_model() == copy
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one bit of one weight
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModelError, match="not the ones posttrain shipped.*reinstall posttrain.*--rebuild"):
        ensure_tiny_model()
    shutil.rmtree(copy)
    with pytest.raises(ModelError, match="directory .* is missing; reinstall posttrain"):
        ensure_tiny_model()


def test_tiny_model_copies_the_shipped_model(tmp_path, capsys):
    from posttrain.cli import main

    assert main(["tiny-model", "--output", str(tmp_path / "m")]) == 0
    assert directory_digest(tmp_path / "m") == shipped.EMBEDDED_DIGEST
    assert main(["tiny-model", "--output", str(tmp_path / "m")]) == 2
    assert "is not empty" in capsys.readouterr().err


def weights_sha(model_dir: Path) -> str:
    import hashlib

    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()


def rebuild_says(said: str, out: Path) -> str:
    """The rebuild's verdict, checked to be the one its weights call for: "same" or "other"."""
    assert said.rstrip().endswith(f"Its digest: {directory_digest(out)}")
    same = "; the same weights as the shipped model (seed 0" in said
    other = "; other weights than the shipped model (seed 0" in said
    assert same != other, said
    return "same" if same else "other"


@pytest.mark.parametrize("task", ["arith", "tools", "games", "vision"])
@pytest.mark.parametrize("weights", ["same", "other"])
def test_rebuild_says_whether_its_weights_are_the_shipped_ones(tmp_path, capsys, monkeypatch, task, weights):
    """`posttrain tiny-model --rebuild`'s last line, with the build replaced by a copy of the shipped model,
    its weights as shipped or with one number changed: the verdict follows the weights."""
    import shutil

    from safetensors.torch import save_file

    from posttrain.cli import main
    from posttrain.tiny import games as tiny_games, tools as tiny_tools, vision_model as tiny_vision

    shipped_dir = {"arith": shipped.EMBEDDED_DIR, "tools": shipped.TOOLS_DIR, "games": shipped.GAMES_DIR,
                   "vision": shipped.VISION_DIR}[task]

    def build(out, seed=0, **_):
        shutil.copytree(shipped_dir, out, dirs_exist_ok=True)
        if weights == "other":
            state = load_file(Path(out) / "model.safetensors")
            name = sorted(state)[0]
            state[name] = state[name].clone()
            state[name].view(-1)[0] += 1.0
            save_file(state, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
        return {"seconds": 1.0, "sft_steps": 3, "dev_accuracy": 0.5, "test_accuracy": 0.4}

    monkeypatch.setattr(arith, "build_tiny_model", build)
    monkeypatch.setattr(tiny_tools, "build_tools_model", build)
    monkeypatch.setattr(tiny_games, "build_games_model", build)
    monkeypatch.setattr(tiny_vision, "build_vision_model", build)
    out = tmp_path / "m"
    assert main(["tiny-model", "--task", task, "--rebuild", "--output", str(out)]) == 0
    assert (weights_sha(out) == weights_sha(shipped_dir)) == (weights == "same")
    assert rebuild_says(capsys.readouterr().out, out) == weights


@pytest.mark.slow
def test_rebuild_makes_a_competent_but_imperfect_model(tmp_path, capsys):
    """`posttrain tiny-model --rebuild`: the build code still makes what was shipped, up to
    this CPU's rounding (about 100 s); its verdict is the one its weights call for."""
    from posttrain.cli import main

    assert main(["tiny-model", "--rebuild", "--output", str(tmp_path / "m")]) == 0
    verdict = rebuild_says(capsys.readouterr().out, tmp_path / "m")
    assert verdict == ("same" if weights_sha(tmp_path / "m") == weights_sha(shipped.EMBEDDED_DIR) else "other")
    meta = json.loads((tmp_path / "m" / "posttrain_tiny.json").read_text())
    assert 0.3 <= meta["dev_accuracy"] <= 0.75
    assert 0.15 <= meta["test_accuracy"] <= 0.75
    assert load_model(tmp_path / "m").config.hidden_size == TinySpec().hidden_size


TOOLS_WEIGHTS_SHA256 = "0e29f60d3c30482b1fb8870ab0a818171215da093f9797322dea60ec4615cbb0"


def test_the_tool_using_model_ships_and_calls_the_calculator_imperfectly(tmp_path, capsys):
    """`posttrain tiny-model --task tools` prints the shipped directory (its bytes checked) or copies it;
    greedy, it calls the calculator on held-out products, rightly more often than not, and answers
    right less often: what the multi-turn demonstration starts from."""
    import hashlib

    import posttrain.tiny.tools as tiny_tools
    from posttrain.cli import main
    from posttrain.data.preprocess import products
    from posttrain.tools import load_tools

    assert main(["tiny-model", "--task", "tools"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == shipped.TOOLS_DIR
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == TOOLS_WEIGHTS_SHA256
    meta = json.loads((path / "posttrain_tiny.json").read_text())
    assert meta["version"] == tiny_tools.VERSION and meta["spec"] == asdict(tiny_tools.ToolsSpec())
    assert main(["tiny-model", "--task", "tools", "--output", str(tmp_path / "m")]) == 0
    assert directory_digest(tmp_path / "m") == shipped.TOOLS_DIGEST
    assert main(["tiny-model", "--task", "tools", "--rebuild"]) == 2  # needs --output
    tools = load_tools(functions=["calculator"])
    try:
        scores = tiny_tools.conversation_scores(load_model(path), load_tokenizer(path),
                                                products.split_pairs()[1][:32], tools)
    finally:
        tools.close()
    assert 0.5 <= scores["tool_correct"] <= 0.97 and 0.25 <= scores["accuracy"] <= 0.8


def test_the_tool_warm_up_builds_a_loadable_model_from_the_shipped_one(tmp_path):
    """build_tools_model's path, 2 steps (the shipped one took 720; `posttrain tiny-model --task tools
    --rebuild --output DIR` runs it all): the weights moved from the arith model's, the directory loads,
    and its record says what was built."""
    import posttrain.tiny.tools as tiny_tools

    spec = tiny_tools.ToolsSpec(max_steps=2, eval_every=1, eval_below_loss=100.0, dev_size=4, batch_size=8)
    meta = tiny_tools.build_tools_model(tmp_path / "m", spec=spec, progress=False)
    assert (meta["sft_steps"], meta["base"], meta["spec"]) == (2, arith.VERSION, asdict(spec))
    before, after = load_file(shipped.EMBEDDED_DIR / "model.safetensors"), load_file(tmp_path / "m" / "model.safetensors")
    assert set(before) == set(after) and any(not torch.equal(before[k], after[k]) for k in before)
    assert load_tokenizer(tmp_path / "m").eos_token_id == load_model(tmp_path / "m").config.eos_token_id


GAMES_WEIGHTS_SHA256 = "a07ccb420ecf1957f7d5af71073991eed2ef42369d76cf73c8e29099a01c21a2"


def test_the_number_guessing_model_ships_and_keeps_to_the_answers_without_a_plan(tmp_path, capsys):
    """`posttrain tiny-model --task games` prints the shipped directory (its bytes checked) or copies it;
    greedy, it plays every secret keeping to "higher"/"lower" nearly always, and wins far less often than
    halving the range would (15 in 16): what the game demonstration starts from."""
    import hashlib

    import posttrain.tiny.games as tiny_games
    from posttrain.cli import main

    assert main(["tiny-model", "--task", "games"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == shipped.GAMES_DIR
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == GAMES_WEIGHTS_SHA256
    meta = json.loads((path / "posttrain_tiny.json").read_text())
    assert meta["version"] == tiny_games.VERSION and meta["spec"] == asdict(tiny_games.GamesSpec())
    assert main(["tiny-model", "--task", "games", "--output", str(tmp_path / "m")]) == 0
    assert directory_digest(tmp_path / "m") == shipped.GAMES_DIGEST
    assert main(["tiny-model", "--task", "games", "--seed", "1"]) == 2  # ships for seed 0 only
    scores = tiny_games.game_scores(load_model(path), load_tokenizer(path), list(range(1, 17)), sample=False)
    assert scores["consistent"] >= 0.8 and 0.15 <= scores["success"] <= 0.75, scores
    assert 2.0 <= scores["guesses"] <= 4.0


def test_a_warm_up_game_is_the_rollouts_conversation_with_the_loss_on_the_guesses():
    """conversation(): the chat template's rendering of the game token for token (the assistant's turns
    ending at EOS), labels on the guesses and their EOS only; uniform_game keeps to the answers."""
    import random

    import posttrain.tiny.games as tiny_games

    tok = load_tokenizer(shipped.embedded_model())
    ids, labels = tiny_games.conversation(tok, 9, [12, 9])
    ask = tiny_games.game_row(9)["ask"]
    messages = ask + [{"role": "assistant", "content": "12"}, {"role": "user", "content": "lower"},
                      {"role": "assistant", "content": "9"}]
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False).rstrip("\n")
    assert tok.decode([t for t, lab in zip(ids, labels) if lab != -100]) == "12<|im_end|>9<|im_end|>"
    assert all(lab in (-100, t) for t, lab in zip(ids, labels))
    rng = random.Random(0)
    for secret in (1, 7, 16):
        for _ in range(50):
            guesses = tiny_games.uniform_game(secret, rng, 1, 16, 4)
            lo, hi = 1, 16
            for g in guesses:
                assert lo <= g <= hi
                lo, hi = (g + 1, hi) if g < secret else (lo, g - 1) if g > secret else (g, g)
            assert len(guesses) <= 4 and (guesses[-1] == secret or len(guesses) == 4)
    assert tiny_games.uniform_game(2, random.Random(0), 1, 2, 1) in ([1], [2])


def test_the_games_warm_up_builds_a_loadable_model_from_the_shipped_one(tmp_path):
    """build_games_model's path, 2 steps (the shipped one took 400; `posttrain tiny-model --task games
    --rebuild --output DIR` runs it all): the weights moved, the directory loads, its record says what was built."""
    import posttrain.tiny.games as tiny_games

    spec = tiny_games.GamesSpec(max_steps=2, eval_every=1, dev_games=4, games=40, batch_size=8)
    meta = tiny_games.build_games_model(tmp_path / "m", spec=spec, progress=False)
    assert (meta["sft_steps"], meta["base"], meta["spec"]) == (2, arith.VERSION, asdict(spec))
    before, after = load_file(shipped.EMBEDDED_DIR / "model.safetensors"), load_file(tmp_path / "m" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert 0.0 <= meta["greedy_success"] <= 1.0 and load_model(tmp_path / "m").config.eos_token_id == 258
