"""The step's first boxes: sample responses (one turn, or conversations with
tools) and score them.

`rollout_and_score(run, items, m)` is what `loop.rl_step` calls: a batch of
scored rollouts (scores [N], token_level_scores [N, R]), after DAPO's
dynamic sampling where it is on; `sample` is shared with validation.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

import torch

from posttrain.algorithms import (
    overlong_penalty, place_on_last_token, rescale, scale_truncated, truncated_rows, varied_groups,
)
from posttrain.driver.batch import RolloutBatch
from posttrain.errors import RewardError
from posttrain.metrics.logger import timed
from posttrain.text.redact import redact_text
from posttrain.rollout.base import SamplingParams, decode_responses
from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_tools
from posttrain.tools import ToolSet, load_tools

if TYPE_CHECKING:  # the loop calls this module: its Run only names the argument
    from posttrain.driver.env_side import EnvSide
    from posttrain.driver.loop import Run


def rollout_and_score(run: Run, items, m: dict) -> RolloutBatch:
    """The step's scored rollouts. With algorithm.filter_groups.enable (DAPO's
    dynamic sampling) groups whose samples all got the same score carry no
    signal: they are dropped and more prompts are drawn until len(items)
    groups differ, or max_num_gen_batches rounds were drawn; then the batch is
    filled with dropped groups (so its size never changes) and a warning says so.
    Metrics: train/num_gen_batches, train/kept_groups_ratio."""
    fg = run.cfg.algorithm.filter_groups
    if not fg.enable:
        return generate_and_score(run, items, m)
    wanted, varied, uniform, rounds = len(items), [], [], 0
    while True:
        rounds += 1
        batch = generate_and_score(run, items, m)
        keep = varied_groups(filter_metric(batch, fg.metric), batch.group)  # [N] bool
        varied.append(batch.select(torch.nonzero(keep).squeeze(-1)))
        uniform.append(batch.select(torch.nonzero(~keep).squeeze(-1)))
        found = sum(len(set(b.group.tolist())) for b in varied)
        if found >= wanted or (fg.max_num_gen_batches > 0 and rounds >= fg.max_num_gen_batches):
            break
        _, indices = run.sampler.next_batch()
        items = [run.train_data[i] for i in indices]
    m["train/num_gen_batches"] = float(rounds)
    m["train/kept_groups_ratio"] = min(found, wanted) / wanted
    if found < wanted and "filter_groups" not in run.warned:
        run.warned.add("filter_groups")
        print(f"posttrain: warning: dynamic sampling found {found} of {wanted} prompts with differing scores in "
              f"{rounds} rounds (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); the batch "
              "is filled with uniform groups, which carry no group-relative signal. Raise the cap, or use data "
              "the model solves sometimes but not always", file=sys.stderr)
    parts = [b for b in varied + uniform if len(b)]
    batch = RolloutBatch.concat(parts, run.tokenizer.pad_token_id)
    return batch.select(torch.nonzero(batch.group < wanted).squeeze(-1))


def filter_metric(batch: RolloutBatch, metric: str) -> torch.Tensor:
    """[N] what dynamic sampling compares within a group: acc/score are the
    reward function's scores, seq_reward/seq_final_reward the shaped ones."""
    return batch.scores if metric in ("acc", "score") else batch.token_level_scores.sum(-1)


