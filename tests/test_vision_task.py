"""The vision-digits task (data/vision_digits.py, `posttrain preprocess vision-digits`) and the tiny vision
model's starting point (tiny/vision_model.py): the embedded arith model's weights inside a Qwen2.5-VL."""

import argparse
import io

import numpy as np
import torch
from PIL import Image

from posttrain.data import vision_digits
from posttrain.data.preprocess import register
from posttrain.data.preprocess.vision_digits import make_row, run
from posttrain.data.schema import read_rows
from posttrain.rewards import compute_score


def test_prompt_answer_and_pairs():
    assert vision_digits.prompt_text(45) == "<image>+45="
    assert vision_digits.answer_text(23, 45) == "68"
    train, test = vision_digits.split_pairs(0)
    assert len(train) + len(test) == 90 * 90 and not set(train) & set(test)
    assert compute_score("arith", "68", "68") == 1.0 and compute_score("arith", "67", "68") == 0.0


def test_images_are_seeded_sized_and_show_the_digits():
    image = vision_digits.number_image(23, seed=0, split="train", index=0)
    assert image.size == (56, 28) and image.mode == "RGB"
    assert vision_digits.number_png(23, 0, "train", 0) == vision_digits.number_png(23, 0, "train", 0)
    assert vision_digits.number_png(23, 0, "train", 0) != vision_digits.number_png(23, 0, "train", 1)
    assert vision_digits.number_png(23, 0, "train", 0) != vision_digits.number_png(23, 0, "test", 0)
    pixels = np.asarray(image).mean(-1)
    for cell in (pixels[:, :28], pixels[:, 28:]):  # one digit per 28x28 cell: dark ink on a light ground
        assert (cell < 110).sum() >= 20 and (cell > 150).sum() >= 400
    # "1" has less ink than "8" in every drawing
    rng_ink = [(np.asarray(vision_digits.number_image(n, 0, "train", i)).mean(-1) < 110).sum()
               for i, n in enumerate((11, 88))]
    assert rng_ink[0] < rng_ink[1]


def test_rows_in_verls_layout(tmp_path):
    row = make_row(23, 45, "train", 0)
    assert row["prompt"] == [{"role": "user", "content": "<image>+45="}]
    assert row["data_source"] == "arith" and row["reward_model"] == {"style": "rule", "ground_truth": "68"}
    assert row["extra_info"] == {"split": "train", "index": 0, "a": 23, "b": 45}
    assert row["images"][0]["path"] is None
    assert Image.open(io.BytesIO(row["images"][0]["bytes"])).size == (56, 28)
    paths = run(tmp_path, num_train=3, num_test=2)
    assert [p.name for p in paths] == ["train.parquet", "test.parquet"]
    train, test = read_rows(str(paths[0])), read_rows(str(paths[1]))
    assert len(train) == 3 and len(test) == 2
    first = vision_digits.split_pairs(0)[0][0]
    assert train[0]["reward_model"]["ground_truth"] == str(sum(first))
    assert bytes(train[0]["images"][0]["bytes"]) == vision_digits.number_png(first[0], 0, "train", 0)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="dataset"))
    args = parser.parse_args(["vision-digits", "--output-dir", str(tmp_path / "cli"), "--num-train", "2",
                              "--num-test", "1"])
    assert args.func(args) == 0 and len(read_rows(str(tmp_path / "cli" / "test.parquet"))) == 1


