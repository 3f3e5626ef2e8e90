"""The RL loop: `rl_step()` is one step top to bottom; `train()` runs many.

Read this file first. Every box of the step is a call into a module that
knows nothing of the loop: rollout/, rewards/, training/, algorithms/.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posttrain.algorithms import (
    NEEDS_CRITIC, apply_kl_penalty, compute_advantages, overlong_penalty, pf_ppo_resample, pf_ppo_weights,
    varied_groups,
)
from posttrain.batch import RolloutBatch
from posttrain.config import config_to_dict
from posttrain.errors import NonfiniteError, Preempted
from posttrain.metrics import MetricsLogger, batch_metrics, perf_metrics, timed
from posttrain.nonfinite import NonfiniteGuard, first_nonfinite_input, update_fault
from posttrain.profiling import StepProfiler
from posttrain.redact import redact_text
from posttrain.rewards.pool import RewardPool
from posttrain.rollout.base import SamplingParams, decode_responses
from posttrain.rollout.multiturn import rollout_with_tools
from posttrain.samples import sample_rows, val_sample_rows
from posttrain.sinks import make_sinks


@dataclass
class Run:
    """What a run holds between steps (built by `posttrain.build.build_run`)."""

    cfg: object
    run_dir: Path
    actor: object  # a Worker in this process, or a distributed.WorkerGroup: the same verbs
    tokenizer: object
    kl_ctrl: object
    train_data: object
    val_data: object | None
    sampler: object
    sampling: SamplingParams
    val_sampling: SamplingParams
    total_steps: int
    rewards: RewardPool  # score_batch(...) -> ScoreResult, in worker processes; train() closes it
    writer: object = None
    model_dir: str = ""
    resumed_from: Path | None = None
    global_step: int = 0
    stop_signal: int | None = None
    flops: object = None  # flops.ModelFlops of the policy (None: its config lacks a field MFU needs)
    peak_flops: float | None = None  # per device (None: unknown, no MFU)
    guard: NonfiniteGuard | None = None  # None: one with cfg.trainer.max_nonfinite_steps
    profiler: StepProfiler | None = None  # profiler.* (build.make_profiler); None: none
    tools: object = None  # posttrain.tools.ToolSet with rollout.multi_turn.enable; train() closes it
    multi_turn: object = None  # rollout.multiturn.MultiTurnSettings
    reward_messages_shown: set = field(default_factory=set)
    warned: set = field(default_factory=set)  # warnings printed once per run

    def __post_init__(self):
        if self.guard is None:
            self.guard = NonfiniteGuard(self.cfg.trainer.max_nonfinite_steps)
        if self.profiler is None:
            self.profiler = StepProfiler()

    @property
    def has_ref(self) -> bool:
        return self.cfg.actor.use_kl_loss or self.cfg.algorithm.use_kl_in_reward

    @property
    def on_policy_update(self) -> bool:
        """Whether the actor's update sees only the weights that sampled (one
        epoch, one mini-batch) and nothing needs old log-probs before it (no KL
        in the reward): its forward's own log-probs, detached, are the old ones
        (actor.reuse_on_policy_log_probs; see training.actor.micro_loss)."""
        a = self.cfg.actor
        return (a.reuse_on_policy_log_probs and a.ppo_epochs == 1 and not self.cfg.algorithm.use_kl_in_reward
                and a.ppo_mini_batch_size >= self.cfg.data.train_batch_size)

    @property
    def has_critic(self) -> bool:
        return self.cfg.algorithm.adv_estimator in NEEDS_CRITIC


def rl_step(run: Run, items) -> tuple[dict[str, float], RolloutBatch]:
    """One RL step on the prompts `items` (GRPO, PPO, RLOO, REINFORCE++, DAPO,
    GSPO: the config picks the estimator and loss). -> its metrics, its batch."""
    cfg, m = run.cfg, {}
    # 1-2. rollout n samples per prompt, score them (DAPO: until enough groups' scores differ)
    batch = rollout_and_score(run, items, m)
    # 3. log-probs of the sampled tokens under the policy (old: unless the update is on-policy and takes its
    #    own forward's) and the reference; the critic's values
    if not run.on_policy_update:
        with timed(m, "old_log_prob"):
            batch.old_log_probs = run.actor.compute_log_probs(batch, "policy")
    if run.has_ref:
        with timed(m, "ref"):
            batch.ref_log_probs = run.actor.compute_log_probs(batch, "ref")
    if run.has_critic:
        with timed(m, "values"):
            batch.values = run.actor.compute_values(batch)
    # 4. rewards (optionally minus a KL penalty) and advantages
    with timed(m, "adv"):
        if cfg.algorithm.use_kl_in_reward:
            batch.token_level_rewards, kl_metrics = apply_kl_penalty(
                batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs,
                batch.response_mask, run.kl_ctrl, cfg.algorithm.kl_penalty)
            m.update(kl_metrics)
        else:
            batch.token_level_rewards = batch.token_level_scores
        batch.advantages, batch.returns = compute_advantages(
            cfg.algorithm.adv_estimator, batch.token_level_rewards, batch.response_mask, batch.group.tolist(),
            values=batch.values, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, reward_baselines=batch.reward_baselines)
        if batch.reward_baselines is not None:  # ReMax: the greedy responses' scores, one per row
            m["critic/reward_baseline/mean"] = float(batch.reward_baselines.mean())
        if cfg.algorithm.use_pf_ppo:  # PF-PPO: the update trains on rows redrawn by how reliable their reward is
            batch = pf_ppo_batch(batch, cfg.algorithm.pf_ppo, seed=cfg.trainer.seed * 1_000_003 + run.global_step)
    # 5. updates: the critic regresses the returns; the policy (after the critic's warm-up steps)
    #    takes PPO-clip steps over mini-batches with micro-batch accumulation (+ LR schedule), without the
    #    truncated responses with algorithm.overlong_filtering. A NaN or inf in their inputs skips both (the
    #    weights stay as they are)
    policy_batch = overlong_filtered(batch, cfg.data.max_response_length, m) if cfg.algorithm.overlong_filtering \
        else batch
    fault = first_nonfinite_input(batch)
    if run.has_critic and fault is None:
        with timed(m, "update_critic"):
            m.update(run.actor.update_critic(batch))
    if run.global_step >= cfg.trainer.critic_warmup and fault is None:
        with timed(m, "update_actor"):
            m.update(run.actor.train_step(policy_batch))
        # 6. the rollout engine samples from the new weights next step
        with timed(m, "update_weights"):
            run.actor.sync_weights()
    m.update(batch_metrics(batch, cfg.data.max_response_length))
    # 7. a step whose inputs, losses or gradient norm were not finite is counted (train() stops after a streak)
    m["actor/nonfinite_steps"] = run.guard.observe(run.global_step + 1, fault or update_fault(m))
    return m, batch


def truncated_rows(batch: RolloutBatch, max_response_length: int) -> torch.Tensor:
    """[N] bool: the responses that ran out of tokens before an EOS, as the
    rollout engine reported (an engine that does not say: those as long as
    max_response_length)."""
    if batch.truncated is not None:
        return batch.truncated.bool()
    return batch.response_mask.sum(-1) >= max_response_length


def overlong_filtered(batch: RolloutBatch, max_response_length: int, m: dict) -> RolloutBatch:
    """algorithm.overlong_filtering (NeMo-RL's grpo.overlong_filtering): the
    batch the policy update sees, the truncated responses' response_mask
    zeroed after their advantages were computed with them in their groups.
    So they add nothing to the policy loss, the KL loss, the entropy bonus or
    the counts that token-mean divides by (NeMo-RL's loss_multiplier 0), and
    the other rows' loss is what it would be without them. `batch` itself
    keeps its mask: response_length/*, the clip ratio and the advantages'
    statistics still count every row. Adds actor/overlong_filtered_ratio
    (the share of rows filtered) to `m`."""
    cut = truncated_rows(batch, max_response_length)  # [N]
    m["actor/overlong_filtered_ratio"] = float(cut.float().mean()) if len(cut) else 0.0
    if not bool(cut.any()):
        return batch
    return dataclasses.replace(batch, response_mask=batch.response_mask.masked_fill(cut.unsqueeze(-1), 0))


def pf_ppo_batch(batch: RolloutBatch, pf, seed: int) -> RolloutBatch:
    """PF-PPO (verl's algorithm.use_pf_ppo): as many rows as the batch has, drawn
    with replacement with weights from each row's summed token-level score."""
    weights = pf_ppo_weights(batch.token_level_scores.sum(-1), pf.reweight_method, pf.weight_pow)
    return batch.select(pf_ppo_resample(weights, torch.Generator().manual_seed(seed)))


def generate_and_score(run: Run, items, m: dict) -> RolloutBatch:
    """Sample n responses per prompt and score them (scores [N] and
    token_level_scores [N, R]); timings and reward counts add up in `m`."""
    with timed(m, "gen"):
        batch, trajectories = sample(run.actor, run.tokenizer, items, run.sampling, run.tools, run.multi_turn)
    if run.flops is not None:  # every round of dynamic sampling counts toward perf/mfu/rollout
        r = run.cfg.rollout
        shared = run.sampling.n if r.shared_prefill or r.name == "vllm" else 1  # a prompt's samples share its prefill
        prompt_lengths = batch.attention_mask[:, :batch.prompt_width].sum(-1)
        flops = run.flops.rollout(prompt_lengths, batch.response_mask.sum(-1), shared)
        m["perf/flops/rollout"] = m.get("perf/flops/rollout", 0.0) + flops
    if trajectories:  # tool use: the metrics count it
        for key, value in multi_turn_metrics(trajectories).items():
            m[key] = m.get(key, 0.0) + value if key == "multi_turn/tool_errors" else value
    with timed(m, "reward"):
        batch.scores, reward_metrics = score_responses(run, batch, [items[g].messages for g in batch.group.tolist()])
        shaped = batch.scores
        ob = run.cfg.reward.overlong_buffer
        if ob.enable:  # DAPO: a soft penalty for responses that run into the length limit
            penalty = overlong_penalty(batch.response_mask.sum(-1), ob.max_resp_len, ob.len, ob.penalty_factor)
            shaped = shaped + penalty
            if ob.log:
                reward_metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
                reward_metrics["reward/overlong_ratio"] = float((penalty < 0).float().mean())
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


def sample(engine, tokenizer, items, params: SamplingParams, tools=None, multi_turn=None):
    """params.n responses per prompt of `items` (PromptItems) from `engine` (the actor's generate verb) as
    a RolloutBatch with their texts; with `tools`, conversations (rollout.multiturn): the texts are the
    final answers and each row's extra_info gains its turns, tool calls and messages, which the reward
    function sees. -> (batch, the trajectories or None)."""
    prompts = [it.prompt_ids for it in items]
    if tools is not None:
        out, trajectories = rollout_with_tools(engine.generate, tokenizer, prompts, [it.messages for it in items],
                                               params, tools, [tool_context(it) for it in items], multi_turn)
        texts = [t.answer for t in trajectories]
    else:
        out, trajectories = engine.generate(prompts, params), None
        texts = decode_responses(tokenizer, out)
    batch = RolloutBatch.from_rollout(out, params.n, [it.data_source for it in items],
                                      [it.ground_truth for it in items], [it.extra_info for it in items], texts)
    if trajectories:
        batch.extra_info = [{**(info or {}), "turns": t.turns, "tool_calls": t.tool_calls, "messages": t.messages}
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
        batch, _ = sample(run.actor, run.tokenizer, items, greedy, run.tools, run.multi_turn)
    with timed(m, "reward"):
        scores, _ = score_responses(run, batch, [it.messages for it in items])  # failures printed, not counted
        ob = run.cfg.reward.overlong_buffer
        if ob.enable:
            scores = scores + overlong_penalty(batch.response_mask.sum(-1), ob.max_resp_len, ob.len,
                                               ob.penalty_factor)
    return scores


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


def score_responses(run: Run, batch: RolloutBatch, prompts: list) -> tuple[torch.Tensor, dict[str, float]]:
    """-> scores [N] (0 where the reward function failed, or the response is
    empty), metrics: failures by kind, and by data source where there are any
    (and a reward model's mean score). prompts: each row's prompt messages."""
    result = run.rewards.score_batch(batch.data_source, batch.response_text, batch.ground_truth, batch.extra_info,
                                     prompts=prompts)
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


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """scores [N], response_mask [N, R] -> [N, R], zero except at each row's
    last valid token (an empty response keeps nothing). The mask may have
    holes (a multi-turn response: tool messages between generated turns):
    the last 1 counts, not the count of 1s."""
    mask = response_mask.bool()
    width = mask.shape[-1]
    last = width - 1 - mask.flip(-1).int().argmax(-1)  # [N], the last 1 of each row
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    rows = torch.nonzero(mask.any(-1)).squeeze(-1)
    out[rows, last[rows]] = scores[rows]
    return out


def report_reward_errors(run: Run, result) -> None:
    """Print each distinct reward error message once per run."""
    for msg in result.messages:
        if msg not in run.reward_messages_shown and len(run.reward_messages_shown) < 5:
            run.reward_messages_shown.add(msg)
            # an exception's text may quote a URL with a password, or a token the function was handed
            print(redact_text(f"posttrain: warning: reward function failed (scored 0): {msg}"), file=sys.stderr)


@torch.no_grad()
def validate(engine, tokenizer, data, params: SamplingParams, rewards: RewardPool,
             batch_size: int | None = None, keep_samples: int = 0, tools=None,
             multi_turn=None) -> tuple[dict[str, float], list[dict]]:
    """Generate for every prompt of `data` (with `tools`: multi-turn, rollout.multiturn), score
    (rewards.score_batch), and average per data source.

    -> ({"val/score/mean", "val/<data_source>/score/mean", "val/response_length/mean"} (with tools also
        "val/multi_turn/*"; for a reward's dict return's other numbers "val/<key>/mean" and
        "val/<data_source>/<key>/mean"), the first `keep_samples` completions as sample rows)
    """
    per_source, lengths, errors, rows, trajs = defaultdict(list), [], 0, [], []
    extras = defaultdict(list)  # (data source or None, key) -> the values a dict return held beside the score
    items = [data[i] for i in range(len(data))]
    size = batch_size or len(items)
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        batch, turns = sample(engine, tokenizer, chunk, params, tools, multi_turn)
        trajs += turns or []
        result = rewards.score_batch(batch.data_source, batch.response_text, batch.ground_truth, batch.extra_info,
                                     prompts=[chunk[g].messages for g in batch.group.tolist()])
        errors += sum(result.errors_by_source.values())  # errors + timeouts + crashes
        for source, score, extra in zip(batch.data_source, result.scores, result.extras or [{}] * len(batch)):
            per_source[source].append(score)
            for key, value in extra.items():
                extras[None, key].append(value)
                extras[source, key].append(value)
        if len(rows) < keep_samples:
            rows += val_sample_rows(batch, result.scores, tokenizer, keep_samples - len(rows))
        lengths.extend(batch.response_mask.sum(-1).tolist())
    all_scores = [s for scores in per_source.values() for s in scores]
    metrics = {"val/score/mean": sum(all_scores) / len(all_scores)}
    for source, scores in sorted(per_source.items()):
        metrics[f"val/{source}/score/mean"] = sum(scores) / len(scores)
    for (source, key), values in extras.items():
        metrics[f"val/{key}/mean" if source is None else f"val/{source}/{key}/mean"] = sum(values) / len(values)
    metrics["val/response_length/mean"] = sum(lengths) / len(lengths)
    metrics["val/reward_errors"] = float(errors)
    if trajs:
        metrics.update({"val/" + k: v for k, v in multi_turn_metrics(trajs).items()})
    return metrics, rows


def run_validation(run: Run, logger: MetricsLogger) -> dict[str, float]:
    """Validate; the first trainer.log_val_generations completions go to the samples log."""
    m: dict[str, float] = {}
    with timed(m, "testing"):
        metrics, rows = validate(run.actor, run.tokenizer, run.val_data, run.val_sampling, run.rewards,
                                 run.cfg.data.val_batch_size, keep_samples=run.cfg.trainer.log_val_generations,
                                 tools=run.tools, multi_turn=run.multi_turn)
        m.update(metrics)
    if rows:
        logger.log_samples(rows, run.global_step)
    return m


def save(run: Run, m: dict) -> None:
    """Checkpoint the state after `run.global_step` steps (written in the
    background with trainer.async_save; the copy is taken now)."""
    with timed(m, "save_checkpoint"):
        trainer_state = {"epoch": run.sampler.epoch, "sampler": run.sampler.state_dict(),
                         "kl_ctrl": run.kl_ctrl.state_dict() if run.kl_ctrl is not None else None,
                         "nonfinite": run.guard.state_dict(),
                         "model_dir": str(run.model_dir)}
        run.writer.save(run.actor.snapshot(run.global_step, run.writer, trainer_state, m))


def train(run: Run) -> dict[str, float]:
    """Validate, run steps up to `total_steps` (validating every `test_freq`
    and saving every `save_freq` steps, and at the end), validate again
    (unless trainer.val_at_end is false and the last step is no test_freq multiple).

    SIGTERM or SIGINT: the step in progress finishes, a checkpoint is written
    and `Preempted` is raised (the CLI exits with status 75); a second
    signal exits at once.

    -> summary: val_before, val_after, steps, seconds, run_dir
    """
    tr = run.cfg.trainer
    logger = MetricsLogger(run.run_dir, tr.logger, run.total_steps, sinks=make_sinks(
        tr.logger, run.run_dir, tr.project_name, run.run_dir.name, config_to_dict(run.cfg)))  # make_sinks redacts it
    summary: dict = {"run_dir": str(run.run_dir), "start_step": run.global_step}
    start = time.perf_counter()
    previous = install_stop_handlers(run)
    try:
        if run.val_data is not None and tr.val_before_train and run.resumed_from is None:
            m = run_validation(run, logger)
            summary["val_before"] = m["val/score/mean"]
            logger.log(m, run.global_step)
        while run.global_step < run.total_steps:
            metrics: dict = {}
            # as in verl, the step's time includes its validation and save (not the profiler's start and stop);
            # its phases' timed() blocks are the profiler's phases
            with run.profiler.step(run.global_step + 1), timed(metrics, "step"):
                epoch, indices = run.sampler.next_batch()
                step_metrics, batch = rl_step(run, [run.train_data[i] for i in indices])
                metrics.update(step_metrics)
                run.global_step += 1
                last = run.global_step == run.total_steps
                metrics["training/global_step"] = float(run.global_step)
                metrics["training/epoch"] = float(epoch)
                periodic = tr.test_freq > 0 and run.global_step % tr.test_freq == 0
                if run.val_data is not None and ((last and tr.val_at_end) or periodic):
                    metrics.update(run_validation(run, logger))
                    summary["val_after"] = metrics["val/score/mean"]
                stopping = run.stop_signal is not None or run.guard.exhausted
                if stopping or (tr.save_freq > 0 and (run.global_step % tr.save_freq == 0 or last)):
                    save(run, metrics)
            share = run.cfg.model.share_prompt and not run.cfg.model.enable_gradient_checkpointing
            metrics.update(perf_metrics(metrics, batch, run.flops, run.peak_flops, run.cfg.actor.ppo_epochs,
                                        getattr(run.actor, "world_size", 1), share))
            metrics.update(run.actor.memory())
            if tr.log_samples_freq > 0 and (run.global_step % tr.log_samples_freq == 0 or run.global_step == 1):
                logger.log_samples(sample_rows(batch, run.tokenizer, tr.log_samples_prompts), run.global_step)
            logger.log(metrics, run.global_step)
            if run.guard.exhausted:
                run.writer.wait()
                raise NonfiniteError(run.guard.message(run.global_step, run.run_dir / "checkpoints"))
            if run.stop_signal is not None:
                run.writer.wait()
                raise Preempted(
                    f"stopped by {signal.Signals(run.stop_signal).name} after step {run.global_step}; checkpoint "
                    f"saved in {run.run_dir / 'checkpoints'}; run the same command again to resume")
    finally:
        restore_stop_handlers(previous)
        run.rewards.close()  # first: a failure below must not leave reward workers behind
        if run.tools is not None:
            run.tools.close()
        logger.close()
        run.writer.close()
        run.actor.shutdown()
        run.profiler.close()
    summary["steps"] = run.global_step
    summary["seconds"] = time.perf_counter() - start
    return summary


def install_stop_handlers(run: Run) -> dict:
    """First SIGTERM/SIGINT: stop after the current step, with a checkpoint.
    Second: exit at once (status 128 + signal)."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # signal handlers can only be set from the main thread

    def on_signal(signum, frame):
        if run.stop_signal is not None:
            os._exit(128 + signum)
        run.stop_signal = signum
        print(f"posttrain: {signal.Signals(signum).name}: finishing step {run.global_step + 1}, then saving a "
              "checkpoint and stopping (send it again to exit at once)", file=sys.stderr, flush=True)

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_stop_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)