def generate_and_score(run: Run, items, m: dict) -> RolloutBatch:
    """Sample n responses per prompt and score them (scores [N] and
    token_level_scores [N, R]); timings and reward counts add up in `m`."""
    with timed(m, "gen"):
        batch, trajectories = sample(run.actor, run.tokenizer, items, run.sampling, run.tools, run.multi_turn,
                                     run.env)
    if run.flops is not None:  # every round of dynamic sampling counts toward perf/mfu/rollout
        r = run.cfg.rollout
        shared = run.sampling.n if r.shared_prefill or r.name == "vllm" else 1  # a prompt's samples share its prefill
        prompt_lengths = batch.attention_mask[:, :batch.prompt_width].sum(-1)
        flops = run.flops.rollout(prompt_lengths, batch.response_mask.sum(-1), shared)
        m["perf/flops/rollout"] = m.get("perf/flops/rollout", 0.0) + flops
    if trajectories and run.env is not None:  # conversations with an environment or agent runs
        for key, value in run.env.metrics(trajectories).items():
            m[key] = m.get(key, 0.0) + value if key.startswith("env/num_") else value
    elif trajectories:  # tool use: the metrics count it
        for key, value in multi_turn_metrics(trajectories).items():
            m[key] = m.get(key, 0.0) + value if key == "multi_turn/tool_errors" else value
    with timed(m, "reward"):
        if run.env is not None and not run.env.needs_rule(trajectories):  # scored by the environment alone
            batch.scores, reward_metrics = torch.zeros(len(batch)), {}
        else:
            batch.scores, reward_metrics = score_responses(run, batch,
                                                           [items[g].messages for g in batch.group.tolist()])
        if run.env is not None:
            batch.scores = run.env.scores(batch.scores, trajectories)
        shaped = shape_scores(run, batch, batch.scores, reward_metrics)
        # an empty response (only EOS or special tokens) scored 0 unjudged, so it carries no signal: a zero mask
        # gives it no reward token (place_on_last_token), no advantage (estimators multiply by the mask) and
        # no loss (agg_loss leaves fully masked rows out of its means)
        empty = torch.tensor([text == "" for text in batch.response_text], dtype=torch.bool)
        batch.response_mask = batch.response_mask.masked_fill(empty.unsqueeze(-1), 0)
        reward_metrics["response/empty_ratio"] = float(empty.sum()) / max(len(empty), 1)
        batch.token_level_scores = place_on_last_token(shaped, batch.response_mask)
    for key, value in reward_metrics.items():
        m[key] = m.get(key, 0.0) + value if key.endswith(("num_errors", "num_timeouts", "num_crashes")) else value
    if run.cfg.algorithm.adv_estimator == "remax":  # per round, so dynamic sampling's rows keep theirs
        batch.reward_baselines = greedy_baselines(run, items, m)[batch.group]  # [N]
    return batch


def sample(engine, tokenizer, items, params: SamplingParams, tools: ToolSet | None = None,
           multi_turn: MultiTurnSettings | None = None, env: EnvSide | None = None
           ) -> tuple[RolloutBatch, list | None]:
    """params.n responses per prompt of `items` (PromptItems) from `engine` (the actor's generate verb) as
    a RolloutBatch with their texts; with `tools` or an `env`, conversations (rollout.multiturn): the texts are
    the final answers and each row's extra_info gains its turns, tool calls, messages and turn scores, which the
    reward function sees. A conversation whose environment failed trains nothing (its response mask is zero).
    -> (batch, the trajectories or None)."""
    prompts = [it.prompt_ids for it in items]
    if env is not None:
        out, trajectories = env.converse(engine, tokenizer, items, params, multi_turn)
        texts = [t.answer for t in trajectories]
    elif tools is not None:
        out, trajectories = rollout_with_tools(engine.generate, tokenizer, prompts, [it.messages for it in items],
                                               params, tools, [tool_context(it) for it in items], multi_turn)
        texts = [t.answer for t in trajectories]
    else:
        out, trajectories = engine.generate(prompts, params), None
        texts = decode_responses(tokenizer, out)
    batch = RolloutBatch.from_rollout(out, params.n, [it.data_source for it in items],
                                      [it.ground_truth for it in items], [it.extra_info for it in items], texts)
    if trajectories:
        batch.extra_info = [{**(info or {}), "turns": t.turns, "tool_calls": t.tool_calls, "messages": t.messages,
                             **({"turn_scores": t.rewards, "env_error": t.env_error} if env is not None else {})}
                            for info, t in zip(batch.extra_info, trajectories)]
    return batch, trajectories


def tool_context(item) -> dict:
    """What a prompt's tools may see (an answer checker: the ground truth)."""
    return {"ground_truth": item.ground_truth, "extra_info": item.extra_info, "data_source": item.data_source}


