"""verl's deprecated global micro-batch sizes, divided over the workers before the merge.

verl counts actor_rollout_ref.actor.ppo_micro_batch_size, actor_rollout_ref.rollout.log_prob_micro_batch_size,
actor_rollout_ref.ref.log_prob_micro_batch_size, critic.ppo_micro_batch_size and critic.forward_micro_batch_size
in sequences over all its workers, and reward_model.micro_batch_size in chats over all of them; each worker takes
size // (trainer.nnodes x trainer.n_gpus_per_node / the Ulysses size), rounded down (the reward model's: // the
workers), and a result of 0 is refused. posttrain's sizes are per worker, as verl's *_per_gpu keys: translate.py
maps a global key onto posttrain's former *_global spelling of it (keys.GLOBAL), and per_worker() divides it here,
where the run's layers are read together (resolve.py: the workers are known).

    per_worker({"actor.ppo_micro_batch_size_global": 16}, value, given)   # 2 workers:
    # -> {"actor.ppo_micro_batch_size": 8}

`value` reads a posttrain key as the merge will make it; `given` holds the keys the run's own layers set: a global
size beside the per-worker one is refused, as verl refuses both. The run's config.yaml holds the per-worker sizes.
"""

from __future__ import annotations

from typing import Any, Callable

from posttrain.config.checks import need
from posttrain.config.dialects.verl.keys import EXACT, GLOBAL, GLOBAL_SIZES


def per_worker(read: dict[str, Any], value: Callable[[str], Any], given: set[str]) -> dict[str, int]:
    """The global sizes among `read` (the dialect's keys, as resolve.py read them) -> posttrain's per-worker keys."""
    sizes = {key: read[key] for key in GLOBAL_SIZES if read.get(key) is not None}
    if not sizes:
        return {}
    nnodes, gpus, sp = value("trainer.nnodes"), value("trainer.n_gpus_per_node"), value(
        "actor.ulysses_sequence_parallel_size")
    workers = nnodes * gpus
    if nnodes < 1 or gpus < 1 or sp < 1 or workers % sp:
        return {}  # validation refuses these sizes, in its own words
    out = {}
    for key, size in sizes.items():
        ours, by_ulysses = GLOBAL_SIZES[key]
        theirs = _named(key, size, GLOBAL)
        need(ours not in given or value(ours) is None,
             f"{theirs}, verl's deprecated global micro-batch, and the per-worker {_named(ours, value(ours))} are "
             "both set; keep one (verl refuses both too)")
        split = sp if by_ulysses else 1
        dp = workers // split
        how = f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={gpus}" + (
            f" / actor.ulysses_sequence_parallel_size={sp}" if split > 1 else "")
        need(size // dp > 0, f"{theirs} is verl's global micro-batch over all workers: divided by the {dp} "
             f"data-parallel workers ({how}) it is {size // dp} per worker; give at least {dp}, or a per-worker "
             f"size: {_named(ours)}")
        out[ours] = size // dp
    return out


def _named(key: str, value=None, table: dict[str, str] = EXACT) -> str:
    """`key` as verl spells it (a per-worker key by its *_per_gpu spelling in EXACT, a global one by GLOBAL),
    `=value` when given, and posttrain's spelling after it where the two differ."""
    theirs = next((k for k, ours in table.items() if ours == key and (table is GLOBAL or k.endswith("_per_gpu"))),
                  key)
    shown = theirs if value is None else f"{theirs}={value}"
    return shown if theirs == key else f"{shown} ({key})"
