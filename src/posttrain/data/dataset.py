"""Prompts tokenized with the model's chat template, and the order they are
drawn in."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.errors import DataError


@dataclass
class PromptItem:
    prompt_ids: list[int]
    messages: Any
    data_source: str
    ground_truth: Any
    extra_info: dict
    index: int  # row index in the files as read


def encode_prompt(tokenizer, messages) -> list[int]:
    """Token ids of `messages` through the chat template, ready for the
    assistant's turn. Plain text (a string) or a tokenizer without a chat
    template falls back to the concatenated message contents."""
    if isinstance(messages, str):
        return tokenizer.encode(messages, add_special_tokens=False)
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False)


def _check_messages(messages, i: int, name: str) -> None:
    if isinstance(messages, str):
        return
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise DataError(
            f"{name} row {i}: prompt must be a non-empty list of {{role, content}} messages with string content; "
            "fix the row or re-run the preprocessor"
        )


class PromptDataset:
    def __init__(self, items: list[PromptItem], num_dropped: int = 0):
        self.items = items
        self.num_dropped = num_dropped

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    @classmethod
    def build(cls, rows, tokenizer, max_prompt_length: int, prompt_key: str = "prompt", filter_overlong: bool = True,
              truncation: str = "error", name: str = "train") -> "PromptDataset":
        """Tokenize rows; prompts longer than max_prompt_length are dropped and
        counted (filter_overlong) or else truncated / refused (truncation)."""
        items, dropped = [], 0
        for i, row in enumerate(rows):
            if prompt_key not in row:
                raise DataError(f"{name} data has no column '{prompt_key}'; set data.prompt_key to the prompt column")
            messages = row[prompt_key]
            _check_messages(messages, i, name)
            ids = encode_prompt(tokenizer, messages)
            if len(ids) > max_prompt_length:
                if filter_overlong:
                    dropped += 1
                    continue
                if truncation == "left":
                    ids = ids[-max_prompt_length:]
                elif truncation == "right":
                    ids = ids[:max_prompt_length]
                else:
                    raise DataError(
                        f"{name} row {i} has {len(ids)} prompt tokens, over data.max_prompt_length={max_prompt_length}; "
                        "raise data.max_prompt_length, set data.filter_overlong_prompts=True, or data.truncation=left|right"
                    )
            items.append(PromptItem(ids, messages, row["data_source"], row["reward_model"]["ground_truth"],
                                    row.get("extra_info") or {}, i))
        if dropped:
            print(f"posttrain: dropped {dropped} of {len(rows)} {name} prompts longer than "
                  f"max_prompt_length={max_prompt_length}", file=sys.stderr)
        if not items:
            raise DataError(
                f"{name} dataset is empty after dropping {dropped} prompts longer than data.max_prompt_length="
                f"{max_prompt_length}; raise data.max_prompt_length or check the prompts"
            )
        return cls(items, dropped)


class PromptSampler:
    """Batches of prompt indices, epoch after epoch. Each epoch's order is a
    permutation drawn from (seed, epoch), so a position (epoch, step) always
    names the same prompts: what exact resume needs."""

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if batch_size > num_items and drop_last:
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the {num_items} prompts in the training data; "
                "lower data.train_batch_size or add data"
            )
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_items, generator=g).tolist()

    def next_batch(self) -> tuple[int, list[int]]:
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        batch = self.order(self.epoch)[start:start + self.batch_size]
        self.position += 1
        return self.epoch, batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