def multi_turn_metrics(trajectories) -> dict[str, float]:
    """Turns and tool use of a step's samples: per sample means, the share that called a tool, errors
    (malformed calls, unknown tools, failed or timed-out tools), generated vs tool tokens."""
    k = max(len(trajectories), 1)
    return {"multi_turn/turns/mean": sum(t.turns for t in trajectories) / k,
            "multi_turn/tool_calls/mean": sum(len(t.tool_calls) + t.malformed for t in trajectories) / k,
            "multi_turn/tool_use_ratio": sum(1 for t in trajectories if t.tool_calls or t.malformed) / k,
            "multi_turn/tool_errors": float(sum(t.tool_errors for t in trajectories)),
            "multi_turn/generated_tokens/mean": sum(t.generated_tokens for t in trajectories) / k,
            "multi_turn/tool_tokens/mean": sum(t.tool_tokens for t in trajectories) / k,
            "multi_turn/max_turns_ratio": sum(1 for t in trajectories if t.ended == "max_turns") / k}


def greedy_baselines(run: Run, items, m: dict) -> torch.Tensor:
    """ReMax's baselines: one greedy response per prompt (as long as the
    samples may be; with tools, a greedy conversation), scored as the samples are: the reward function, plus
    DAPO's overlong penalty where it is on. -> [len(items)] (verl: gen_max)."""
    greedy = dataclasses.replace(run.sampling, n=1, do_sample=False, temperature=0.0, top_p=1.0, top_k=-1,
                                 logprobs=False)
    with timed(m, "gen_max"):  # with tools, a greedy conversation, as the samples are conversations
        batch, trajectories = sample(run.actor, run.tokenizer, items, greedy, run.tools, run.multi_turn, run.env)
    with timed(m, "reward"):
        if run.env is not None and not run.env.needs_rule(trajectories):
            scores = torch.zeros(len(batch))
        else:
            scores, _ = score_responses(run, batch, [it.messages for it in items])  # failures printed, not counted
        if run.env is not None:
            scores = run.env.scores(scores, trajectories)
        scores = shape_scores(run, batch, scores)
    return scores


def shape_scores(run: Run, batch: RolloutBatch, scores: torch.Tensor, metrics: dict | None = None) -> torch.Tensor:
    """[N] scores -> [N] the scores the advantages see: rescaled (reward.scaling), then DAPO's soft penalty for
    responses that run into the length limit (reward.overlong_buffer), or ProRL v2's scale for truncated ones
    (reward.truncated_scale); its figures into `metrics` (when given)."""
    rw = run.cfg.reward
    scores = scaled(rw.scaling, scores, metrics)
    ob = rw.overlong_buffer
    if ob.enable:
        penalty = overlong_penalty(batch.response_mask.sum(-1), ob.max_resp_len, ob.len, ob.penalty_factor)
        scores = scores + penalty
        if ob.log and metrics is not None:
            metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
            metrics["reward/overlong_ratio"] = float((penalty < 0).float().mean())
    if rw.truncated_scale is not None:
        cut = truncated_rows(batch.truncated, batch.response_mask, run.cfg.data.max_response_length)  # [N]
        scores = scale_truncated(scores, cut, rw.truncated_scale)
        if metrics is not None:
            metrics["reward/truncated_ratio"] = float(cut.float().mean())
    return scores


def score_responses(run: Run, batch: RolloutBatch, prompts: list) -> tuple[torch.Tensor, dict[str, float]]:
    """-> scores [N] (0 where the reward function failed, or the response is
    empty), metrics: failures by kind, and by data source where there are any
    (and a reward model's mean score). prompts: each row's prompt messages."""
    result = run.rewards.score_batch(batch.data_source, batch.response_text, batch.ground_truth, batch.extra_info,
                                     prompts=prompts)
    batch.reward_extras = list(result.extras) if result.extras else [{} for _ in range(len(batch))]
    report_reward_errors(run, result)
    metrics = {"reward/num_errors": float(result.num_errors), "reward/num_timeouts": float(result.num_timeouts),
               "reward/num_crashes": float(result.num_crashes)}
    if result.model_scores:
        metrics["reward/rm_score/mean"] = sum(result.model_scores) / len(result.model_scores)
    for key, mean in result.extra_means().items():  # a dict return's other numbers (verl's acc, ...)
        metrics[f"reward/{key}/mean"] = mean
    for source, count in sorted(result.errors_by_source.items()):  # errors + timeouts + crashes
        metrics[f"reward/{source}/num_errors"] = float(count)
    return torch.tensor(result.scores, dtype=torch.float32), metrics


