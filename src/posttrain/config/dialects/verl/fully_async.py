"""verl's fully asynchronous trainer (`verl.experimental.fully_async_policy`), its keys read as posttrain's
asynchronous training (docs/async.md). Its scripts set `data.train_batch_size=0` and describe a weight version by
its parts instead: the trainer takes `require_batches` mini-batches of `actor.ppo_mini_batch_size` prompts per local
update and syncs the weights after `trigger_parameter_sync_step` of them. In posttrain that is one step: its batch
is mini x require x trigger prompts, one optimizer step per mini-batch, one weight version. The rollout may run
`staleness_threshold` (a fraction of such a batch) ahead: at most ceil of it updates, posttrain's k.

translate(read, value, given) gives posttrain's keys for them before the merge (resolve.py reads the run's layers
together: `read` holds verl's keys, `value` reads a posttrain key as the merge will make it), so the run's
config.yaml holds posttrain's keys alone; `given` holds the keys the run's own layers set, so a key the run sets
itself wins over the translation, and a contradiction between the two is refused."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

from posttrain.config.checks import need
from posttrain.config.dialects.verl.keys import FULLY_ASYNC
from posttrain.text.lines import printable

A = "async_training."
# verl's defaults for its fully asynchronous trainer (its fully_async_ppo_trainer.yaml)
TRIGGER, REQUIRE, STALENESS = 4, 1, 0.1


def translate(read: dict[str, Any], value: Callable[[str], Any], given: set[str]) -> dict[str, Any]:
    """verl's fully asynchronous keys among `read` -> posttrain's keys ({} when none is set)."""
    a = {key[len(A):]: read.get(key) for key in FULLY_ASYNC}
    if all(v is None for v in a.values()):
        return {}
    s = STALENESS if a["staleness_threshold"] is None else a["staleness_threshold"]
    need(0 <= s < math.inf, f"{A}staleness_threshold must be a number >= 0 (verl's share of a batch the rollout may "
         f"sample ahead), got {printable(s)}")
    trigger = TRIGGER if a["trigger_parameter_sync_step"] is None else a["trigger_parameter_sync_step"]
    require = REQUIRE if a["require_batches"] is None else a["require_batches"]
    for name, n in (("trigger_parameter_sync_step", trigger), ("require_batches", require)):
        need(n >= 1, f"{A}{name} must be an integer >= 1, got {n}")
    k = math.ceil(s)
    if A + "max_trajectory_age_steps" in given:
        age = value(A + "max_trajectory_age_steps")
        need(age == k, f"{A}max_trajectory_age_steps={age} and verl's {A}staleness_threshold={s} (at most ceil({s}) "
             f"= {k} update{'' if k == 1 else 's'} ahead) disagree; set one of them")
    out: dict[str, Any] = {A + "enable": True, A + "max_trajectory_age_steps": k}
    mini = value("actor.ppo_mini_batch_size")
    batch = mini * require * trigger
    parts = (f"actor.ppo_mini_batch_size={mini} x {A}require_batches={require} x "
             f"{A}trigger_parameter_sync_step={trigger} = {batch} prompts")
    train = value("data.train_batch_size")
    if train == 0 or "data.train_batch_size" not in given:  # verl's scripts: 0
        train = out["data.train_batch_size"] = batch
    need(train == batch, f"data.train_batch_size={train}, but verl's fully asynchronous keys make a weight version "
         f"{parts}; set data.train_batch_size=0 (verl's) or {batch}")
    if a["total_rollout_prompts"] is not None:
        need(a["total_rollout_prompts"] >= 1, f"{A}total_rollout_prompts (verl's rollout.total_rollout_steps) must be "
             f">= 1, got {a['total_rollout_prompts']}")
        if "trainer.total_training_steps" not in given:
            out["trainer.total_training_steps"] = math.ceil(a["total_rollout_prompts"] / batch)
    if A + "stream_samples" not in given:  # verl's rollouter hands samples to the trainer as they finish
        out[A + "stream_samples"] = True
    if a["partial_rollout"] is not False and A + "in_flight_weight_updates" not in given and k > 0:
        if value("rollout.name") in ("hf", "vllm"):  # hf continues a sequence, vLLM aborts and resumes it (verl's)
            out[A + "in_flight_weight_updates"] = True
        elif a["partial_rollout"]:
            warnings.warn(f"{A}partial_rollout=true: the rollout.name={value('rollout.name')} engine samples whole "
                          "batches between weight updates (in-flight updates need rollout.name=hf or vllm)",
                          stacklevel=4)
    return {**out, **_old_log_probs(a, value, given)}


def _old_log_probs(a: dict[str, Any], value: Callable[[str], Any], given: set[str]) -> dict[str, Any]:
    """verl's use_rollout_log_probs (its default) takes the engine's log-probs as the old policy's: bypass mode;
    compute_prox_log_prob has the trainer compute them: decoupled mode."""
    prox = bool(a["compute_prox_log_prob"])
    rollout = a["use_rollout_log_probs"] is not False and not prox
    key = "algorithm.rollout_correction.bypass_mode"
    if key in given:
        need(value(key) == rollout or a["use_rollout_log_probs"] is None and a["compute_prox_log_prob"] is None,
             f"{key}={value(key)} contradicts verl's {A}use_rollout_log_probs={a['use_rollout_log_probs']} / "
             f"compute_prox_log_prob={a['compute_prox_log_prob']}; set one of them")
        return {}
    return {key: rollout}
