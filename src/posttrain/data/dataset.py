"""Prompts tokenized with the model's chat template, and the order they are
drawn in.

    rows = read_rows("train.parquet")
    data = PromptDataset.build(rows, tokenizer, max_prompt_length=512)
    # a vision-language model: its processor, the rows' images under data.image_key (data/images.py)
    data = PromptDataset.build(rows, processor.tokenizer, 512, processor=processor)
    sampler = PromptSampler(len(data), batch_size=32, seed=0)
    epoch, indices = sampler.next_batch()           # 32 indices into data
    prompts = [data[i].prompt_ids for i in indices]  # list[list[int]], unpadded
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.data.images import encode_vision_prompt, image_token_count, refuse_videos, row_images
from posttrain.data.prompts import PromptTemplates
from posttrain.data.schema import check_row, describe_skipped
from posttrain.errors import DataError

TRUNCATION_MODES = ("error", "left", "right")
_warned_no_template: set[str] = set()


@dataclass
class PromptItem:
    prompt_ids: list[int]  # chat template applied, ending with the assistant turn's opening
    messages: Any  # the row's prompt as stored: list[{role, content}] (or a plain string); templated when asked
    data_source: str
    ground_truth: Any  # str, or a dict such as countdown's {target, numbers}
    extra_info: dict = field(default_factory=dict)
    index: int = 0  # row index in the files as read (concatenated)
    # the row's images as stored (undecoded: a large dataset holds no pixels), None for a text-only prompt;
    # data.images decodes them (decode_image) and makes the model's tensors (vision_inputs)
    images: list | None = None


def encode_prompt(tokenizer, messages, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` through the chat template, ready for the
    assistant's turn (add_generation_prompt=True). `template_kwargs` are
    handed to the template (data.apply_chat_template_kwargs: Qwen3's
    enable_thinking=false, gpt-oss's reasoning_effort=medium).

    A tokenizer without a chat template (a base model) gets the message
    contents joined by newlines, with a one-time warning; a plain string is
    encoded as it is. transformers 5 returns a BatchEncoding from
    apply_chat_template(tokenize=True), 4.x a list: both give a list[int].
    """
    if isinstance(messages, str):
        return list(tokenizer.encode(messages, add_special_tokens=False))
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]
    _warn_no_template(tokenizer)
    return list(tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False))


def _warn_no_template(tokenizer) -> None:
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    if name not in _warned_no_template:
        _warned_no_template.add(name)
        print(f"posttrain: warning: tokenizer '{name}' has no chat template; prompts are the message contents "
              "joined by newlines (fine for a base model, wrong for a chat model)", file=sys.stderr)


def _fit(ids: list[int], max_len: int, truncation: str, i: int, name: str, image_tokens: int = 0) -> list[int]:
    """ids cut to max_len tokens as `truncation` says, or a DataError. A prompt with images (`image_tokens` of its
    ids) is never cut: a cut through an image's tokens leaves the model a part of an image, and one that keeps
    them whole still moves where the images sit against the text the placeholders put them in."""
    if image_tokens:
        raise DataError(
            f"{name} row {i} has {len(ids)} prompt tokens ({image_tokens} of them its images' tokens, which count), "
            f"over data.max_prompt_length={max_len}; a prompt with images is not cut (data.truncation={truncation}): "
            "raise data.max_prompt_length, set data.filter_overlong_prompts=True, or use smaller images"
        )
    if truncation == "left":  # keep the end: the question and the assistant's opening
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    raise DataError(
        f"{name} row {i} has {len(ids)} prompt tokens, over data.max_prompt_length={max_len}; "
        "raise data.max_prompt_length, set data.filter_overlong_prompts=True, or data.truncation=left|right"
    )


