"""`posttrain train` on a vision-language model: verl's rows with images (the `images` column of {"bytes"},
`<image>` placeholders), a tiny random Qwen2.5-VL built offline, two GRPO steps with a reference model (KL
loss), a checkpoint that keeps the processor files, and `posttrain export` that loads back in transformers."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.data.schema import write_rows
from posttrain.models.processor import load_processor, load_vision_model
from posttrain.tiny.vision import build_vlm_dir

from helpers import posttrain, read_metrics


def png(seed: int, size=(56, 56)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def vision_rows(count: int) -> list[dict]:
    """verl's layout: the placeholder in the text, the images beside it (two in every third row)."""
    rows = []
    for i in range(count):
        two = i % 3 == 2
        text = ("<image>Compare <image>" if two else "What is in <image>?") + f" {i} + 1 = ?"
        rows.append({"data_source": "arith", "prompt": [{"role": "user", "content": text}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
                     "extra_info": {"index": i},
                     "images": [{"bytes": png(i), "path": None}] + ([{"bytes": png(100 + i, (84, 56)),
                                                                      "path": None}] if two else [])})
    return rows


@pytest.mark.slow
def test_two_grpo_steps_on_images_then_export(tmp_path):
    model_dir = build_vlm_dir(tmp_path / "model", "qwen2_5_vl", seed=2)
    write_rows(vision_rows(6), tmp_path / "train.parquet")
    write_rows(vision_rows(3), tmp_path / "val.parquet")
    run_dir = tmp_path / "run"
    posttrain(["train", f"model.path={model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
               f"data.val_files={tmp_path / 'val.parquet'}", "data.train_batch_size=3", "data.max_prompt_length=128",
               "data.max_response_length=6", "rollout.n=2", "actor.ppo_mini_batch_size=3",
               "actor.ppo_micro_batch_size=3", "actor.lr=1e-3", "actor.use_kl_loss=true", "trainer.test_freq=2",
               "trainer.save_freq=2", "trainer.total_training_steps=2", f"trainer.run_dir={run_dir}",
               "trainer.logger=[]", "reward.num_workers=0"], cwd=tmp_path)
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert len(steps) == 2 and all(np.isfinite(m["actor/pg_loss"]) for m in steps)
    assert any("val/score/mean" in m for m in metrics)
    assert all(m["actor/kl_loss"] >= 0 for m in steps)
    ckpt = run_dir / "checkpoints" / "global_step_2" / "actor"
    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    posttrain(["export", str(run_dir), "--output", str(tmp_path / "hf")], cwd=tmp_path)
    processor = load_processor(tmp_path / "hf")
    model = load_vision_model(tmp_path / "hf", torch.float32)
    before, after = load_vision_model(model_dir, torch.float32).state_dict(), model.state_dict()
    assert before.keys() == after.keys()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("language_model" in k for k in moved) and any("visual" in k for k in moved)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "hi"}]}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[Image.open(io.BytesIO(png(0)))]], return_tensors="pt")
    assert torch.isfinite(model(**inputs).logits).all()
    evaluated = posttrain(["eval", "--model", str(tmp_path / "hf"), "--data", str(tmp_path / "val.parquet"),
                           "--max-response-length", "4"], cwd=tmp_path)
    assert "(3 prompts x 1)" in evaluated.stdout


@pytest.mark.slow
def test_ppo_with_a_critic_on_idefics3_with_the_vision_tower_frozen(tmp_path):
    """The other layout (Idefics3: pixel_attention_mask, 1-D positions), GAE with a critic on the VLM's body,
    TRL's layout (an `image` column, no placeholder): the tower keeps its weights, the language model moves."""
    model_dir = build_vlm_dir(tmp_path / "model", "idefics3", seed=3)
    rows = vision_rows(6)
    for r in rows:  # TRL's: one image in an `image` column, none in the text
        r["image"] = r.pop("images")[0]
        r["prompt"][0]["content"] = r["prompt"][0]["content"].replace("<image>", "")
    write_rows(rows, tmp_path / "train.parquet")
    run_dir = tmp_path / "run"
    posttrain(["train", f"model.path={model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
               "data.train_batch_size=3", "data.max_prompt_length=128", "data.max_response_length=6", "rollout.n=2",
               "algorithm.adv_estimator=gae", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size=3",
               "critic.ppo_micro_batch_size=3", "actor.lr=1e-3", "critic.lr=1e-3", "actor.freeze_vision_tower=true",
               "trainer.save_freq=2", "trainer.total_training_steps=2", f"trainer.run_dir={run_dir}",
               "trainer.logger=[]", "reward.num_workers=0"], cwd=tmp_path)
    steps = [m for m in read_metrics(run_dir) if "critic/vf_loss" in m]
    assert len(steps) == 2 and all(np.isfinite(m["critic/vf_loss"]) for m in steps)
    ckpt = run_dir / "checkpoints" / "global_step_2"
    assert (ckpt / "critic" / "model.safetensors").is_file()
    before = load_vision_model(model_dir, torch.float32).state_dict()
    after = load_vision_model(ckpt / "actor", torch.float32).state_dict()
    tower = [k for k in before if "vision_model" in k]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert any(not torch.equal(before[k], after[k]) for k in before if "text_model" in k)


@pytest.mark.slow
def test_asynchronous_training_with_in_flight_updates_takes_images(tmp_path):
    """The rollout engine in a process of its own: prompts with images cross to it (ImagePrompt pickles its
    images' tensors), new weights reach it between tokens."""
    model_dir = build_vlm_dir(tmp_path / "model", "qwen2_5_vl", seed=4)
    write_rows(vision_rows(6), tmp_path / "train.parquet")
    run_dir = tmp_path / "run"
    posttrain(["train", f"model.path={model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
               "data.train_batch_size=3", "data.max_prompt_length=128", "data.max_response_length=6", "rollout.n=2",
               "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size=3", "async_training.enable=true",
               "async_training.in_flight_weight_updates=true", "algorithm.rollout_correction.rollout_is=token",
               "trainer.total_training_steps=2", f"trainer.run_dir={run_dir}", "trainer.logger=[]",
               "reward.num_workers=0"], cwd=tmp_path)
    steps = [m for m in read_metrics(run_dir) if "actor/pg_loss" in m]
    assert len(steps) == 2 and all(np.isfinite(m["actor/pg_loss"]) for m in steps)


def test_a_tokenizer_apart_from_a_vision_language_models_processor_is_refused(tmp_path):
    """model.tokenizer_path with a vision-language model: its processor holds the tokenizer, so it is refused in
    one line naming the key."""
    from posttrain.config import load_config
    from posttrain.driver.build import build_run
    from posttrain.errors import ConfigError

    model_dir = build_vlm_dir(tmp_path / "model", "qwen2_5_vl", seed=2)
    with pytest.raises(ConfigError, match=r"^model\.tokenizer_path=\S+ with a vision-language model: its processor"):
        build_run(load_config(None, [f"model.path={model_dir}", f"model.tokenizer_path={model_dir}",
                                     f"trainer.run_dir={tmp_path / 'run'}", "trainer.logger=[]"]))