def test_vision_model_starts_as_the_embedded_model_on_text(tmp_path):
    """The copied language model computes what the embedded model does on a text prompt (equal 3-D positions:
    m-RoPE is plain RoPE), its vocabulary grown by the four image tokens; an image prompt runs in the rollout."""
    from transformers import AutoTokenizer

    from posttrain.models import shipped
    from posttrain.models.loader import load_model
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.tiny.vision_model import (
        VisionSpec,
        batch_tensors,
        init_vision_model,
        language_model_names,
        vision_prompts,
    )

    torch.set_num_threads(1)
    assert language_model_names("model.layers.3.mlp.up_proj.weight") == "model.language_model.layers.3.mlp.up_proj.weight"
    model, processor = init_vision_model(tmp_path, seed=0, spec=VisionSpec())
    model.eval()
    base = load_model(shipped.embedded_model()).eval()
    tok = AutoTokenizer.from_pretrained(str(shipped.embedded_model()))
    messages = [{"role": "user", "content": "23+45="}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert processor(text=[text], return_tensors="pt")["input_ids"][0].tolist() == ids
    with torch.no_grad():
        want, got = base(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits
    assert got.shape[-1] == want.shape[-1] + 4
    torch.testing.assert_close(got[..., : want.shape[-1]], want, atol=1e-4, rtol=1e-4)
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, progress=False)
    base_engine = HFRolloutEngine(base, [tok.eos_token_id], tok.pad_token_id, progress=False)
    greedy = SamplingParams(max_new_tokens=4, do_sample=False)
    assert engine.generate([ids], greedy).response_ids.tolist() == base_engine.generate([ids], greedy).response_ids.tolist()
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert vision < 300_000 and sum(p.numel() for p in model.parameters()) < 1_200_000
    pairs = [(23, 45), (90, 17)]
    images = [vision_digits.number_image(a, 0, "dev", i) for i, (a, _) in enumerate(pairs)]
    batch = batch_tensors(model, processor, pairs, images)
    assert batch["position_ids"].shape == (3, 2, batch["input_ids"].shape[1])
    assert torch.isfinite(model(**batch).loss)
    prompts = vision_prompts(processor, pairs, images)
    assert sum(t == model.config.image_token_id for t in prompts[0]) == 2  # 56x28: two image tokens
    out = engine.generate(prompts, greedy)
    assert out.response_ids.shape[0] == 2


VISION_WEIGHTS_SHA256 = "086b45a8c5b363d3507c52a21807261851014517cee232341a187208d5135740"


def test_the_vision_model_ships_reads_the_digits_and_adds_imperfectly(tmp_path, capsys):
    """`posttrain tiny-model --task vision` prints the shipped directory (its bytes checked) or copies it; its
    vision tower reads nearly every held-out digit (nearest digit embedding), and greedy it answers some held-out
    sums right, far from all: what GRPO on the vision-digits task starts from."""
    import hashlib
    import json
    from dataclasses import asdict
    from pathlib import Path

    from posttrain.cli import main
    from posttrain.files.cache import directory_digest
    from posttrain.models import shipped
    from posttrain.models.loader import load_model
    from posttrain.models.processor import load_processor
    from posttrain.tiny import vision_model

    torch.set_num_threads(1)
    assert main(["tiny-model", "--task", "vision"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == shipped.VISION_DIR
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == VISION_WEIGHTS_SHA256
    meta = json.loads((path / "posttrain_tiny.json").read_text())
    assert meta["version"] == vision_model.VERSION and meta["spec"] == json.loads(json.dumps(asdict(vision_model.VisionSpec())))
    assert main(["tiny-model", "--task", "vision", "--output", str(tmp_path / "m")]) == 0
    assert directory_digest(tmp_path / "m") == shipped.VISION_DIGEST
    assert main(["tiny-model", "--task", "vision", "--seed", "1"]) == 2  # ships for seed 0 only
    model, processor = load_model(path).eval(), load_processor(path)
    pairs = vision_digits.split_pairs(0)[1][:64]
    images = [vision_digits.number_image(a, 0, "test", i) for i, (a, _) in enumerate(pairs)]
    with torch.no_grad():
        batch = vision_model.batch_tensors(model, processor, pairs, images)
        _, read = vision_model.reading_loss(model, batch, vision_model.digit_targets(processor, pairs))
    assert read >= 0.95, read
    assert 0.3 <= vision_model.greedy_accuracy(model, processor, pairs, images) <= 0.75


def test_the_vision_warm_up_builds_a_loadable_model(tmp_path):
    """build_vision_model's path, 2 + 2 steps (the shipped one took about 130 + 500; `posttrain tiny-model --task
    vision --rebuild --output DIR` runs it all): the vision tower (phase one) and the language model (phase
    two) both moved; the directory loads with its processor, and its record says what was built."""
    import json
    from dataclasses import asdict

    from safetensors.torch import load_file

    from posttrain.models.loader import load_model
    from posttrain.models.processor import load_processor
    from posttrain.tiny import vision_model

    torch.set_num_threads(1)
    spec = vision_model.VisionSpec(sft_read_steps=2, sft_max_steps=4, sft_eval_every=2, sft_dev_size=4,
                                   sft_batch_size=4, sft_target_accuracy=1.1)
    init = tmp_path / "init"
    init.mkdir()
    vision_model.init_vision_model(init, seed=0, spec=spec)
    meta = vision_model.build_vision_model(tmp_path / "m", seed=0, spec=spec, progress=False)
    assert (meta["read_steps"], meta["sft_steps"], meta["spec"]) == (2, 4, asdict(spec))
    assert json.loads((tmp_path / "m" / "posttrain_tiny.json").read_text())["version"] == vision_model.VERSION
    before, after = load_file(init / "model.safetensors"), load_file(tmp_path / "m" / "model.safetensors")
    assert set(before) == set(after)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    # saved under Qwen2.5-VL's checkpoint names: the language model's as model.layers.N..., the tower's visual...
    assert any("visual" in k for k in moved) and any(".layers." in k and "visual" not in k for k in moved)
    model = load_model(tmp_path / "m")
    assert model.config.model_type == "qwen2_5_vl"
    assert load_processor(tmp_path / "m").tokenizer.eos_token_id == model.config.eos_token_id
