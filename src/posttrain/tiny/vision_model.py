"""The tiny vision model: a Qwen2.5-VL whose language model is the shipped embedded arith model, warmed up to read
the first number of the vision-digits task (data/vision_digits.py: `23` drawn in a 56x28 image, `+45=` in the text).

    meta = build_vision_model("/tmp/vision_model", seed=0)   # -> {"sft_steps": ..., "dev_accuracy": ..., ...}

The language model: the embedded model's weights copied unchanged (hidden 128, 4 layers, 4 heads of 32, 2 KV
heads, intermediate 384), its vocabulary grown by Qwen2.5-VL's four image tokens (rows 259..262, seeded random),
the head tied to the embeddings as before. Its rotary embedding is m-RoPE with sections [2, 2, 12] (time,
height, width: 16 frequencies, half a head, highest first; VisionSpec says why); on a text-only prompt Qwen-VL's
three positions are equal, so the copied model computes what the embedded model computes
(tests/test_vision_task.py checks it). Parameter names map as
`model.X` -> `model.language_model.X` (embed_tokens, layers.N.*, norm); lm_head is tied.

The vision tower: Qwen2.5-VL's (14-px patches, 2x2 merged into one token per 28x28 cell), seeded random, hidden
64, 2 blocks, 4 heads, its merger projecting to the language model's 128.

The warm-up (build_vision_model's docstring): phase one teaches the vision tower to read (each image token's
output pulled onto the embedding of the digit its cell shows), phase two teaches the language model the prompt's
new shape (the answer tokens' loss, the vision tower frozen), until the greedy accuracy on a dev slice of the
arith *train* pairs reaches `sft_target_accuracy`: competent but imperfect, room for RL. Every batch draws fresh
images. The RL rows (`posttrain preprocess vision-digits`) validate on the held-out test pairs.

The shipped model (seed 0; `posttrain tiny-model --task vision`): 1,079,616 parameters (257,344 in the vision
tower), 4.3 MB of float32 weights; phase one 130 steps, phase two to step 590 (dev accuracy 0.04 at step 150,
0.28 at 390, 0.41 at 510, 0.52 at 590, noisy: +-0.1 between evaluations), 126 s on the quiet 2-core CPU, the
same bytes on every rebuild measured there; test accuracy 0.488, which `posttrain train` on the preprocessed
test rows reproduces as its step-0 validation score. Seed 1: 137 + 540 steps, test 0.473. What GRPO does with
it, and why the example's rate is 3e-5: docs/vision.md, "The tiny vision model learns" (bench/vision_learning.py).
The m-RoPE sections: VisionSpec.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from posttrain.data import vision_digits
from posttrain.models import shipped
from posttrain.tiny.vision import (
    CHAT_TEMPLATES,
    PROCESSORS,
    QWEN_IMAGE_TOKENS,
    _tokenizer,
)

VERSION = "tiny-qwen2_5_vl-digits-v1"


@dataclass(frozen=True)
class VisionSpec:
    vision_hidden: int = 64
    vision_depth: int = 2
    vision_heads: int = 4
    # m-RoPE's frequencies for time, height, width, the highest first. The image's two digits sit side by side:
    # the same time and height, widths one apart, so only the width's frequencies tell them apart. With
    # (8, 4, 4) those are the four lowest (1e-3..2e-4 radians a step: the two digits nearly one position), and
    # the warm-up took 650 steps to 0.51 and GRPO gained 0.05; with (2, 2, 12), 590 steps and +0.10.
    mrope_section: tuple = (2, 2, 12)
    sft_lr: float = 1e-3
    sft_lm_lr: float = 3e-4  # phase two's rate (the language model's weights)
    sft_batch_size: int = 64
    sft_read_steps: int = 300  # phase one at most (the vision tower alone, reading_loss)
    sft_read_accuracy: float = 0.99  # phase one ends when this share of a batch's digits are read
    sft_target_accuracy: float = 0.5
    sft_max_steps: int = 1500
    sft_eval_every: int = 20
    sft_dev_size: int = 256


def _config(tok, spec: VisionSpec, embedded: dict):
    from transformers import Qwen2_5_VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_IMAGE_TOKENS}
    text = dict(hidden_size=embedded["hidden_size"], intermediate_size=embedded["intermediate_size"],
                num_hidden_layers=embedded["num_hidden_layers"], num_attention_heads=embedded["num_attention_heads"],
                num_key_value_heads=embedded["num_key_value_heads"], vocab_size=len(tok),
                max_position_embeddings=embedded["max_position_embeddings"], rms_norm_eps=embedded["rms_norm_eps"],
                tie_word_embeddings=True, attention_dropout=0.0,
                rope_parameters={"rope_type": "default", "rope_theta": embedded["rope_parameters"]["rope_theta"],
                                 "mrope_section": list(spec.mrope_section)},
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_heads=spec.vision_heads, out_hidden_size=embedded["hidden_size"], patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[spec.vision_depth - 1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)


def language_model_names(name: str) -> str:
    """The embedded Qwen2's parameter name -> the Qwen2.5-VL's: model.X -> model.language_model.X."""
    return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


def init_vision_model(out: Path, seed: int, spec: VisionSpec):
    """The model directory's processor files, and (model, processor): the embedded model's weights in the
    language model, the rest seeded random."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from posttrain.models.processor import load_processor

    base = shipped.embedded_model()
    embedded = json.loads((base / "config.json").read_text())
    tok = _tokenizer(out, "qwen2_5_vl")
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(_config(tok, spec, embedded))
    weights = load_file(str(base / "model.safetensors"))
    state = model.state_dict()
    with torch.no_grad():
        for name, value in weights.items():
            if name == "lm_head.weight":
                continue  # tied to the embeddings
            target = state[language_model_names(name)]
            if name == "model.embed_tokens.weight":
                target[: value.shape[0]] = value  # the image tokens' rows stay as initialised
            else:
                target.copy_(value)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))  # the initial weights; the warm-up's end overwrites them
    tok.save_pretrained(str(out))
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(str(out))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": PROCESSORS["qwen2_5_vl"][0]}, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATES["qwen2_5_vl"])
    return model, load_processor(out)