def scaled(sc, scores: torch.Tensor, metrics: dict | None = None) -> torch.Tensor:
    """reward.scaling (`sc`) applied to [N] or [N, K] scores; the share clamped into `metrics` (when given)."""
    if not sc.enable:
        return scores
    if metrics is not None:
        metrics["reward/scaling_clipped_ratio"] = float(((scores < sc.source_min) | (scores > sc.source_max))
                                                        .float().mean())
    return rescale(scores, (sc.source_min, sc.source_max), (sc.target_min, sc.target_max))


def reward_components(batch: RolloutBatch, keys: list[str]) -> tuple[torch.Tensor, list[str]]:
    """GDPO's [N, K] reward components: the numbers `keys` of each row's reward_extras (a row without one: 0),
    or, with no keys, every number any row's reward returned, sorted by name. -> (components, their names)."""
    returned = {k for extra in batch.reward_extras for k in extra}
    names = list(keys) or sorted(returned)
    fix = ("score with a reward that returns its parts, {'score': ..., 'correctness': ..., 'format': ...} "
           "(e.g. reward.data_source=math_multi_reward), or use grpo")
    if len(names) < 2:
        raise RewardError(f"algorithm.adv_estimator=gdpo normalizes several rewards one by one, but the reward "
                          f"function returned {len(names)} beside its score ({', '.join(names) or 'none'}); {fix}")
    missing = [k for k in names if k not in returned]
    if missing:
        raise RewardError(f"algorithm.gdpo.reward_keys names {', '.join(missing)}, which no response's reward "
                          f"returned (it returned: {', '.join(sorted(returned)) or 'none'}); fix the keys, or {fix}")
    rows = [[float(extra.get(k, 0.0)) for k in names] for extra in batch.reward_extras]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(batch), len(names)), names


def report_reward_errors(run: Run, result) -> None:
    """Print each distinct reward error message once per run."""
    for msg in result.messages:
        if msg not in run.reward_messages_shown and len(run.reward_messages_shown) < 5:
            run.reward_messages_shown.add(msg)
            # an exception's text may quote a URL with a password, or a token the function was handed
            print(redact_text(f"posttrain: warning: reward function failed (scored 0): {msg}"), file=sys.stderr)


def load_tool_use(tool_config_path: str | None, functions: list[str] | None, timeout_s: float, *,
                  max_assistant_turns: int, max_tool_response_length: int, max_response_length: int,
                  eos_token_ids, template_kwargs: dict | None = None,
                  in_process: bool = False) -> tuple[ToolSet, MultiTurnSettings]:
    """The tools a model may call (tools.load_tools: a verl tool config file, function specs) and the
    multi-turn rollout's settings (`posttrain train` and `posttrain eval` both make them here). The chat
    template's arguments (`template_kwargs`) gain the tools' schemas as tools=, which templates with tool
    support render into the system prompt: prompts are encoded with settings.template_kwargs too.
    in_process (trainer.debug): function tools run in this process (tools.load_tools)."""
    tools = load_tools(tool_config_path=tool_config_path, functions=functions, timeout_s=timeout_s,
                       in_process=in_process)
    settings = MultiTurnSettings(max_assistant_turns=max_assistant_turns,
                                 max_tool_response_length=max_tool_response_length,
                                 max_response_length=max_response_length,
                                 template_kwargs={**(template_kwargs or {}), "tools": tools.schemas},
                                 eos_token_ids=tuple(eos_token_ids))
    return tools, settings
