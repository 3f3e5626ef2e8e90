"""What a rollout engine is: prompts in, sampled responses out.

The loop talks to engines only through `RolloutEngine`, so the HF engine
(reference, CPU and GPU) and a vLLM engine (GPU fast path) are swapped by
`rollout.name` without the loop knowing which one runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` or `do_sample=False` means greedy;
    `top_k <= 0` and `top_p >= 1` switch those filters off (vLLM's and verl's
    conventions: verl writes -1 for "no top-k")."""

    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    ignore_eos: bool = False
    logprobs: bool = False  # also return each sampled token's log-prob
    # streamed rollouts (async_training.stream_samples): sample from this seed's stream, not the engine's own, so
    # that a piece of a batch is sampled alike whichever rollout worker takes it; None: the engine's stream
    seed: int | None = None
    # ... with this version of the weights (updates since the start or the resume); None: those the engine holds
    weights_version: int | None = None

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature == 0.0


@dataclass
class RolloutOutput:
    """Responses for N = len(prompts) * n sequences, prompt-major: the n
    samples of prompt i are rows i*n .. i*n+n-1.

    prompt_ids:    [N, P] left-padded with pad_token_id
    prompt_mask:   [N, P] 1 on real prompt tokens
    response_ids:  [N, R] right-padded with pad_token_id (R <= max_new_tokens)
    response_mask: [N, R] 1 on generated tokens, the closing EOS included
    log_probs:     [N, R] log-prob of each sampled token under the sampling
                   distribution at temperature (before top-k/top-p), when
                   asked for with SamplingParams(logprobs=True); else None
    truncated:     [N] bool, True where the response stopped at max_new_tokens
                   without an EOS or stop token (it did not finish); None
                   from an engine that does not say
    response_attention_mask: [N, R] 1 on every real token after the prompt:
                   the generated ones and, in a multi-turn rollout, the tool
                   messages and chat-template tokens between turns, which
                   the model reads but did not generate (response_mask is 0
                   there, so no loss, KL or advantage lands on them); None:
                   the same as response_mask (one generated turn)
    weight_versions: [N, R] with in-flight weight updates (asynchronous
                   training): the version of the weights that chose each
                   token (-1 on padding); None otherwise
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    response_attention_mask: torch.Tensor | None = None
    weight_versions: torch.Tensor | None = None  # [N, R] the weights version that chose each token (in-flight)


def decode_responses(tokenizer, out: RolloutOutput) -> list[str]:
    """Text of each response's generated tokens only (padding is not text)."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(out.response_ids, out.response_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample `params.n` responses for each prompt (token ids, no padding)."""
        ...

    def update_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from `model`'s current weights (an unsharded
        model in the same process)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors under Hugging Face names into the engine's own
        copy of the model (from a sharded trainer: `rollout.weights`)."""
        ...


def mixed_seed(*keys: int) -> int:
    """A seed made from several integers (a run's seed, a step, a piece's index), well apart from the seeds of
    nearby keys: numpy's SeedSequence, 63 bits."""
    import numpy as np

    return int(np.random.SeedSequence([int(k) % 2 ** 64 for k in keys]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def even_chunks(count: int, parts: int) -> list[range]:
    """Consecutive ranges of nearly equal size covering 0..count-1 (some may be empty).
    10, 3 -> [range(0, 4), range(4, 7), range(7, 10)]"""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def concat_rollouts(outs: list[RolloutOutput], pad_token_id: int) -> RolloutOutput:
    """Rollouts of consecutive prompt chunks -> one, re-padded to common widths
    (prompts stay left-padded, responses right-padded)."""
    outs = [o for o in outs if o is not None and o.prompt_ids.shape[0] > 0]
    p_width = max(o.prompt_ids.shape[1] for o in outs)
    r_width = max(o.response_ids.shape[1] for o in outs)

    def pad(t, width, value, left):
        extra = width - t.shape[1]
        if extra == 0:
            return t
        fill = torch.full((t.shape[0], extra), value, dtype=t.dtype)
        return torch.cat([fill, t] if left else [t, fill], dim=1)

    log_probs = None
    if all(o.log_probs is not None for o in outs):
        log_probs = torch.cat([pad(o.log_probs, r_width, 0.0, False) for o in outs])
    truncated = torch.cat([o.truncated for o in outs]) if all(o.truncated is not None for o in outs) else None
    versions = None  # in-flight weight updates: the version that chose each token (-1 on padding)
    if all(o.weight_versions is not None for o in outs):
        versions = torch.cat([pad(o.weight_versions, r_width, -1, False) for o in outs])
    seen = None  # multi-turn rollouts' attention over the responses (tool tokens included)
    if any(o.response_attention_mask is not None for o in outs):
        seen = torch.cat([pad(o.response_mask if o.response_attention_mask is None else o.response_attention_mask,
                              r_width, 0, False) for o in outs])
    return RolloutOutput(
        prompt_ids=torch.cat([pad(o.prompt_ids, p_width, pad_token_id, True) for o in outs]),
        prompt_mask=torch.cat([pad(o.prompt_mask, p_width, 0, True) for o in outs]),
        response_ids=torch.cat([pad(o.response_ids, r_width, pad_token_id, False) for o in outs]),
        response_mask=torch.cat([pad(o.response_mask, r_width, 0, False) for o in outs]),
        log_probs=log_probs,
        truncated=truncated,
        response_attention_mask=seen,
        weight_versions=versions,
    )