def _prompt_text(processor, b: int) -> str:
    from posttrain.data.images import with_image_parts

    messages = with_image_parts([{"role": "user", "content": vision_digits.prompt_text(b)}], 1, "vision-digits")
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def batch_tensors(model, processor, pairs, images) -> dict:
    """A supervised batch: input_ids, attention_mask, labels (-100 but on the answer and EOS), pixel_values,
    image_grid_thw, and position_ids: Qwen-VL's 3-D positions, as posttrain's rollout and passes give them
    (rollout/vision.py). Passed explicitly: transformers' Qwen2.5-VL forward computes 3-D positions only when
    given mm_token_type_ids (the processor returns them; a batch that leaves them out, as this one does, gets
    1-D positions without a word), and the rollout uses the 3-D ones (measured: a model warmed up on 1-D
    positions reads 0.47 of the dev rows right in a plain loop and 0.02 in the
    rollout). Every prompt has the same length (a 56x28 image, a two-digit b), answers 2 or 3 digits."""
    from posttrain.rollout.vision import positions

    tok = processor.tokenizer
    prompts = [_prompt_text(processor, b) for _, b in pairs]
    texts = [p + vision_digits.answer_text(a, b) + tok.eos_token for p, (a, b) in zip(prompts, pairs)]
    out = processor(text=texts, images=[[im] for im in images], padding=True, return_tensors="pt")
    width = len(processor(text=prompts[:1], images=[[images[0]]], return_tensors="pt")["input_ids"][0])
    labels = out["input_ids"].masked_fill(out["attention_mask"] == 0, -100)
    labels[:, :width] = -100
    batch = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": labels,
             "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    batch["position_ids"] = positions(model, batch["input_ids"], batch["attention_mask"], batch)
    return batch


def vision_prompts(processor, pairs, images) -> list:
    """The rollout's prompts (ImagePrompt: ids with their images' tensors) for `pairs` with `images`."""
    from posttrain.data.images import vision_inputs
    from posttrain.rollout.vision import ImagePrompt

    out = []
    for (_, b), image in zip(pairs, images):
        ids = processor(text=[_prompt_text(processor, b)], images=[[image]], return_tensors="pt")["input_ids"][0]
        out.append(ImagePrompt(ids.tolist(), vision_inputs(processor, [image], "vision-digits")))
    return out


def greedy_accuracy(model, processor, pairs, images, max_new_tokens: int = 6) -> float:
    """Share of `pairs` (with their images of a) whose greedy answer is exactly right."""
    from posttrain.rollout.base import SamplingParams, decode_responses
    from posttrain.rollout.hf import HFRolloutEngine

    tok = processor.tokenizer
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, progress=False)
    out = engine.generate(vision_prompts(processor, pairs, images),
                          SamplingParams(max_new_tokens=max_new_tokens, do_sample=False))
    texts = decode_responses(tok, out)
    return sum(t.strip() == vision_digits.answer_text(a, b) for t, (a, b) in zip(texts, pairs)) / len(pairs)


def digit_targets(processor, pairs) -> torch.Tensor:
    """Each image token's target in phase one: the embedding row id of the digit its cell shows, [tokens]."""
    tok = processor.tokenizer
    return torch.tensor([tok.convert_tokens_to_ids(d) for a, _ in pairs for d in str(a)])


