"""A vision-language model's extra forward inputs: a prompt's images as the tensors its forward takes, put
together for a batch's rows, and Qwen-VL's 3-D (m-RoPE) positions.

Each prompt with images carries one dict of tensors (what the processor gives for that prompt's images, without
its per-token keys): Qwen2.5-VL `{"pixel_values": [patches, D], "image_grid_thw": [k, 3]}`, Idefics3/SmolVLM
`{"pixel_values": [1, k, 3, H, W], "pixel_attention_mask": [1, k, H, W]}`. A batch's are joined along their
first dimension, in row order (rows without images add nothing), which is how each model finds an image's
features for its image tokens:

    joined = join_vision([{"pixel_values": a, "image_grid_thw": g}, {}, {"pixel_values": b, "image_grid_thw": h}])
    # {"pixel_values": cat([a, b]), "image_grid_thw": cat([g, h])}

Positions: a Qwen-VL language model places image tokens by (time, height, width) and the text after an image
from the largest of them on, so its positions are `[3, B, L]`, computed by the model's own `get_rope_index`
over the whole sequence (prompt and response); the text-only models' `cumsum` of the mask is all others need.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


class ImagePrompt(list):
    """A prompt's token ids (a list, as every engine takes them) with its images: `vision`, the tensors the
    model's forward takes (the HF engine); `images`, the images themselves (engines that run the processor:
    vLLM)."""

    def __init__(self, ids, vision: dict | None = None, images: list | None = None):
        super().__init__(ids)
        self.vision = vision or {}
        self.images = images or []


def prompt_vision(prompts) -> list[dict] | None:
    """The vision dicts of `prompts` (one per prompt, {} for one without), or None when none has images."""
    found = [getattr(p, "vision", None) or {} for p in prompts]
    return found if any(found) else None


def join_vision(rows: list[dict], device=None) -> dict:
    """One forward's vision inputs from its rows' dicts (see the module's docstring), on `device`. A key whose
    rows differ past the first two dimensions (Idefics3's images of different counts or sizes) is padded with
    zeros, which the model takes for no image."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    out = {}
    for key in rows[0]:
        parts = [r[key] for r in rows]
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        parts = [_pad(p, shape) for p in parts]
        joined = torch.cat(parts) if len(parts) > 1 else parts[0]
        out[key] = joined.to(device, non_blocking=True) if device is not None else joined
    return out


def _pad(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    if list(t.shape[1:]) == shape:
        return t
    pad = []
    for have, want in reversed(list(zip(t.shape[1:], shape))):
        pad += [0, want - have]
    return F.pad(t, pad)


def rope_model(model):
    """The module whose `get_rope_index` gives `model`'s 3-D positions (Qwen2-VL, Qwen2.5-VL, ...), or None."""
    if hasattr(model, "get_base_model"):  # peft (LoRA)
        model = model.get_base_model()
    for m in (getattr(model, "model", None), model):
        if m is not None and callable(getattr(m, "get_rope_index", None)):
            return m
    return None


def positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: dict) -> torch.Tensor | None:
    """`model`'s positions of input_ids [B, L] (left or right padded, `attention_mask` [B, L]) whose images
    are `vision` (join_vision's): [3, B, L] for a model with 3-D positions, else None (the caller's 2-D
    positions hold). The model's own rope index, so text and image tokens sit where its pretraining put them."""
    owner = rope_model(model)
    if owner is None:
        return None
    config = owner.config
    kwargs = {"image_grid_thw": vision.get("image_grid_thw"), "video_grid_thw": vision.get("video_grid_thw"),
              "attention_mask": attention_mask}
    params = inspect.signature(owner.get_rope_index).parameters
    if "mm_token_type_ids" in params:  # transformers >= 5.2x: which tokens are image (1) or video (2) tokens
        types = torch.zeros_like(input_ids, dtype=torch.int)
        types = types.masked_fill(input_ids == config.image_token_id, 1)
        if getattr(config, "video_token_id", None) is not None:
            types = types.masked_fill(input_ids == config.video_token_id, 2)
        kwargs["mm_token_type_ids"] = types
    pos, _ = owner.get_rope_index(input_ids, **{k: v for k, v in kwargs.items() if k in params})
    return pos


def vision_forward_kwargs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                          vision: dict) -> dict:
    """The keyword arguments of a VLM forward over input_ids [B, L]: its images' tensors and its positions (3-D
    where the model has them, else `position_ids`). A model whose forward asks for token_type_ids (Gemma 3:
    image tokens attend to each other both ways) gets them from the image tokens."""
    pos = positions(model, input_ids, attention_mask, vision)
    out = {**vision, "position_ids": pos if pos is not None else position_ids}
    image_token = getattr(getattr(model, "config", None), "image_token_id", None)
    if image_token is not None and "token_type_ids" in inspect.signature(model.forward).parameters:
        out["token_type_ids"] = (input_ids == image_token).long()
    return out


def placeholder_ids(owner) -> list[int]:
    """The token ids that stand for an image's or video's features: `owner` is a VLM's config or processor."""
    found = set()
    tokenizer = getattr(owner, "tokenizer", None)
    for kind in ("image", "video"):
        i = getattr(owner, f"{kind}_token_id", None)
        if i is None and tokenizer is not None and isinstance(getattr(owner, f"{kind}_token", None), str):
            i = tokenizer.convert_tokens_to_ids(getattr(owner, f"{kind}_token"))
        if isinstance(i, int) and i >= 0 and (tokenizer is None or i != tokenizer.unk_token_id):
            found.add(i)
    return sorted(found)


def end_at_placeholders(out, token_ids: list[int], pad_token_id: int) -> int:
    """A response that samples an image placeholder token (a random or young model may) ends before it, as a
    truncated response: the token has no image features behind it, so the training forward could not take it
    (the model counts its image tokens against its images). `out`: a RolloutOutput, changed in place.
    -> the number of responses cut."""
    if not token_ids or out.response_ids.numel() == 0:
        return 0
    hit = torch.isin(out.response_ids, torch.tensor(token_ids)) & (out.response_mask != 0)  # [N, R]
    cut_rows = hit.any(-1)
    if not bool(cut_rows.any()):
        return 0
    after = hit.int().cumsum(-1) > 0  # the placeholder and everything after it
    out.response_ids.masked_fill_(after, pad_token_id)
    out.response_mask.masked_fill_(after, 0)
    if out.log_probs is not None:
        out.log_probs.masked_fill_(after, 0.0)
    if out.response_attention_mask is not None:
        out.response_attention_mask.masked_fill_(after, 0)
    if out.weight_versions is not None:
        out.weight_versions.masked_fill_(after, -1)
    if out.truncated is not None:
        out.truncated |= cut_rows
    return int(cut_rows.sum())