class PromptDataset:
    """Tokenized prompts: `len(data)`, `data[i] -> PromptItem`,
    `num_dropped`, the prompts left out for being too long, and
    `num_invalid`, the rows skipped as unusable (by read_rows and by build)."""

    def __init__(self, items: list[PromptItem], num_dropped: int = 0, num_invalid: int = 0):
        self.items = items
        self.num_dropped = num_dropped
        self.num_invalid = num_invalid

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    @classmethod
    def build(cls, rows: list[dict], tokenizer, max_prompt_length: int, prompt_key: str = "prompt",
              filter_overlong: bool = True, truncation: str = "error", name: str = "train",
              template_kwargs: dict | None = None, templates: PromptTemplates | None = None, processor=None,
              image_key: str = "images", video_key: str = "videos") -> PromptDataset:
        """Tokenize rows (as read_rows gives them). A prompt over
        max_prompt_length tokens is dropped and counted (filter_overlong, as
        verl's filter_overlong_prompts), else cut (truncation left|right) or
        refused (truncation error). A row that schema.check_row refuses, or
        whose prompt the tokenizer refuses or makes 0 tokens of, is skipped
        and counted, with one warning line; no usable row is a DataError.
        Items keep the rows' indices (read_rows' `indices`, else 0, 1, ...).
        `templates` (data.prompt_file / data.system_prompt_file, see
        data.prompts) rewrite each usable row's messages before tokenizing.

        With a vision-language model's `processor`, each prompt's ids are its full call's (data.images'
        encode_vision_prompt): the rows' images (under `image_key`, or TRL's `image`) are decoded and their tokens
        count against max_prompt_length; a prompt with images is dropped when over it (filter_overlong) and never
        cut (a DataError); a row whose images do not decode or do not match its <image> placeholders is skipped
        and counted as above. Without a processor a row with images is a DataError (a text-only model); a row with
        videos (`video_key`) is one either way.

            build(rows, tok, 30)   # 3 rows, one of 40 tokens -> len 2, num_dropped 1
            build(rows, processor.tokenizer, 512, processor=processor)   # items' images: the rows' as stored
        """
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATION_MODES)}; pick one")
        if rows and not any(isinstance(row, dict) and prompt_key in row for row in rows):
            raise DataError(f"{name} data has no column '{prompt_key}'; set data.prompt_key to the prompt column")
        indices = getattr(rows, "indices", None)
        if indices is None or len(indices) != len(rows):
            indices = range(len(rows))
        items, dropped, skipped = [], 0, []
        for i, row in zip(indices, rows):
            refuse_videos(row, video_key, f"{name} row {i}")
            images = row_images(row, image_key)
            if images and processor is None:
                raise DataError(f"{name} row {i} has images in its '{image_key}' column (data.image_key), but the "
                                "model is text-only: point model.path at a vision-language model (e.g. Qwen2.5-VL) "
                                "or drop the column")
            reason = check_row(row, prompt_key)
            if reason is None:
                messages = templates.apply(row[prompt_key], row.get("extra_info")) if templates else row[prompt_key]
                ids, reason = _encode_row(tokenizer, messages, template_kwargs, processor, images)
            if reason is not None:
                skipped.append((i, reason))
                continue
            if len(ids) > max_prompt_length:
                if filter_overlong:
                    dropped += 1
                    continue
                ids = _fit(ids, max_prompt_length, truncation, i, name,
                           image_token_count(processor, ids) if images else 0)
            items.append(PromptItem(ids, messages, row["data_source"], row["reward_model"]["ground_truth"],
                                    row.get("extra_info") or {}, i, images or None))
        if dropped:
            counted = " (image tokens included)" if processor is not None else ""
            print(f"posttrain: dropped {dropped} of {len(rows)} {name} prompts longer than "
                  f"max_prompt_length={max_prompt_length}{counted}", file=sys.stderr)
        if skipped and items:
            print(f"posttrain: warning: {describe_skipped(skipped, len(rows), f'{name} rows')}; fix or drop them",
                  file=sys.stderr)
        if not items and skipped:
            overlong = f" and dropped {dropped} longer than data.max_prompt_length" if dropped else ""
            raise DataError(f"{name} dataset has no usable row: {describe_skipped(skipped, len(rows), 'rows')}"
                            f"{overlong}; fix or drop the rows")
        if not items:
            raise DataError(
                f"{name} dataset is empty after dropping {dropped} prompts longer than data.max_prompt_length="
                f"{max_prompt_length}; raise data.max_prompt_length or check the prompts"
            )
        return cls(items, dropped, getattr(rows, "num_invalid", 0) + len(skipped))


def _encode_row(tokenizer, messages, template_kwargs: dict | None = None, processor=None,
                images: list | None = None) -> tuple[list[int], str | None]:
    """-> (prompt ids, None), or ([], why the prompt cannot be used). With a processor: its full call on the
    prompt and its images (an image that does not decode, or placeholders that do not match: the reason)."""
    try:
        if processor is not None:
            ids = encode_vision_prompt(processor, messages, images or [], template_kwargs)
        else:
            ids = encode_prompt(tokenizer, messages, template_kwargs)
    except DataError as e:  # data.images' own: one line naming the image or the placeholders, and the fix
        return [], str(e)
    except Exception as e:  # noqa: BLE001 - a chat template may refuse one row (raise_exception("roles must alternate"))
        text = (str(e).strip().splitlines() or [""])[0][:120]
        who = "processor" if processor is not None else "tokenizer"
        return [], f"the {who} refused the prompt ({type(e).__name__}: {text})"
    if not ids:  # e.g. a plain-string prompt of characters the tokenizer drops, and no chat template
        return [], "the prompt is 0 tokens long"
    return ids, None


class PromptSampler:
    """Batches of prompt indices, epoch after epoch.

    Each epoch's order is a permutation drawn from (seed, epoch) alone, so a
    position (epoch, step) always names the same prompts: saving
    `state_dict()` and loading it into a fresh sampler resumes exactly.

        s = PromptSampler(10, 4, seed=1)    # steps_per_epoch == 2 (drop_last)
        s.next_batch()                      # (0, [4 indices]); then (0, ...), (1, ...), ...
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if batch_size < 1:
            raise DataError(f"data.train_batch_size={batch_size} must be at least 1; raise it")
        if batch_size > num_items and drop_last:
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the {num_items} prompts in the training data; "
                "lower data.train_batch_size or add data"
            )
        if num_items < 1:
            raise DataError("the training data holds no prompts; check data.train_files")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0  # position: batches already taken from this epoch
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def order(self, epoch: int) -> list[int]:
        """The epoch's permutation of range(num_items)."""
        if not self.shuffle:
            return list(range(self.num_items))
        if self._order is None or self._order[0] != epoch:
            # a generator of its own: the global torch RNG (model init, sampling) stays untouched
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.num_items, generator=g).tolist())
        return self._order[1]

    def next_batch(self) -> tuple[int, list[int]]:
        """-> (epoch, indices): the next batch, moving to the next epoch when
        this one is used up."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        batch = self.order(self.epoch)[start:start + self.batch_size]
        self.position += 1
        return self.epoch, list(batch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_items": self.num_items, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_items", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"the saved data order was for {key}={state[key]}, this run has {getattr(self, key)}; "
                    "resume with the same data and data.train_batch_size, or start a new run"
                )
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._order = None
