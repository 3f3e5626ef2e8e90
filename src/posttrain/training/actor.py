"""The actor update: PPO-clip over mini-batches with micro-batch accumulation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from posttrain.algorithms.distill import DistillSettings, distillation_advantages, token_divergence, topk_divergence
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.losses import agg_loss
from posttrain.algorithms.registry import get_policy_loss, policy_loss
from posttrain.algorithms.rollout_corr import RolloutCorrection, correct, mismatch_metrics
from posttrain.training.logprobs import PassOptions, compute_device, log_probs_and_entropy, topk_stats
from posttrain.training.microbatch import micro_batches, row_stats
from posttrain.training.tally import Tally, step_values
from posttrain.training.tensor_parallel import clip_grad_norm


@dataclass(frozen=True)
class UpdateSettings:
    """Plain knobs of one actor update (sizes count sequences, not prompts)."""

    mini_batch_size: int
    micro_batch_size: int
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0  # None: no dual clip
    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"  # the policy loss: algorithms.POLICY_LOSSES
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's constant divisor (the max response length)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    grad_clip: float = 1.0
    remove_padding: bool = True  # model.use_remove_padding: length-ordered, trimmed micro-batches
    micro_max_tokens: int | None = None  # actor.use_dynamic_bsz: micro-batches of at most this many tokens
    share_prompt: bool = True  # model.share_prompt: each distinct prompt's tokens run once per micro-batch
    fused_kernels: bool = False  # model.use_fused_kernels (training/fused.py)
    entropy_chunking: bool = False  # actor.entropy_from_logits_with_chunking
    entropy_checkpointing: bool = False  # actor.entropy_checkpointing
    torch_compile: bool = False  # actor.use_torch_compile: log-prob and entropy functions compiled
    # algorithm.rollout_correction.bypass_mode: the batch's old log-probs are the engine's, and this correction
    # (None: none) weighs and rejects tokens by pi_theta / pi_rollout in each micro-batch (see micro_loss)
    bypass_correction: RolloutCorrection | None = None
    distill: DistillSettings | None = None  # on-policy distillation: the batch has the teacher's log-probs

    def pass_options(self, compile: bool | None = None, sp=None, tp=None) -> PassOptions:
        """How this actor's passes run (`compile`: another role's use_torch_compile, e.g. the reference's;
        `sp`: this worker's sequence-parallel group; `tp`: its tensor-parallel place)."""
        return PassOptions(self.remove_padding, self.share_prompt, self.fused_kernels, self.entropy_chunking,
                           self.entropy_checkpointing, self.torch_compile if compile is None else compile, sp, tp)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas,
                   eps: float = 1e-8) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)


def move_optimizer_state(optimizer: torch.optim.Optimizer, to_cpu: bool) -> None:
    """Optimizer state to the CPU (between updates: verl's optimizer_offload) or
    back to each parameter's device (before one). Adam's `step` counters stay
    where the optimizer keeps them."""
    for param, state in optimizer.state.items():
        device = torch.device("cpu") if to_cpu else param.device
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step" and value.device != device:
                state[key] = value.to(device, non_blocking=True)


LR_SCHEDULES = ("constant", "cosine")  # actor.lr_scheduler_type / critic.lr_scheduler_type (verl's values)


