"""The rollout batch: everything one RL step knows about its N sequences.

N = prompts x n samples, prompt-major (the n samples of a prompt are
adjacent). P = padded prompt length, R = padded response length.

    input_ids       [N, P+R]  prompt (left-padded) then response (right-padded)
    attention_mask  [N, P+R]  1 on real tokens
    position_ids    [N, P+R]  0.. along real tokens
    responses       [N, R]    the response part of input_ids
    response_mask   [N, R]    1 on generated tokens (EOS included)
    group           [N]       prompt index within the step: GRPO's groups
    truncated       [N] bool  the response ran out of tokens before an EOS (None: the engine did not say)
    scores          [N]       the reward function's score of each sequence (before any shaping)
    reward_extras   N dicts   the other numbers a reward function returned beside "score" (GDPO's components)
    reward_baselines [N]      ReMax: the score of the row's prompt's greedy response (else None)
    rollout_log_probs / rollout_is_weights   [N, R]  the engine's log-probs, rollout correction's weights
    weight_versions [N, R]    in-flight weight updates: the weights version that chose each token
    token_level_scores / token_level_rewards / old_log_probs / ref_log_probs / teacher_log_probs (distillation) /
    values (the critic's) / advantages / returns   [N, R], filled in as the step goes
    teacher_topk_log_probs / teacher_topk_ids   [N, R, k]  distillation's top-k modes: the teacher's k likeliest
    vision          N dicts   a vision-language model's rows: each one's image tensors (rollout/vision.py; {} for a
                              row without images; the n samples of a prompt share one dict); [] for a text model

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
    reward_extras: list[dict] = field(default_factory=list)  # per row, a dict return's other numbers ({} if none)
    vision: list[dict] = field(default_factory=list)  # per row, a VLM's image tensors ({}: none); [] for text models
    truncated: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    token_level_scores: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None  # the engine's, of the sampled tokens (rollout.calculate_log_probs)
    rollout_is_weights: torch.Tensor | None = None  # algorithm.rollout_correction's weights of the policy loss
    weight_versions: torch.Tensor | None = None  # in-flight updates: the weights version that chose each token
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None  # on-policy distillation: the teacher's, of the sampled tokens
    teacher_topk_log_probs: torch.Tensor | None = None  # [N, R, k] the top-k modes: the teacher's k likeliest tokens'
    teacher_topk_ids: torch.Tensor | None = None  # [N, R, k] (int32) their ids
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @classmethod
    def from_rollout(cls, out: RolloutOutput, n: int, data_source, ground_truth, extra_info, response_text,
                     vision: list | None = None):
        """Join prompt and response; per-prompt lists (`vision`: each prompt's image tensors, or None) are
        repeated n times."""
        input_ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
        seen = getattr(out, "response_attention_mask", None)  # multi-turn: tool tokens are read, not trained on
        attention_mask = torch.cat([out.prompt_mask, out.response_mask if seen is None else seen], dim=1)
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
            vision=rep(vision) if vision else [],
            truncated=getattr(out, "truncated", None),  # an engine's output without it: not known
            rollout_log_probs=getattr(out, "log_probs", None),
            weight_versions=getattr(out, "weight_versions", None),
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.responses.shape[1]

    @property
    def prompt_width(self) -> int:
        """P: the padded prompt part of input_ids."""
        return self.input_ids.shape[1] - self.response_length

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

    @classmethod
    def concat(cls, parts: list["RolloutBatch"], pad_token_id: int) -> "RolloutBatch":
        """Rows of several batches as one, re-padded to the widest prompt (left)
        and response (right); group ids are renumbered 0.. in order of first
        appearance, with each part's groups distinct from the others'."""
        p_width = max(b.prompt_width for b in parts)
        r_width = max(b.response_length for b in parts)

        def pad(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
            fill = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
            return torch.cat([fill, t] if left else [t, fill], dim=1)

        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            values = [getattr(b, f.name) for b in parts]
            if f.name in ("input_ids", "attention_mask"):
                value = 0 if f.name == "attention_mask" else pad_token_id
                cut = [b.prompt_width for b in parts]
                prompts = [pad(v[:, :c], p_width, value, True) for v, c in zip(values, cut)]
                responses = [pad(v[:, c:], r_width, value, False) for v, c in zip(values, cut)]
                out[f.name] = torch.cat([torch.cat(prompts), torch.cat(responses)], dim=1)
            elif f.name in ("position_ids", "group"):
                continue
            elif all(isinstance(v, torch.Tensor) for v in values):
                if values[0].dim() == 2:  # [N, R] response-shaped
                    value = pad_token_id if f.name == "responses" else 0
                    values = [pad(v, r_width, value, False) for v in values]
                out[f.name] = torch.cat(values)
            elif all(isinstance(v, list) for v in values):
                out[f.name] = [x for v in values for x in v]
            else:
                out[f.name] = None  # missing in some part: not kept
        out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        offsets, ids = 0, []
        for b in parts:
            ids.append(b.group + offsets)
            offsets += int(b.group.max()) + 1 if len(b) else 0
        seen: dict[int, int] = {}
        out["group"] = torch.tensor([seen.setdefault(g, len(seen)) for g in torch.cat(ids).tolist()], dtype=torch.long)
        return cls(**out)
