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
