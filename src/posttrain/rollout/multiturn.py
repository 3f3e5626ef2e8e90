"""Multi-turn rollouts with tools: the model answers, or calls a tool in
hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
reads the tool's answer as a `tool` message and goes on, until it answers
without a call, reaches `max_assistant_turns`, or the response (every token
after the prompt, all turns) reaches `max_response_length`.

    out, trajectories = rollout_with_tools(actor.generate, tokenizer, prompt_ids, prompt_messages, params,
                                           tools, contexts, settings)   # settings: limits, template kwargs, EOS

The response of a row is its turns' tokens in order: what the model
generated (response_mask 1) and, between turns, the tool messages and the
chat template's tokens around them (response_mask 0,
response_attention_mask 1), so training reads them but puts no loss, KL or
advantage on them. The generated tokens are kept as sampled (never
re-tokenized); what comes between turns is the chat template's own
rendering of the tool messages: the text the template adds after the
assistant turn, tokenized. Malformed calls, unknown tools and tool errors
become a tool message saying so (counted), never a failure of the rollout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from posttrain.rollout.base import RolloutOutput, SamplingParams


@dataclass(frozen=True)
class MultiTurnSettings:
    max_assistant_turns: int = 5  # verl's rollout.multi_turn.max_assistant_turns
    max_tool_response_length: int = 256  # tokens of one tool message's content (longer: cut, marked)
    max_response_length: int = 512  # every token after the prompt, all turns together (data.max_response_length)
    template_kwargs: dict = field(default_factory=dict)  # the chat template's extra arguments (tools=, ...)
    eos_token_ids: tuple = ()  # the tokens that end a turn


@dataclass
class Trajectory:
    """One row's conversation after its prompt, and its counts."""

    messages: list = field(default_factory=list)  # assistant and tool messages, in order
    turns: int = 0  # assistant turns
    tool_calls: list = field(default_factory=list)  # {"name", "arguments", "content", "error"} per call
    malformed: int = 0  # tool calls that could not be read
    generated_tokens: int = 0
    tool_tokens: int = 0  # tool messages and template tokens between turns
    ended: str = ""  # answer | max_turns | length

    @property
    def answer(self) -> str:
        """The last assistant message's text: what the reward judges."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    @property
    def tool_errors(self) -> int:
        return self.malformed + sum(1 for c in self.tool_calls if c["error"] is not None)


def rollout_with_tools(generate: Callable, tokenizer, prompts: list[list[int]], prompt_messages: list[list[dict]],
                       params: SamplingParams, tools, contexts: list[dict], settings: MultiTurnSettings
                       ) -> tuple[RolloutOutput, list[Trajectory]]:
    """`generate(prompts, params) -> RolloutOutput` samples (the actor's verb); `prompts` are the token ids
    of `prompt_messages` as the chat template gave them (with settings.template_kwargs); `tools` a
    posttrain.tools.ToolSet; `contexts[i]` what prompt i's tools may see (ground_truth, extra_info,
    data_source). -> the rows' RolloutOutput (prompt-major, params.n per prompt) and their trajectories."""
    from posttrain.tools import parse_tool_calls

    # One piece on purpose (a few lines over 60): the turn loop (generate, parse calls, run the tools, append
    # their messages, stop) reads as the conversation it builds.
    n, limit = params.n, settings.max_response_length
    first = generate(prompts, dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, limit)))
    rows = first.response_ids.shape[0]
    seq = [[] for _ in range(rows)]  # each row's response tokens so far
    gen = [[] for _ in range(rows)]  # 1: generated, 0: a tool message or template tokens
    logp = [[] for _ in range(rows)]
    trajs = [Trajectory() for _ in range(rows)]
    truncated = [False] * rows
    eos = set(settings.eos_token_ids)
    active, out = list(range(rows)), first
    while active:
        going = []
        for j, i in enumerate(active):
            keep = out.response_mask[j].bool()
            room = limit - len(seq[i])  # a row's own budget (the batch was sampled with the largest)
            tokens = out.response_ids[j][keep].tolist()[:room]
            seq[i] += tokens
            gen[i] += [1] * len(tokens)
            logp[i] += out.log_probs[j][keep].tolist()[:room] if out.log_probs is not None else [0.0] * len(tokens)
            t = trajs[i]
            t.turns += 1
            t.generated_tokens += len(tokens)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            t.messages.append({"role": "assistant", "content": text})
            calls, malformed = parse_tool_calls(text)
            finished = bool(tokens) and tokens[-1] in eos
            if not calls and not malformed:
                t.ended = "answer" if finished else "length"
                truncated[i] = not finished
                continue
            if not finished or len(seq[i]) >= limit:
                t.ended, truncated[i] = "length", True
                continue
            if t.turns >= settings.max_assistant_turns:
                t.ended = "max_turns"
                continue
            replies = tool_messages(tools, calls, malformed, contexts[i // n], t, tokenizer,
                                    settings.max_tool_response_length)
            between = continuation_ids(tokenizer, prompt_messages[i // n] + t.messages, replies,
                                       settings.template_kwargs, tokens[-1])
            if len(seq[i]) + len(between) >= limit:  # no room left for the model to read the answer and go on
                t.ended, truncated[i] = "length", True
                continue
            t.messages += replies
            seq[i] += between
            gen[i] += [0] * len(between)
            logp[i] += [0.0] * len(between)
            t.tool_tokens += len(between)
            going.append(i)
        active = going
        if active:
            budget = max(limit - len(seq[i]) for i in active)
            out = generate([prompts[i // n] + seq[i] for i in active],
                           dataclasses.replace(params, n=1, max_new_tokens=budget))
    return assemble(first, seq, gen, logp if first.log_probs is not None else None, truncated,
                    tokenizer.pad_token_id), trajs


def tool_messages(tools, calls, malformed: list[str], context: dict, t: Trajectory, tokenizer,
                  max_tokens: int) -> list[dict]:
    """The tool messages answering one assistant turn: one per call (the tool's output or what went
    wrong), one per malformed call; each content cut to `max_tokens` tokens."""
    replies = []
    for result, call in zip(tools.run(calls, context), calls):
        t.tool_calls.append({"name": call.name, "arguments": call.arguments, "content": result.content,
                             "error": result.error})
        replies.append({"role": "tool", "name": call.name, "content": cut(result.content, tokenizer, max_tokens)})
    for why in malformed:
        t.malformed += 1
        replies.append({"role": "tool", "content": cut(f"error: malformed tool call: {why}", tokenizer, max_tokens)})
    return replies


def cut(text: str, tokenizer, max_tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + " ...(cut)"


def continuation_ids(tokenizer, messages: list[dict], replies: list[dict], template_kwargs: dict,
                     last_token: int) -> list[int]:
    """The tokens between an assistant turn the model ended with `last_token` (its end-of-turn token) and
    the next assistant turn: what the chat template puts after that token (e.g. a newline), the tool
    messages, and the next assistant turn's opening. Both renderings are the template's own, so the
    conversation reads as the template would write it."""
    before = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    after = tokenizer.apply_chat_template(messages + replies, tokenize=False, add_generation_prompt=True,
                                          **template_kwargs)
    if not after.startswith(before):
        raise ValueError("the chat template writes the earlier turns differently once tool messages follow; "
                         "multi-turn rollouts need a template that renders a conversation turn by turn")
    end = tokenizer.decode([last_token])
    tail = before[before.rfind(end) + len(end):] if end and end in before else ""
    return tokenizer.encode(tail + after[len(before):], add_special_tokens=False)


def assemble(first: RolloutOutput, seq, gen, logp, truncated, pad_token_id: int) -> RolloutOutput:
    """The rows' turns as one RolloutOutput: responses right-padded to the longest."""
    rows, width = len(seq), max([len(s) for s in seq] + [1])
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    seen = torch.zeros((rows, width), dtype=torch.long)
    probs = torch.zeros((rows, width)) if logp is not None else None
    for i in range(rows):
        k = len(seq[i])
        ids[i, :k] = torch.tensor(seq[i], dtype=torch.long)
        mask[i, :k] = torch.tensor(gen[i], dtype=torch.long)
        seen[i, :k] = 1
        if probs is not None:
            probs[i, :k] = torch.tensor(logp[i])
    return RolloutOutput(first.prompt_ids, first.prompt_mask, ids, mask, probs,
                         torch.tensor(truncated, dtype=torch.bool), response_attention_mask=seen)
