"""In-flight weight updates for the vLLM engine: partial rollout, as verl's `partial_rollout` does it.

With a weights hook set (asynchronous training with `async_training.in_flight_weight_updates=true`:
rollout/remote.py's InFlight), `VLLMRolloutEngine.generate` drives vLLM's engine itself, one step at a
time, instead of `LLM.generate`. Each prompt's n samples are n requests of one sample each (prompt-major).
Between two steps, when new weights wait (`weights_pending()`, which loads nothing), every unfinished request
is aborted and keeps the tokens (and log-probs) it has sampled so far; the hook loads the new weights (which
resets vLLM's prefix cache: nothing computed with the old weights is used again), and each request is added
again with its prompt and its tokens so far as the prompt, and `max_tokens` less what it has. The response is
the concatenation. The tokens of a resumed request are computed from a new prefill under the new weights
(verl's way; the hf engine instead keeps the key/value cache of the tokens before).

Each token is tagged with the version of the weights that sampled it (`RolloutOutput.weight_versions`, -1 on
padding), as the hf engine tags them. The hook is also called once before the first request, as the hf
engine calls it before its first forward. Stop tokens and truncation are those of `LLM.generate`'s path
(vllm.completion_row). Prompts with images are refused here (the hf engine takes them in flight).

vLLM's API used (vLLM 0.32): `LLM.llm_engine` (v1 `LLMEngine`): add_request, step, abort_request; sampling
parameters with `output_kind=RequestOutputKind.DELTA` (each step's new tokens and their log-probs).
"""

from __future__ import annotations

import itertools

from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.vllm_output import completion_row, rows_to_output, sampled_logprobs, sampling_kwargs

_calls = itertools.count()  # request ids unique over the process's generate calls


class Sample:
    """One sample's tokens so far, over its requests (one per weights version it has seen)."""

    __slots__ = ("ids", "lps", "versions", "finish_reason", "stop_reason")

    def __init__(self):
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.versions: list[int] = []
        self.finish_reason = self.stop_reason = None


def generate_partial(engine, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> RolloutOutput:
    """`engine` (a VLLMRolloutEngine with a weights hook) samples `params.n` responses for each prompt, loading
    new weights between two steps as they come (module docstring). `seed`: the call's, or None (vLLM's CPU
    build): sample j of a prompt takes seed + j, as vLLM's own fan-out of n samples gives them, and each
    resumption another."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if any(getattr(p, "images", None) or getattr(p, "vision", None) for p in prompts):
        raise ValueError("rollout.name=vllm takes in-flight weight updates for text prompts only: set "
                         "async_training.in_flight_weight_updates=false or rollout.name=hf for prompts with images")
    if engine.weights_pending is None:
        raise ValueError("a weights hook needs weights_pending too (whether new weights wait, loading nothing)")
    core = engine.llm.llm_engine
    if core.has_unfinished_requests():
        raise RuntimeError("vLLM's engine has unfinished requests of another caller: a partial rollout aborts "
                           "every request at a weight update")
    render = getattr(engine.llm, "_preprocess_cmpl_one", None)  # LLM.generate's own rendering of a prompt
    n, call = params.n, next(_calls)
    base = {**sampling_kwargs(params, engine.eos_token_ids, seed), "n": 1, "output_kind": RequestOutputKind.DELTA}
    samples = [Sample() for _ in range(len(prompts) * n)]
    running: dict[str, int] = {}  # request id -> its sample's row
    rounds = itertools.count()

    def add_all(rows) -> int:
        """Add a request for each of `rows` with what it has sampled so far; -> the weights version they run."""
        r = next(rounds)
        for i in rows:
            s = samples[i]
            left = params.max_new_tokens - len(s.ids)
            if left <= 0:
                s.finish_reason = "length"
                continue
            request_seed = None if seed is None else seed + i % n + r * n
            sp = VSamplingParams(**{**base, "max_tokens": left, "seed": request_seed})
            prompt = engine.tokens_prompt([*prompts[i // n], *s.ids])
            rid = f"posttrain-{call}-{i}-{r}"
            core.add_request(rid, render(prompt) if render is not None else prompt, sp,
                             lora_request=engine.lora_request)
            running[rid] = i
        return engine.weights_version

    engine.weights_hook()  # before the first forward, as the hf engine
    try:
        version = add_all(range(len(samples)))
        while running:
            if engine.weights_pending():
                rows = sorted(running.values())
                core.abort_request(list(running))
                running.clear()
                engine.weights_hook()  # new weights; vLLM's prefix cache reset (VLLMRolloutEngine.load_weights)
                version = add_all(rows)
                continue
            for out in core.step():
                i = running.get(out.request_id)
                if i is None:
                    continue
                s, c = samples[i], out.outputs[0]
                ids = list(c.token_ids)
                s.ids += ids
                s.lps += sampled_logprobs(c, params.logprobs)
                s.versions += [version] * len(ids)
                if out.finished:
                    s.finish_reason, s.stop_reason = c.finish_reason, getattr(c, "stop_reason", None)
                    del running[out.request_id]
    finally:
        if running:  # an error: leave vLLM's engine without our requests
            core.abort_request(list(running))
    rows = [completion_row(s.ids, s.lps, s.finish_reason, s.stop_reason, params.logprobs, s.versions)
            for s in samples]
    return rows_to_output(rows, prompts, n, engine.pad_token_id, params.logprobs)
