"""The rollout batch: everything one RL step knows about its N sequences.

N = prompts x n samples, prompt-major (the n samples of a prompt are
adjacent). P = padded prompt length, R = padded response length.

    input_ids       [N, P+R]  prompt (left-padded) then response (right-padded)
    attention_mask  [N, P+R]  1 on real tokens
    position_ids    [N, P+R]  0.. along real tokens
    responses       [N, R]    the response part of input_ids
    response_mask   [N, R]    1 on generated tokens (EOS included)
    group           [N]       prompt index within the step: GRPO's groups
    token_level_scores / token_level_rewards / old_log_probs / ref_log_probs /
    advantages / returns   [N, R], filled in as the step goes

Per-sequence Python lists (data_source, ground_truth, extra_info,
response_text) travel alongside and are sliced with the tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.rollout.base import RolloutOutput


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    group: torch.Tensor
    data_source: list[str] = field(default_factory=list)
    ground_truth: list[Any] = field(default_factory=list)
    extra_info: list[Any] = field(default_factory=list)
    response_text: list[str] = field(default_factory=list)
    token_level_scores: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @classmethod
    def from_rollout(cls, out: RolloutOutput, n: int, data_source, ground_truth, extra_info, response_text):
        """Join prompt and response; per-prompt lists are repeated n times."""
        input_ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
        attention_mask = torch.cat([out.prompt_mask, out.response_mask], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        num = out.prompt_ids.shape[0]

        def rep(xs):
            return [x for x in xs for _ in range(n)]

        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            responses=out.response_ids,
            response_mask=out.response_mask,
            group=torch.arange(num) // n,
            data_source=rep(data_source),
            ground_truth=rep(ground_truth),
            extra_info=rep(extra_info),
            response_text=list(response_text),
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.responses.shape[1]

    def select(self, index: torch.Tensor | list[int]) -> "RolloutBatch":
        """Rows `index` of every tensor and list (for mini- and micro-batches)."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value[index]
            elif isinstance(value, list):
                picked[f.name] = [value[i] for i in index.tolist()] if value else []
            else:
                picked[f.name] = value
        return RolloutBatch(**picked)

    def split(self, size: int) -> list["RolloutBatch"]:
        """Consecutive chunks of `size` rows (the last may be shorter)."""
        return [self.select(list(range(s, min(s + size, len(self))))) for s in range(0, len(self), size)]
