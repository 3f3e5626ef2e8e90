"""verl's fully asynchronous trainer (`verl.experimental.fully_async_policy`), its keys read as posttrain's
asynchronous training (docs/async.md). Its scripts set `data.train_batch_size=0` and describe a weight version by
its parts instead: the trainer takes `require_batches` mini-batches of `actor.ppo_mini_batch_size` prompts per local
update and syncs the weights after `trigger_parameter_sync_step` of them. In posttrain that is one step: its batch
is mini x require x trigger prompts, one optimizer step per mini-batch, one weight version. The rollout may run
`staleness_threshold` (a fraction of such a batch) ahead: at most ceil of it updates, posttrain's k.

resolve(cfg, given) rewrites the merged config in place before validation (and clears verl's keys: the run's
config.yaml holds posttrain's); `given` holds the keys some layer set, so a key the run sets itself wins over the
translation, and a contradiction between the two is refused."""

from __future__ import annotations

import math
import warnings

from posttrain.config.checks import need, printable
from posttrain.config.schema import Config

A = "async_training."
# verl's defaults for its fully asynchronous trainer (its fully_async_ppo_trainer.yaml)
TRIGGER, REQUIRE, STALENESS = 4, 1, 0.1
MARKERS = ("staleness_threshold", "trigger_parameter_sync_step", "require_batches", "partial_rollout",
           "total_rollout_prompts", "use_rollout_log_probs", "compute_prox_log_prob")


def resolve(cfg: Config, given: set[str]) -> None:
    a = cfg.async_training
    if all(getattr(a, key) is None for key in MARKERS):
        return
    _translate(cfg, given)
    for key in MARKERS:  # the run's config.yaml holds the translation, posttrain's keys alone
        setattr(a, key, None)


def _translate(cfg: Config, given: set[str]) -> None:
    a = cfg.async_training
    s = STALENESS if a.staleness_threshold is None else a.staleness_threshold
    need(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s < math.inf,
         f"{A}staleness_threshold must be a number >= 0 (verl's share of a batch the rollout may sample ahead), "
         f"got {printable(s)}")
    trigger = TRIGGER if a.trigger_parameter_sync_step is None else a.trigger_parameter_sync_step
    require = REQUIRE if a.require_batches is None else a.require_batches
    for name, value in (("trigger_parameter_sync_step", trigger), ("require_batches", require)):
        need(value >= 1, f"{A}{name} must be an integer >= 1, got {value}")
    a.enable = True
    k = math.ceil(s)
    if A + "max_trajectory_age_steps" in given:
        need(a.max_trajectory_age_steps == k,
             f"{A}max_trajectory_age_steps={a.max_trajectory_age_steps} and verl's {A}staleness_threshold={s} "
             f"(at most ceil({s}) = {k} update{'' if k == 1 else 's'} ahead) disagree; set one of them")
    a.max_trajectory_age_steps = k
    batch = cfg.actor.ppo_mini_batch_size * require * trigger
    parts = (f"actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size} x {A}require_batches={require} x "
             f"{A}trigger_parameter_sync_step={trigger} = {batch} prompts")
    if cfg.data.train_batch_size == 0 or "data.train_batch_size" not in given:  # verl's scripts: 0
        cfg.data.train_batch_size = batch
    need(cfg.data.train_batch_size == batch,
         f"data.train_batch_size={cfg.data.train_batch_size}, but verl's fully asynchronous keys make a weight version "
         f"{parts}; set data.train_batch_size=0 (verl's) or {batch}")
    if a.total_rollout_prompts is not None:
        need(a.total_rollout_prompts >= 1, f"{A}total_rollout_prompts (verl's rollout.total_rollout_steps) must be "
             f">= 1, got {a.total_rollout_prompts}")
        if "trainer.total_training_steps" not in given:
            cfg.trainer.total_training_steps = math.ceil(a.total_rollout_prompts / batch)
    if a.partial_rollout is not False and A + "in_flight_weight_updates" not in given and k > 0:
        if cfg.rollout.name == "hf":
            a.in_flight_weight_updates = True
        elif a.partial_rollout:
            warnings.warn(f"{A}partial_rollout=true: the rollout.name={cfg.rollout.name} engine samples whole batches "
                          "between weight updates (in-flight updates need rollout.name=hf)", stacklevel=3)
    _old_log_probs(cfg, given)


def _old_log_probs(cfg: Config, given: set[str]) -> None:
    """verl's use_rollout_log_probs (its default) takes the engine's log-probs as the old policy's: bypass mode;
    compute_prox_log_prob has the trainer compute them: decoupled mode."""
    a, rc = cfg.async_training, cfg.algorithm.rollout_correction
    prox = bool(a.compute_prox_log_prob)
    rollout = a.use_rollout_log_probs is not False and not prox
    if "algorithm.rollout_correction.bypass_mode" in given:
        need(rc.bypass_mode == rollout or a.use_rollout_log_probs is None and a.compute_prox_log_prob is None,
             f"algorithm.rollout_correction.bypass_mode={rc.bypass_mode} contradicts verl's "
             f"{A}use_rollout_log_probs={a.use_rollout_log_probs} / compute_prox_log_prob={a.compute_prox_log_prob}; "
             "set one of them")
        return
    rc.bypass_mode = rollout