def reading_loss(model, batch: dict, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Phase one's loss: the merger's output for each image token against the (frozen) embedding of the digit
    its cell shows (mean squared error), and the share of tokens whose nearest digit embedding is the right one."""
    features = torch.cat(list(model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
                              .pooler_output))
    table = model.get_input_embeddings().weight.detach()
    loss = torch.nn.functional.mse_loss(features, table[targets])
    digits = torch.unique(targets)
    nearest = digits[torch.cdist(features.detach(), table[digits]).argmin(-1)]
    return loss, float((nearest == targets).float().mean())


def build_vision_model(output_dir: str | Path, seed: int = 0, spec: VisionSpec = VisionSpec(),
                       progress: bool = True) -> dict:
    """Initialise (init_vision_model), warm up on vision-digits, save to `output_dir`. -> metadata (also written
    to posttrain_tiny.json): steps, seconds, the dev accuracy curve, the test accuracy, the parameter count.

    Phase one ("read"): only the vision tower and merger train, each image token's output pulled onto the
    embedding of the digit its cell shows (reading_loss), until `sft_read_accuracy` of a batch's tokens are
    nearest their digit (at most `sft_read_steps`; about 130 steps of 64 rows, 15-30 s). Phase two ("answer"):
    the language model trains on the answer tokens (and EOS), the
    vision tower frozen (trained beside it, its reading fell from 0.99 to 0.3 of the digits), until the
    greedy dev accuracy reaches `sft_target_accuracy`: the language model has to
    learn the prompt's new shape (the image's marker tokens around the digits shift them), which the embedded
    model does not do as it is (measured: 0.02 greedy accuracy with the true digits' embeddings in place of the
    image tokens)."""
    start = time.perf_counter()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = init_vision_model(out, seed, spec)
    train_pairs, test_pairs = vision_digits.split_pairs(seed=0)
    dev, sft = train_pairs[: spec.sft_dev_size], train_pairs[spec.sft_dev_size:]
    dev_images = [vision_digits.number_image(a, seed, "dev", i) for i, (a, _) in enumerate(dev)]
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.requires_grad_("visual" in name)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.sft_lr, weight_decay=0.0)
    phase, step, read_steps, dev_acc, read_acc, curve, drawn = "read", 0, 0, 0.0, 0.0, [], 0
    model.train()
    while step < spec.sft_max_steps:
        idx = torch.randint(0, len(sft), (spec.sft_batch_size,), generator=gen).tolist()
        pairs = [sft[i] for i in idx]
        images = [vision_digits.number_image(a, seed, "train", drawn + j) for j, (a, _) in enumerate(pairs)]
        drawn += len(pairs)
        batch = batch_tensors(model, processor, pairs, images)
        if phase == "read":
            loss, read_acc = reading_loss(model, batch, digit_targets(processor, pairs))
        else:
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if phase == "read":
            if read_acc >= spec.sft_read_accuracy or step >= spec.sft_read_steps:
                phase, read_steps = "answer", step
                curve.append((step, round(float(loss.detach()), 4), read_acc, None))
                for name, p in model.named_parameters():
                    p.requires_grad_("visual" not in name)
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.sft_lm_lr,
                                        weight_decay=0.0)
                if progress:
                    print(f"posttrain: warming up the tiny vision model: read the digits after {step} steps "
                          f"({read_acc:.3f} of a batch's), {time.perf_counter() - start:.0f} s", file=sys.stderr)
            continue
        if (step - read_steps) % spec.sft_eval_every == 0:
            model.eval()
            dev_acc = greedy_accuracy(model, processor, dev, dev_images)
            model.train()
            curve.append((step, round(float(loss.detach()), 4), None, dev_acc))
            if progress:
                print(f"posttrain: warming up the tiny vision model: step {step}, loss {float(loss.detach()):.3f}, "
                      f"dev accuracy {dev_acc:.3f} (target {spec.sft_target_accuracy}), "
                      f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
            if dev_acc >= spec.sft_target_accuracy:
                break
    model.eval()
    model.save_pretrained(str(out))
    test = test_pairs[: spec.sft_dev_size]
    test_images = [vision_digits.number_image(a, seed, "test", i) for i, (a, _) in enumerate(test)]
    meta = {"version": VERSION, "seed": seed, "spec": asdict(spec), "sft_steps": step, "read_steps": read_steps,
            "dev_accuracy": dev_acc, "curve": curve,
            "test_accuracy": greedy_accuracy(model, processor, test, test_images),
            "parameters": sum(p.numel() for p in model.parameters()),
            "vision_parameters": sum(p.numel() for n, p in model.named_parameters() if "visual" in n),
            "seconds": round(time.perf_counter() - start, 1)}
    (out / "posttrain_tiny.json").write_text(json.dumps(meta, indent=2))
    return meta


__all__ = ["VisionSpec", "build_vision_model", "greedy_accuracy", "init_vision_model", "language_model_names"]