def make_lr_scheduler(optimizer, warmup_steps: int, start_factor: float | None = None, total_steps: int = 0,
                      schedule: str = "constant", min_lr_ratio: float = 0.0,
                      num_cycles: float = 0.5) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of `lr_factor` (a linear warm-up over `warmup_steps` RL
    steps, then constant or a cosine down to `min_lr_ratio` at `total_steps`);
    the scheduler is stepped once per update (RL step)."""
    # a plain function, not a callable object: the scheduler's state_dict stays as it was (no lambda state)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps, total_steps, start_factor, schedule, min_lr_ratio, num_cycles))


def lr_factor(step: int, warmup_steps: int, total_steps: int, start_factor: float | None = None,
              schedule: str = "constant", min_lr_ratio: float = 0.0, num_cycles: float = 0.5) -> float:
    """The LR multiplier of update `step` (0-based), W = warmup_steps, T = total_steps:

    step < W: posttrain's warm-up, `warmup_lr_factor`, for both schedules
        (verl's cosine warms up as step / W, from 0 at the first update;
        here the first update has 1/W of the LR, or s with a start factor).
    constant: 1 from step W on.
    cosine (verl's get_cosine_schedule_with_warmup after its warm-up): with
        progress p = (step - W) / max(1, T - W),
        max(m, m + (1 - m) * (1 + cos(2 pi c p)) / 2), m = min_lr_ratio,
        c = num_cycles: from 1 at step W down to m at step T (c = 0.5).

    Example: cosine, W = 2, T = 6, m = 0 -> steps 0..6: [0.5, 1, 1, 0.854,
    0.5, 0.146, 0] (p = 0, 0.25, 0.5, 0.75, 1 from step 2 on); m = 0.1 ->
    [0.5, 1, 1, 0.868, 0.55, 0.232, 0.1].
    """
    if step < warmup_steps:
        return warmup_lr_factor(step, warmup_steps, start_factor)
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"LR schedule {schedule!r} is not one of: {', '.join(LR_SCHEDULES)}")
    progress = (step - max(0, warmup_steps)) / max(1, total_steps - max(0, warmup_steps))
    cosine = (1.0 + math.cos(2.0 * math.pi * num_cycles * progress)) / 2.0
    return max(min_lr_ratio, min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def warmup_lr_factor(step: int, warmup_steps: int, start_factor: float | None = None) -> float:
    """The LR multiplier of update `step` (0-based) with W = warmup_steps, a warm-up then constant:

    start_factor None (verl's warm-up): min(1, (step + 1) / W), so the first
        update already has 1/W of the LR and update W - 1 has all of it.
    start_factor s (NeMo-RL's torch LinearLR(start_factor=s, end_factor=1,
        total_iters=W)): s + (1 - s) * min(step, W) / W, so the first update
        has s of the LR and update W has all of it.
    W <= 0: 1 (no warm-up).

    Example: W = 4 -> [0.25, 0.5, 0.75, 1, 1, ...]; W = 4, s = 0.2 ->
    [0.2, 0.4, 0.6, 0.8, 1, 1, ...].
    """
    if warmup_steps <= 0:
        return 1.0
    if start_factor is None:
        return min(1.0, (step + 1) / warmup_steps)
    return start_factor + (1.0 - start_factor) * min(step, warmup_steps) / warmup_steps


def warmup_steps(lr_warmup_steps: int, lr_warmup_steps_ratio: float, total_steps: int) -> int:
    """An explicit count wins; -1 means `ratio x total steps`."""
    return lr_warmup_steps if lr_warmup_steps >= 0 else int(lr_warmup_steps_ratio * total_steps)


def loss_units(mask: torch.Tensor, loss_agg_mode: str) -> float:
    """What a loss averages over: valid tokens for token-mean, sequences with
    at least one valid token for the per-sequence modes (as `agg_loss` does)."""
    if loss_agg_mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def micro_loss(model, mb, s: UpdateSettings, device, sp=None, tp=None) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch (with grad) and its detached metrics (0-d tensors, read by the caller once
    per update: tally.py).

    Without old_log_probs (an update that is exactly on-policy: one epoch, one
    mini-batch, so the weights are still those that sampled) the old log-probs
    are this forward's own, detached: the ratio is 1 and its gradient that of
    the log-prob, as with a separate no-grad pass over the same weights."""
    mask = mb.response_mask.to(device)
    topk = None
    # the entropy is reported either way; it is in the graph only as a bonus in the loss
    if s.distill is not None and s.distill.uses_topk:  # also the student's log-probs at the teacher's top-k ids
        log_prob, entropy_tok, *topk = topk_stats(model, mb, device, s.temperature, s.pass_options(sp=sp, tp=tp),
                                                  mb.teacher_topk_ids, entropy_grad=s.entropy_coeff != 0)
    else:
        log_prob, entropy_tok = log_probs_and_entropy(model, mb, device, s.temperature,
                                                      s.pass_options(sp=sp, tp=tp),
                                                      entropy_grad=s.entropy_coeff != 0)  # [n, R] each
    old_log_prob = mb.old_log_probs.to(device) if mb.old_log_probs is not None else log_prob.detach()
    loss_entry = policy_loss(s.loss_mode)
    weights, corr_metrics = is_weights(mb, log_prob, mask, s.bypass_correction, device,
                                       weigh=loss_entry.applies_is_weights)
    pol = loss_entry.fn(
        old_log_prob, log_prob, mb.advantages.to(device), mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        clip_ratio_c=s.clip_ratio_c, loss_agg_mode=s.loss_agg_mode, loss_scale_factor=s.loss_scale_factor,
        weights=weights,
    )
    loss = pol["pg_loss"]

    def agg(x):
        return agg_loss(x, mask, s.loss_agg_mode, loss_scale_factor=s.loss_scale_factor)

    distill_metrics = {}
    if s.distill is not None:
        loss, distill_metrics = distilled(loss, log_prob, old_log_prob, mb, mask, weights, s, agg, device, topk)

    if s.entropy_coeff != 0:
        entropy = agg(entropy_tok)
        loss = loss - s.entropy_coeff * entropy
    else:
        with torch.no_grad():
            entropy = agg(entropy_tok)
    metrics = {
        "actor/pg_loss": pol["pg_loss"].detach(),
        "actor/pg_clipfrac": pol["pg_clipfrac"].detach(),
        "actor/ppo_kl": pol["ppo_kl"].detach(),
        "actor/pg_clipfrac_lower": pol["pg_clipfrac_lower"].detach(),
        "actor/entropy": entropy.detach(),
        **corr_metrics,
        **distill_metrics,
    }
    if s.use_kl_loss:
        kl = kl_penalty(log_prob, mb.ref_log_probs.to(device), s.kl_loss_type)
        kl_loss = agg(kl)
        loss = loss + s.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
        metrics["actor/kl_coef"] = s.kl_loss_coef
    return loss, metrics


def distilled(task_loss, log_prob, old_log_prob, mb, mask, weights, s: UpdateSettings, agg, device, topk=None):
    """The loss with on-policy distillation (algorithms/distill.py): the distillation loss alone, or added to
    the task's times its coefficient (use_task_rewards). `topk`: the top-k modes' student log-probs at the
    teacher's ids [n, R, k] and sum of p log p [n, R]. -> (loss, distillation/* metrics)."""
    d, teacher_lp = s.distill, mb.teacher_log_probs.to(device)
    extra = {}
    if topk is not None:  # a direct loss over the teacher's top-k distribution
        student_topk, neg_entropy = topk
        teacher_topk = mb.teacher_topk_log_probs.to(device)
        distill = agg(topk_divergence(student_topk, teacher_topk, d, neg_entropy))
        with torch.no_grad():  # how much of each model's probability the k hold
            extra = {"distillation/teacher_mass": agg(teacher_topk.exp().sum(-1)),
                     "distillation/student_mass": agg(student_topk.exp().sum(-1))}
    elif d.use_policy_gradient:  # -divergence as each token's advantage, in the policy loss
        advantages = distillation_advantages(old_log_prob, teacher_lp, mask, d)
        distill = get_policy_loss(s.loss_mode)(
            old_log_prob, log_prob, advantages, mask, clip_ratio_low=s.clip_ratio_low,
            clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c, loss_agg_mode=s.loss_agg_mode,
            loss_scale_factor=s.loss_scale_factor, weights=weights)["pg_loss"]
    else:  # the divergence itself, its gradient through the student's log-probs
        distill = agg(token_divergence(log_prob, teacher_lp, d))
    loss = task_loss + d.coef * distill if d.use_task_rewards else distill
    with torch.no_grad():
        reverse_kl = agg(log_prob - teacher_lp)  # k1 on the student's own samples: the reverse KL's estimate
    return loss, {"distillation/loss": distill.detach(), "distillation/reverse_kl": reverse_kl, **extra}


def is_weights(mb, log_prob: torch.Tensor, mask: torch.Tensor, bypass: RolloutCorrection | None,
               device, weigh: bool = True) -> tuple[torch.Tensor | None, dict]:
    """The policy loss's per-token weights [n, R] (None: none) and their metrics (0-d tensors).

    Decoupled mode: the batch's rollout_is_weights (pi_old / pi_rollout, computed once per step by the loop,
    whose rejections already left the response mask). Bypass mode (`bypass` set): the correction of this
    forward's own pi_theta against the engine's pi_rollout, here, since pi_theta moves with every mini-batch;
    a token it rejects weighs 0 and stays in the loss's denominator (the micro-batch weights were counted on
    the mask), and its IS weight multiplies the rest only when `weigh` (the reinforce loss, which has no
    ratio of its own; PPO-clip's ratio is already pi_theta / pi_rollout, so there, as in verl, the weights
    are reported, not applied); the metrics are averaged over
    the micro-batches, as is the gap between the two (rollout_corr/kl, ...: before the first optimizer step
    pi_theta is the trainer's pi_old, the decoupled mode's measure)."""
    if bypass is None:
        return (mb.rollout_is_weights.to(device) if mb.rollout_is_weights is not None else None), {}
    behaviour = mb.rollout_log_probs.to(device)
    # metrics as tensors, read with the update's others (tally.py); a planned micro-batch knows its mask's
    # counts (microbatch.Micro), so nothing is read back here
    counts = getattr(mb, "counts", None)
    w, kept, metrics = correct(log_prob.detach(), behaviour, mask, bypass, counts, on_device=True)
    metrics.update(mismatch_metrics(log_prob.detach(), behaviour, mask, counts, on_device=True))  # vs pi_theta
    kept = kept.to(log_prob.dtype)
    return (kept if w is None or not weigh else w.to(log_prob.dtype) * kept), metrics


def update_policy(model, optimizer, batch, s: UpdateSettings, mini_totals: list[float] | None = None,
                  world_size: int = 1, sp=None, tp=None) -> dict[str, float]:
    """`ppo_epochs` passes over `batch` in mini-batches; one optimizer step per
    mini-batch, gradients accumulated over its micro-batches. A mini-batch
    whose gradient norm is not finite is skipped (no weight change).

    batch needs responses, response_mask, advantages, old_log_probs (None
    when the update is on-policy, see `micro_loss`) and ref_log_probs with
    use_kl_loss. Returns metrics averaged over micro-batches.

    Data parallel (world_size > 1, a sharded model): `batch` holds this
    worker's rows of every mini-batch (mini_batch_size / world_size each) and
    `mini_totals[k]` the `loss_units` of the whole mini-batch k, so the
    gradients, averaged over workers by FSDP, equal the single-process ones. Tensor parallelism (`tp`,
    training/tensor_parallel.py): the ranks of a TP group hold the same rows and each computes the whole loss.
    """
    device = compute_device(model)
    s = pinned_loss_scale(s, batch)
    return run_updates(model, optimizer, batch, lambda mb: micro_loss(model, mb, s, device, sp, tp), s.mini_batch_size,
                       s.micro_batch_size, s.ppo_epochs, s.loss_agg_mode, s.grad_clip, mini_totals, world_size,
                       sp_size=sp.size if sp is not None else 1,
                       prefix="actor", remove_padding=s.remove_padding, max_tokens=s.micro_max_tokens)


def pinned_loss_scale(settings, batch):
    """`settings` (UpdateSettings or CriticSettings) with seq-mean-token-sum-norm's
    divisor fixed: its default is the padded response length, which must be
    the batch's, not that of a trimmed micro-batch."""
    if settings.loss_scale_factor is not None:
        return settings
    return dataclasses.replace(settings, loss_scale_factor=float(batch.response_length))


def run_updates(model, optimizer, batch, loss_fn, mini_batch_size: int, micro_batch_size: int, epochs: int,
                loss_agg_mode: str, grad_clip: float, mini_totals: list[float] | None = None, world_size: int = 1,
                sp_size: int = 1,
                prefix: str = "actor", remove_padding: bool = False, max_tokens: int | None = None
                ) -> dict[str, float]:
    """The update loop shared by the actor and the critic: `epochs` passes
    over `batch` in mini-batches of `mini_batch_size` rows (divided over
    `world_size` workers), `loss_fn(micro_batch) -> (loss, metrics)` summed
    over micro-batches with weights that make the sum the mini-batch's loss,
    gradients clipped to `grad_clip`. Micro-batches hold `micro_batch_size`
    rows, or with `max_tokens` as many rows as fit in that many tokens: the
    weights make the sum the same either way. With remove_padding a mini-batch's rows
    are length-ordered and its micro-batches trimmed (`microbatch.micro_batches`):
    the same sum, no compute on padding.

    A mini-batch whose loss or gradient norm is not finite takes no optimizer
    step (its gradients are dropped, the weights and the optimizer state stay
    as they were); with several workers they all agree to skip.

    -> the micro-batches' metrics (averaged with the loss's weights), <prefix>/loss (the mini-batches'
    whole loss, NaN when one was not finite), <prefix>/grad_norm (over the
    steps taken), <prefix>/nonfinite_updates (the steps skipped), <prefix>/lr.
    """
    # One piece on purpose: the epochs / mini-batches / micro-batches nesting and the loss weights that make
    # a cut-up mini-batch sum to its whole loss are easiest to check read together.
    params = [p for p in model.parameters() if p.requires_grad]
    device = compute_device(model)
    model.train()
    tally = Tally()  # the metrics' weighted sums, on the device, read once at the end
    grad_norms, losses, skipped, counted = [], [], 0, 0
    # sequence parallelism (sp_size > 1): the sp_size workers of a group hold the same rows, each computes the
    # whole loss and its own positions' part of the gradient: the parts add up over the group, the metrics
    # (the same on each) are counted once per group
    # everything cut and weighed from the batch's CPU tensors, read once (microbatch.py)
    rows, size = row_stats(batch), mini_batch_size * sp_size // world_size
    minis = [range(a, min(a + size, len(batch))) for a in range(0, len(batch), size)]
    micros = [micro_batches(batch, micro_batch_size, remove_padding, max_tokens, rows, mini) for mini in minis]
    micro_per_epoch = sum(len(m) for m in micros)
    bar = tqdm(total=epochs * micro_per_epoch, desc=f"update {prefix}", unit="micro", leave=False,
               disable=None if world_size == 1 else True)
    for _ in range(epochs):
        for k, mini in enumerate(minis):
            optimizer.zero_grad(set_to_none=True)
            total = mini_totals[k] if mini_totals is not None else rows.units(mini, loss_agg_mode)
            mini_loss = 0.0  # a float64 tensor on the device once a micro-batch adds to it
            counted += total > 0
            for _, mb in micros[k]:
                w = rows.units(mb.picked, loss_agg_mode) / total * world_size if total > 0 else 0.0
                loss, m = loss_fn(mb.to(device))  # each tensor moved once, without waiting (microbatch.Micro)
                (loss * w).backward()  # a NaN loss makes NaN gradients: the norm below catches both
                w /= sp_size
                mini_loss = mini_loss + loss.detach().double() * w  # x world_size: the group averages over workers
                # weighted as the loss is: a mini-batch's weights add up to world_size over the workers,
                # so sums / counted, averaged over them, is its own value however it is cut up
                tally.add(m, w)
                bar.update(1)
            grad_norm = full_value(clip_grad_norm(params, grad_clip))  # torch's, or per mesh with TP
            ok, loss_value, norm = step_values(mini_loss, grad_norm, world_size, params[0].device)  # one read
            if ok:
                optimizer.step()
                grad_norms.append(norm)
            else:
                skipped += 1
            losses.append(loss_value)
            optimizer.zero_grad(set_to_none=True)
    bar.close()
    metrics = {k: v / counted if counted else 0.0 for k, v in tally.read().items()}  # 0: no valid token at all
    metrics[f"{prefix}/loss"] = sum(losses) / len(losses) if losses else 0.0
    metrics[f"{prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics[f"{prefix}/nonfinite_updates"] = float(skipped)
    metrics[f"{prefix}/lr"] = optimizer.param_groups[0]["lr"]
    return metrics


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The gradient norm of a sharded model is a DTensor: its whole value."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
