"""The RL loop (read this file first): `rl_step()` is one step top to bottom; `train()` runs many. Every box
of the step calls a module that knows nothing of the loop: generation, validation, the actor's verbs, algorithms/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from posttrain.algorithms import (
    apply_kl_penalty, compute_advantages, estimator, pf_ppo_resample, pf_ppo_weights, truncated_rows,
)
from posttrain.algorithms.distill import TOPK_MODES, route
from posttrain.algorithms.rollout_corr import RolloutCorrection, correct, mismatch_metrics
from posttrain.config.schema_distill import teachers_of
from posttrain.driver.batch import RolloutBatch
from posttrain.driver.lifecycle import (
    close as close_run, due, install_stop_handlers, open_logger, restore_stop_handlers, save, stop_if_asked,
)
from posttrain.driver.nonfinite import first_nonfinite_input, update_fault
from posttrain.driver.rollouts import rollout_and_score
from posttrain.driver.run import Run
from posttrain.driver.scoring import reward_components, scaled
from posttrain.driver.validation import validate
from posttrain.errors import ConfigError
from posttrain.metrics.logger import MetricsLogger, batch_metrics, perf_metrics, raise_measured_peak, timed
from posttrain.metrics.samples import sample_rows


def rl_step(run: Run, items) -> tuple[dict[str, float], RolloutBatch]:
    """One RL step on the prompts `items` (GRPO, PPO, RLOO, REINFORCE++, DAPO,
    GSPO: the config picks the estimator and loss). -> its metrics, its batch."""
    cfg, m = run.cfg, {}
    # 1-2. rollout n samples per prompt, score them (DAPO: until enough groups' scores differ); with asynchronous
    #      training they were, while the last steps trained: by the rollout process, with the weights of k
    #      updates ago (ahead.py; `items` is None)
    batch = rollout_and_score(run.rollouts, items, m) if run.ahead is None else run.ahead.take(m)
    # 3. log-probs of the sampled tokens under the policy (old: unless the update is on-policy and takes its
    #    own forward's, or they are the engine's in rollout correction's bypass mode), the reference and the
    #    distillation's teacher; the critic's values
    if run.bypass:
        batch.old_log_probs = engine_log_probs(batch)
    elif not run.on_policy_update:
        with timed(m, "old_log_prob"):
            batch.old_log_probs = run.actor.compute_log_probs(batch, "policy")
    if batch.rollout_log_probs is not None and batch.old_log_probs is not None and not run.bypass:
        # rollout.calculate_log_probs: how far the engine's log-probs are from the trainer's
        m.update(mismatch_metrics(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask))
    if run.has_ref:
        with timed(m, "ref"):
            batch.ref_log_probs = run.actor.compute_log_probs(batch, "ref")
    if cfg.distillation.enabled:  # on-policy distillation: the teacher scores the student's own samples
        with timed(m, "teacher"):
            teacher_pass(run, batch)
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
        # an estimator of several rewards (GDPO) gets [N, K] each row's reward components, rescaled as the scores are
        gdpo = cfg.algorithm.gdpo
        components = (scaled(cfg.reward.scaling, reward_components(batch, gdpo.reward_keys)[0])
                      if estimator(cfg.algorithm.adv_estimator).reward_components else None)
        batch.advantages, batch.returns = compute_advantages(  # each estimator takes the arguments it names
            cfg.algorithm.adv_estimator, batch.token_level_rewards, batch.response_mask, batch.group.tolist(),
            values=batch.values, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, reward_baselines=batch.reward_baselines,
            reward_components=components, reward_weights=gdpo.reward_weights, leave_one_out=gdpo.leave_one_out)
        if batch.reward_baselines is not None:  # ReMax: the greedy responses' scores, one per row
            m["critic/reward_baseline/mean"] = float(batch.reward_baselines.mean())
        if cfg.algorithm.use_pf_ppo:  # PF-PPO: the update trains on rows redrawn by how reliable their reward is
            batch = pf_ppo_batch(batch, cfg.algorithm.pf_ppo, seed=cfg.trainer.seed * 1_000_003 + run.global_step)
    # 5. updates: the critic regresses the returns; the policy (after the critic's warm-up steps) takes PPO-clip
    #    steps over mini-batches with micro-batch accumulation (+ LR schedule), without the truncated responses
    #    with algorithm.overlong_filtering. A NaN or inf in their inputs skips both (the weights stay as they are)
    #    with algorithm.overlong_filtering, and with the IS weights and rejections of algorithm.rollout_correction
    policy_batch = overlong_filtered(batch, cfg.data.max_response_length, m) if cfg.algorithm.overlong_filtering \
        else batch
    if run.correction is not None and not run.bypass:
        policy_batch = rollout_corrected(policy_batch, run.correction, m)
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


def overlong_filtered(batch: RolloutBatch, max_response_length: int, m: dict) -> RolloutBatch:
    """algorithm.overlong_filtering (NeMo-RL's): the batch the policy update sees, truncated rows' mask zeroed
    after their group's advantages used them: they add nothing to any loss or token count (NeMo-RL's
    loss_multiplier 0). `batch` keeps its mask for the metrics. Adds actor/overlong_filtered_ratio to `m`."""
    cut = truncated_rows(batch.truncated, batch.response_mask, max_response_length)  # [N]
    m["actor/overlong_filtered_ratio"] = float(cut.float().mean()) if len(cut) else 0.0
    if not bool(cut.any()):
        return batch
    return dataclasses.replace(batch, response_mask=batch.response_mask.masked_fill(cut.unsqueeze(-1), 0))


def teacher_pass(run, batch: RolloutBatch) -> None:
    """The teachers' log-probs of the sampled tokens (and with a top-k loss their k likeliest tokens at each
    position) into `batch`; with several teachers each scores the rows its key routes to it (distillation.teacher_key:
    the row's data_source, or that key of its extra_info)."""
    d = run.cfg.distillation
    keys = list(teachers_of(d))
    if keys == [None]:
        routes = {None: list(range(len(batch)))}
    else:
        field = d.teacher_key or "data_source"
        values = batch.data_source if field == "data_source" else [(x or {}).get(field) for x in batch.extra_info]
        try:
            routes = route(values, keys)
        except ValueError as e:
            raise ConfigError(f"distillation.teacher_key={field}: {e}; give every row's {field} a teacher") from None
    topk = d.distillation_loss.loss_mode in TOPK_MODES
    outs = {key: run.actor.compute_teacher_topk(part, d.distillation_loss.topk, key) if topk else
            (run.actor.compute_log_probs(part, "teacher", key),)
            for key, rows in routes.items() for part in [batch if len(routes) == 1 else batch.select(rows)]}
    whole = [torch.zeros((len(batch), *t.shape[1:]), dtype=t.dtype) for t in next(iter(outs.values()))]
    for key, rows in routes.items():
        for target, got in zip(whole, outs[key]):
            target[torch.tensor(rows)] = got
    batch.teacher_log_probs = whole[0]
    if topk:
        batch.teacher_topk_log_probs, batch.teacher_topk_ids = whole[1], whole[2]


def engine_log_probs(batch: RolloutBatch) -> torch.Tensor:
    """The rollout engine's log-probs of the sampled tokens, which rollout correction needs."""
    if batch.rollout_log_probs is None:
        raise RuntimeError("algorithm.rollout_correction needs the rollout engine's log-probs of the sampled tokens, "
                           "and this rollout returned none (a custom engine or rollout without log_probs): "
                           "return them as RolloutOutput.log_probs, or turn algorithm.rollout_correction off")
    return batch.rollout_log_probs


def rollout_corrected(batch: RolloutBatch, c: RolloutCorrection, m: dict) -> RolloutBatch:
    """Decoupled mode: the batch the policy update sees, with the IS weights pi_old / pi_rollout
    (rollout_is_weights) and without the tokens and sequences the correction rejects (response mask);
    `batch` keeps its mask for the metrics. Adds rollout_corr/* to `m`."""
    weights, mask, metrics = correct(batch.old_log_probs, engine_log_probs(batch), batch.response_mask, c)
    m.update(metrics)
    return dataclasses.replace(batch, rollout_is_weights=weights, response_mask=mask)


def pf_ppo_batch(batch: RolloutBatch, pf, seed: int) -> RolloutBatch:
    """PF-PPO (verl's algorithm.use_pf_ppo): as many rows as the batch has, drawn
    with replacement with weights from each row's summed token-level score."""
    weights = pf_ppo_weights(batch.token_level_scores.sum(-1), pf.reweight_method, pf.weight_pow)
    return batch.select(pf_ppo_resample(weights, torch.Generator().manual_seed(seed)))


def train(run: Run) -> dict[str, float]:
    """Validate, run steps up to `total_steps` (validating every `test_freq` and saving every `save_freq`
    steps, and at the end unless `save_last` is false), validate again (unless trainer.val_at_end is false and
    the last step is no test_freq multiple).

    SIGTERM or SIGINT: the step in progress finishes, a checkpoint is written and `Preempted` is raised (the
    CLI exits with status 75); a second signal exits at once.

    -> summary: val_before, val_after, steps, seconds, run_dir
    """
    tr = run.cfg.trainer
    logger = open_logger(run)
    summary: dict = {"run_dir": str(run.run_dir), "start_step": run.global_step}
    start = time.perf_counter()
    previous = install_stop_handlers(run)
    try:
        if run.val_data is not None and tr.val_before_train and run.resumed_from is None:
            m = run_validation(run, logger)
            summary["val_before"] = m["val/score/mean"]
            logger.log(m, run.global_step)
        if run.ahead is not None:
            run.ahead.start()
        while run.global_step < run.total_steps:
            metrics: dict = {}
            # as in verl, the step's time includes its validation and save (not the profiler's start and stop);
            # its phases' timed() blocks are the profiler's phases
            with run.profiler.step(run.global_step + 1), timed(metrics, "step"):
                items = None
                if run.ahead is None:
                    epoch, items = run.draw()
                    metrics["training/epoch"] = float(epoch)
                step_metrics, batch = rl_step(run, items)
                metrics.update(step_metrics)
                run.global_step += 1
                metrics["training/global_step"] = float(run.global_step)
                validating, saving = due(run, run.val_data is not None)
                # asynchronous training: both at the same point of the sampling stream in every run
                with run.ahead.settled(saving) if run.ahead and (validating or saving) else contextlib.nullcontext():
                    if validating:
                        metrics.update(run_validation(run, logger))
                        summary["val_after"] = metrics["val/score/mean"]
                    if saving:
                        save(run, metrics, run.kl_ctrl, run.ahead)
                if run.ahead is not None:
                    run.ahead.updated(run.global_step)  # the rollout may sample with these weights now
            log_step(run, logger, metrics, batch)
            stop_if_asked(run)
    finally:
        restore_stop_handlers(previous)
        close(run, logger)
    summary["steps"] = run.global_step
    summary["seconds"] = time.perf_counter() - start
    return summary


def log_step(run: Run, logger: MetricsLogger, metrics: dict, batch: RolloutBatch) -> None:
    """The step's line: its metrics with throughput, MFU and peak memory; every trainer.log_samples_freq
    steps (and the first) some of its samples."""
    tr = run.cfg.trainer
    share = run.cfg.model.share_prompt and not run.cfg.model.enable_gradient_checkpointing
    world = getattr(run.actor, "world_size", 1)
    perf = perf_metrics(metrics, batch, run.flops, run.peak_flops, run.cfg.actor.ppo_epochs, world, share)
    if run.peak_keys and (peak := raise_measured_peak(perf, run.peak_flops, run.peak_keys)):
        run.peak_flops = peak  # the step beat the measured peak (measured on a busy machine): MFU against this
        perf = perf_metrics(metrics, batch, run.flops, peak, run.cfg.actor.ppo_epochs, world, share)
    metrics.update(perf)
    metrics.update(run.actor.memory())
    if tr.log_samples_freq > 0 and (run.global_step % tr.log_samples_freq == 0 or run.global_step == 1):
        logger.log_samples(sample_rows(batch, run.tokenizer, tr.log_samples_prompts), run.global_step)
    logger.log(metrics, run.global_step)


def run_validation(run: Run, logger: MetricsLogger) -> dict[str, float]:
    """Validate (validation.validate); the first trainer.log_val_generations completions go to the samples log."""
    m: dict[str, float] = {}
    with timed(m, "testing"):
        run.actor.validation_weights(True)  # the policy's weights now, also where the rollout samples with older ones
        try:
            metrics, rows = validate(run.actor, run.tokenizer, run.val_data, run.val_sampling, run.rewards,
                                     run.cfg.data.val_batch_size, keep_samples=run.cfg.trainer.log_val_generations,
                                     tools=run.tools, multi_turn=run.multi_turn, env=run.env,
                                     processor=run.processor)
        finally:
            run.actor.validation_weights(False)
        m.update(metrics)
    if rows:
        logger.log_samples(rows, run.global_step)
    return m


def close(run: Run, logger: MetricsLogger) -> None:
    """Stop what the run started (the checkpoint writer after its last save)."""
    if run.ahead is not None:
        run.ahead.close()  # it uses the rewards and the rollout process
    run.rewards.close()  # before the rest: a failure below must not leave reward workers behind
    if run.tools is not None:
        run.tools.close()
    if run.env is not None:
        run.env.close()
    close_run(run, logger)
