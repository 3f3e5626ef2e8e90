"""vLLM's answers as posttrain's: our SamplingParams as vLLM's keyword arguments, vLLM's completions (of
`LLM.generate`, or a partial rollout's pieces: rollout/vllm_partial.py) as a RolloutOutput with the stop tokens
and truncation the hf engine gives, and the check that vLLM expanded a prompt's images into the HF processor's
tokens. No vLLM import: it reads vLLM's outputs by their fields."""

from __future__ import annotations

import torch

from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.hf import left_pad


def sampling_kwargs(params: SamplingParams, eos_token_ids: list[int], seed: int | None) -> dict:
    """Our SamplingParams -> keyword arguments of `vllm.SamplingParams`.

    vLLM stops on the model's EOS by itself; `stop_token_ids` adds the
    generation config's others (Qwen's <|im_end|>). `logprobs=0` returns the
    sampled token's log-prob only. top_k -1 and top_p 1 mean "off" in vLLM.
    """
    return {
        "n": params.n,
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "logprobs": 0 if params.logprobs else None,
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": [] if params.ignore_eos else list(eos_token_ids),
        "seed": seed,
        "detokenize": False,
    }


def to_rollout_output(request_outputs, prompts: list[list[int]], n: int, pad_token_id: int,
                      eos_token_ids: list[int], want_logprobs: bool) -> RolloutOutput:
    """vLLM RequestOutputs (one per prompt, n completions each) -> RolloutOutput, prompt-major."""
    rows = []
    for req in request_outputs:
        if len(req.outputs) != n:
            raise RuntimeError(f"vLLM returned {len(req.outputs)} completions for a prompt, expected {n}")
        for c in req.outputs:
            rows.append(completion_row(list(c.token_ids), sampled_logprobs(c, want_logprobs), c.finish_reason,
                                       getattr(c, "stop_reason", None), want_logprobs))
    return rows_to_output(rows, prompts, n, pad_token_id, want_logprobs)


def completion_row(ids: list[int], lps: list[float], finish_reason, stop_reason, want_logprobs: bool,
                   versions: list[int] | None = None) -> tuple:
    """One completion's token ids, log-probs (and weights versions) -> (ids, log-probs, truncated, versions). A
    completion that stopped on an EOS or stop token ends with that token exactly once (vLLM leaves a stop token
    out of `token_ids` when it detokenizes); the token added takes the last token's version. A completion whose
    finish_reason is "length" is `truncated`."""
    if finish_reason == "stop" and isinstance(stop_reason, int) and (not ids or ids[-1] != stop_reason):
        ids.append(stop_reason)  # stopped on a stop_token_id: keep it, as the HF engine does
        if want_logprobs:
            lps.append(0.0)  # vLLM reports no log-prob for a stop token it leaves out
        if versions is not None:
            versions.append(versions[-1] if versions else -1)
    return ids, lps, finish_reason == "length", versions


def rows_to_output(rows: list[tuple], prompts: list[list[int]], n: int, pad_token_id: int,
                   want_logprobs: bool) -> RolloutOutput:
    """completion_row's rows (prompt-major, n per prompt) -> RolloutOutput; `weight_versions` when the rows carry
    versions (-1 on padding)."""
    expanded = [p for p in prompts for _ in range(n)]
    prompt_ids, prompt_mask = left_pad(expanded, pad_token_id, max(len(p) for p in expanded))
    width = max(1, max(len(ids) for ids, *_ in rows))
    response_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # [N, R]
    response_mask = torch.zeros((len(rows), width), dtype=torch.long)
    log_probs = torch.zeros((len(rows), width), dtype=torch.float32) if want_logprobs else None
    tagged = bool(rows) and rows[0][3] is not None
    versions = torch.full((len(rows), width), -1, dtype=torch.long) if tagged else None
    for i, (ids, lps, _, vers) in enumerate(rows):
        if ids:
            response_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            response_mask[i, :len(ids)] = 1
            if log_probs is not None:
                log_probs[i, :len(ids)] = torch.tensor(lps, dtype=torch.float32)
            if versions is not None:
                versions[i, :len(ids)] = torch.tensor(vers, dtype=torch.long)
    return RolloutOutput(prompt_ids, prompt_mask, response_ids, response_mask, log_probs,
                         torch.tensor([cut for _, _, cut, _ in rows], dtype=torch.bool), weight_versions=versions)


def check_expanded_prompts(request_outputs, prompts) -> None:
    """vLLM's expansion of each prompt with images is the prompt's own ids (the HF processor's), token for token:
    else its samples would continue another prompt than the one the training passes score."""
    for i, (req, p) in enumerate(zip(request_outputs, prompts)):
        if getattr(p, "images", None) and list(req.prompt_token_ids or []) != list(p):
            got = list(req.prompt_token_ids or [])
            raise RuntimeError(f"vLLM expanded prompt {i}'s images into other tokens than the HF processor "
                               f"({len(got)} tokens, not {len(p)}): its image processor resized them otherwise "
                               "(check preprocessor_config.json's min/max pixels and vLLM's mm_processor_kwargs)")


def sampled_logprobs(completion, want: bool) -> list[float]:
    """Log-prob of each sampled token (`logprobs` is a list of {token id: Logprob})."""
    if not want:
        return []
    return [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs or [])]
