"""Multi-turn rollouts, one turn loop (`converse`) for two kinds of other side:

- tools (ToolTurns): the model answers, or calls a tool in hermes format
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), reads the
  tool's answer as a `tool` message and goes on, until it answers without a
  call;
- an environment (EnvTurns, posttrain.envs): every finished turn is its
  action; it answers with messages and a reward, until it says done;

either way until `max_assistant_turns`, or the response (every token after
the prompt, all turns) reaches `max_response_length`.

    out, trajectories = rollout_with_tools(actor.generate, tokenizer, prompt_ids, prompt_messages, params,
                                           tools, contexts, settings)   # settings: limits, template kwargs, EOS
    out, trajectories, sessions = rollout_with_env(actor.generate, tokenizer, prompt_messages, params, pool, rows,
                                                   settings)            # each sample its own conversation

The response of a row is its turns' tokens in order: what the model
generated (response_mask 1) and, between turns, the tool messages and the
chat template's tokens around them (response_mask 0,
response_attention_mask 1), so training reads them but puts no loss, KL or
advantage on them. The generated tokens are kept as sampled (never
re-tokenized); what comes between turns is the chat template's own
rendering of the tool messages: the text the template adds after the
assistant turn, tokenized. Malformed calls, unknown tools and tool errors
become a tool message saying so (counted), never a failure of the rollout;
an environment's failure ends its own conversation (envs.pool).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from posttrain.data.dataset import encode_prompt
from posttrain.rollout.base import RolloutOutput, SamplingParams


@dataclass(frozen=True)
class MultiTurnSettings:
    max_assistant_turns: int = 5  # verl's rollout.multi_turn.max_assistant_turns
    max_tool_response_length: int = 256  # tokens of one tool message's content (longer: cut, marked)
    max_response_length: int = 512  # every token after the prompt, all turns together (data.max_response_length)
    max_prompt_length: int | None = None  # an environment's first messages, tokenized (data.max_prompt_length)
    max_user_turns: int | None = None  # an environment's answers at most (verl's max_user_turns); None: no limit
    template_kwargs: dict = field(default_factory=dict)  # the chat template's extra arguments (tools=, ...)
    eos_token_ids: tuple = ()  # the tokens that end a turn


@dataclass
class Trajectory:
    """One row's conversation after its prompt, and its counts."""

    messages: list = field(default_factory=list)  # assistant and tool / user messages, in order
    turns: int = 0  # assistant turns
    tool_calls: list = field(default_factory=list)  # {"name", "arguments", "content", "error"} per call
    malformed: int = 0  # tool calls that could not be read
    generated_tokens: int = 0
    tool_tokens: int = 0  # tool / environment messages and template tokens between turns
    ended: str = ""  # answer | done | max_turns | length | env_error
    rewards: list = field(default_factory=list)  # an environment's reward for each turn it answered
    infos: list = field(default_factory=list)  # its info for each turn
    env_error: str | None = None  # why the environment failed this conversation

    @property
    def answer(self) -> str:
        """The last assistant message's text: what the reward judges."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    @property
    def tool_errors(self) -> int:
        return self.malformed + sum(1 for c in self.tool_calls if c["error"] is not None)


class ToolTurns:
    """Tools as the other side of the conversation: a turn without a tool call is the answer (the end); a turn
    with calls gets one tool message per call (rollout_with_tools)."""

    def __init__(self, tools, contexts: list[dict], n: int, tokenizer, max_tool_tokens: int):
        self.tools, self.contexts, self.n, self.tokenizer, self.max_tokens = tools, contexts, n, tokenizer, max_tool_tokens

    def respond(self, rows: list[int], texts: list[str], trajs: list[Trajectory], room: list[bool],
                turns_left: list[bool]) -> list[tuple[list[dict], bool, str]]:
        """-> per row (messages, done, how it ended)."""
        from posttrain.tools import parse_tool_calls

        out = []
        for i, text, t, more_room, more_turns in zip(rows, texts, trajs, room, turns_left):
            calls, malformed = parse_tool_calls(text)
            if not calls and not malformed:
                out.append(([], True, "answer"))
            elif not more_room:
                out.append(([], True, "length"))
            elif not more_turns:
                out.append(([], True, "max_turns"))
            else:
                out.append((tool_messages(self.tools, calls, malformed, self.contexts[i // self.n], t, self.tokenizer,
                                          self.max_tokens), False, ""))
        return out


class EnvTurns:
    """An environment as the other side (posttrain.envs): every finished turn is its action; its reward is kept
    per turn; it ends the conversation (done), or the turns or the length run out after it answered."""

    def __init__(self, pool, sessions, tokenizer, max_tokens: int, max_user_turns: int | None = None):
        self.pool, self.sessions, self.tokenizer, self.max_tokens = pool, sessions, tokenizer, max_tokens
        self.max_user_turns = max_user_turns

    def respond(self, rows, texts, trajs, room, turns_left):
        steps = self.pool.step([self.sessions[i] for i in rows], texts)
        out = []
        for i, step, t, more_room, more_turns in zip(rows, steps, trajs, room, turns_left):
            s = self.sessions[i]
            if s.failed:
                t.env_error = s.error
                out.append(([], True, "env_error"))
                continue
            t.rewards.append(step.reward)
            t.infos.append(step.info)
            messages = [{**m, "content": cut(m["content"], self.tokenizer, self.max_tokens)} for m in step.observation]
            if step.done:
                out.append(([], True, "done"))
            elif self.max_user_turns is not None and len(t.rewards) >= self.max_user_turns:
                out.append(([], True, "max_turns"))
            elif not more_room:
                out.append(([], True, "length"))
            elif not more_turns:
                out.append(([], True, "max_turns"))
            else:
                out.append((messages, False, ""))
        return out


def rollout_with_tools(generate: Callable, tokenizer, prompts: list[list[int]], prompt_messages: list[list[dict]],
                       params: SamplingParams, tools, contexts: list[dict], settings: MultiTurnSettings
                       ) -> tuple[RolloutOutput, list[Trajectory]]:
    """`generate(prompts, params) -> RolloutOutput` samples (the actor's verb); `prompts` are the token ids
    of `prompt_messages` as the chat template gave them (with settings.template_kwargs); `tools` a
    posttrain.tools.ToolSet; `contexts[i]` what prompt i's tools may see (ground_truth, extra_info,
    data_source). -> the rows' RolloutOutput (prompt-major, params.n per prompt) and their trajectories."""
    turns = ToolTurns(tools, contexts, params.n, tokenizer, settings.max_tool_response_length)
    first = generate(prompts, _capped(params, settings))
    return converse(generate, tokenizer, first, [prompts[i // params.n] for i in range(len(prompts) * params.n)],
                    [prompt_messages[i // params.n] for i in range(len(prompts) * params.n)], params, turns, settings)


def rollout_with_env(generate: Callable, tokenizer, prompt_messages: list[list[dict]], params: SamplingParams, pool,
                     rows: list[dict], settings: MultiTurnSettings) -> tuple[RolloutOutput, list[Trajectory], list]:
    """Conversations with an environment (posttrain.envs.EnvPool): params.n per row, each its own conversation
    (reset(row) gives its first messages, tokenized with the chat template). -> (RolloutOutput, trajectories,
    sessions); the caller finishes the sessions (pool.finish)."""
    n = params.n
    sessions = pool.reset([rows[i // n] for i in range(len(rows) * n)])
    starts = [s.messages if not s.failed else prompt_messages[i // n] for i, s in enumerate(sessions)]
    ids = [encode_prompt(tokenizer, m, settings.template_kwargs) for m in starts]
    for i, s in enumerate(sessions):
        if settings.max_prompt_length and len(ids[i]) > settings.max_prompt_length and not s.failed:
            s.error, s.error_kind = (f"reset() gave {len(ids[i])} prompt tokens, over data.max_prompt_length="
                                     f"{settings.max_prompt_length}"), "error"
            pool.errors["error"] = pool.errors.get("error", 0) + 1
            starts[i], ids[i] = prompt_messages[i // n], encode_prompt(tokenizer, prompt_messages[i // n],
                                                                       settings.template_kwargs)
    first = generate(ids, dataclasses.replace(_capped(params, settings), n=1))
    turns = EnvTurns(pool, sessions, tokenizer, settings.max_tool_response_length, settings.max_user_turns)
    out, trajs = converse(generate, tokenizer, first, ids, starts, dataclasses.replace(params, n=1), turns, settings,
                          skip=[s.failed for s in sessions])
    for t, s in zip(trajs, sessions):
        if s.failed and t.env_error is None:
            t.env_error, t.ended = s.error, "env_error"
    return out, trajs, sessions


def _capped(params: SamplingParams, settings: MultiTurnSettings) -> SamplingParams:
    return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, settings.max_response_length))


def converse(generate: Callable, tokenizer, first: RolloutOutput, row_prompts: list[list[int]],
             row_messages: list[list[dict]], params: SamplingParams, other, settings: MultiTurnSettings,
             skip: list[bool] | None = None) -> tuple[RolloutOutput, list[Trajectory]]:
    """The turn loop from the first turn's samples (`first`, one row per conversation): each finished turn goes
    to `other` (ToolTurns or EnvTurns), whose messages, in the chat template's rendering, come between it and the
    next turn; a row ends when `other` says so, its turn ran into the length limit, or no turns are left.
    `skip[i]`: row i's conversation never started (its environment failed): its first turn is kept, no more."""
    # One piece on purpose (a few lines over 60): the turn loop (generate, answer the turn, append the messages,
    # stop) reads as the conversation it builds.
    limit = settings.max_response_length
    rows = first.response_ids.shape[0]
    seq = [[] for _ in range(rows)]  # each row's response tokens so far
    gen = [[] for _ in range(rows)]  # 1: generated, 0: a tool / environment message or template tokens
    logp = [[] for _ in range(rows)]
    trajs = [Trajectory() for _ in range(rows)]
    truncated = [False] * rows
    eos = set(settings.eos_token_ids)
    active, out = list(range(rows)), first
    while active:
        asking, texts, last = [], [], []
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
            if skip is not None and skip[i]:
                t.ended = "env_error"
                continue
            if not (tokens and tokens[-1] in eos):  # cut off by the length limit: no answer to give
                t.ended, truncated[i] = "length", True
                continue
            asking.append(i)
            texts.append(text)
            last.append(tokens[-1])
        replies = other.respond(asking, texts, [trajs[i] for i in asking], [len(seq[i]) < limit for i in asking],
                                [trajs[i].turns < settings.max_assistant_turns for i in asking])
        going = []
        for i, end_token, (messages, done, ended) in zip(asking, last, replies):
            t = trajs[i]
            if done:
                t.ended, truncated[i] = ended, ended == "length"
                continue
            between = continuation_ids(tokenizer, row_messages[i] + t.messages, messages, settings.template_kwargs,
                                       end_token)
            if len(seq[i]) + len(between) >= limit:  # no room left for the model to read the answer and go on
                t.ended, truncated[i] = "length", True
                continue
            t.messages += messages
            seq[i] += between
            gen[i] += [0] * len(between)
            logp[i] += [0.0] * len(between)
            t.tool_tokens += len(between)
            going.append(i)
        active = going
        if active:
            budget = max(limit - len(seq[i]) for i in active)
            out = generate([row_prompts[i] + seq[i] for i in active],
                           dataclasses.replace(params, n=1, max_new_tokens=budget))
    return assemble(first.prompt_ids, first.prompt_mask, seq, gen, logp if first.log_probs is not None else None,
                    truncated, tokenizer.pad_token_id), trajs


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


def assemble(prompt_ids, prompt_mask, seq, gen, logp, truncated, pad_token_id: int) -> RolloutOutput:
    """The rows' turns as one RolloutOutput (the prompts as given, [N, P] left-padded): responses (seq: token
    ids; gen: 1 where generated; logp: their log-probs, or None) right-padded to the longest."""
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
    return RolloutOutput(prompt_ids, prompt_mask, ids, mask, probs, torch.tensor(truncated, dtype=torch.bool),
                         response_attention_mask=seen)
