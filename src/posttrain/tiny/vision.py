"""Tiny vision-language models built offline: a model directory with a processor (the embedded byte-level
tokenizer plus the family's image tokens, a chat template that renders image parts, a PIL image processor) and
seeded random weights, for tests and as the starting point of the tiny vision model's warm-up.

    build_vlm_dir("/tmp/qwen_vl")                      # Qwen2.5-VL: m-RoPE (3-D positions), flat patches
    build_vlm_dir("/tmp/idefics3", family="idefics3")  # Idefics3 (SmolVLM's layout): pixel_attention_mask

Two families with different layouts: Qwen2.5-VL's processor flattens each image into `[patches, channels x
temporal x patch x patch]` with `image_grid_thw`, and its language model places image tokens by a 3-D rotary
position (`get_rope_index`); Idefics3's gives `[1, images, 3, H, W]` with `pixel_attention_mask` and plain 1-D
positions. Both expand one image placeholder of the chat template into a run of image tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posttrain.models.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, write_tokenizer

FAMILIES = ("qwen2_5_vl", "idefics3")
# each family's processor class, and its own settings (processor_config.json)
PROCESSORS = {"qwen2_5_vl": ("Qwen2_5_VLProcessor", {}), "idefics3": ("Idefics3Processor", {"image_seq_len": 4})}
QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IDEFICS_IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")

# ChatML whose content may be a list of parts: an image part renders as the family's placeholder
_PARTS = ("{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
          "{%- for part in message['content'] %}"
          "{%- if part['type'] == 'image' or 'image' in part %}{{- IMAGE }}"
          "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
          "{%- endfor %}{%- endif %}")
_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}" + _PARTS +
             "{{- '<|im_end|>' + '\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT_TEMPLATES = {
    "qwen2_5_vl": _TEMPLATE.replace("IMAGE", "'<|vision_start|><|image_pad|><|vision_end|>'"),
    "idefics3": _TEMPLATE.replace("IMAGE", "'<image>'"),
}


def _tokenizer(out: Path, family: str):
    """The embedded byte-level tokenizer with the family's image tokens added (as special tokens, after the
    embedded ones), loaded back through transformers."""
    from transformers import AutoTokenizer

    write_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    extra = QWEN_IMAGE_TOKENS if family == "qwen2_5_vl" else IDEFICS_IMAGE_TOKENS
    tok.add_special_tokens({"additional_special_tokens": list(extra)})
    tok.pad_token, tok.eos_token = PAD_TOKEN, EOS_TOKEN
    return tok


def _qwen(tok, hidden: int, layers: int, vision_depth: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_IMAGE_TOKENS}
    heads = 4
    half = hidden // heads // 2  # m-RoPE splits each head's rotary half into temporal, height, width sections
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=2, vocab_size=len(tok),
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None),
        vision_config=dict(depth=vision_depth, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=heads,
                           out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=56, fullatt_block_indexes=[vision_depth - 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=None)
    # images of 28x28 to 112x112 pixels: 1 to 16 image tokens each (a token is 2x2 patches of 14x14)
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    return Qwen2_5_VLForConditionalGeneration(config), images


def _idefics(tok, hidden: int, layers: int, vision_depth: int):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    image_size, patch = 32, 8  # 16 patches, 4 image tokens after the 2x pixel shuffle
    config = Idefics3Config(
        text_config=dict(model_type="llama", hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None),
        vision_config=dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=vision_depth,
                           num_attention_heads=4, image_size=image_size, patch_size=patch),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size})
    return Idefics3ForConditionalGeneration(config), images


def build_vlm_dir(out: str | Path, family: str = "qwen2_5_vl", seed: int = 0, hidden: int = 64, layers: int = 2,
                  vision_depth: int = 2) -> Path:
    """A model directory of a tiny `family` vision-language model with seeded random weights and its
    processor files (tokenizer, chat template, image processor). -> the directory."""
    if family not in FAMILIES:
        raise ValueError(f"unknown vision family '{family}'; use one of {', '.join(FAMILIES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out, family)
    torch.manual_seed(seed)
    build = _qwen if family == "qwen2_5_vl" else _idefics
    model, images = build(tok, hidden, layers, vision_depth)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))
    # the processor's files as a model release ships them (written piece by piece: transformers builds a Qwen-VL
    # processor only with a video processor, which needs torchvision; models/processor.py loads them either way)
    tok.save_pretrained(str(out))
    images.save_pretrained(str(out))
    processor = PROCESSORS[family]
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor[0], **processor[1]}, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATES[family])
    return out


__all__ = ["FAMILIES", "SPECIAL_TOKENS", "build_vlm_dir"]
