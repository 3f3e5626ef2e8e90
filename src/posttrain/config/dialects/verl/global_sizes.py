"""verl's deprecated global micro-batch sizes, divided over the workers once the layers are merged.

verl counts actor_rollout_ref.actor.ppo_micro_batch_size, actor_rollout_ref.rollout.log_prob_micro_batch_size,
actor_rollout_ref.ref.log_prob_micro_batch_size, critic.ppo_micro_batch_size and critic.forward_micro_batch_size
in sequences over all its workers, and reward_model.micro_batch_size in chats over all of them; each worker takes
size // (trainer.nnodes x trainer.n_gpus_per_node / the Ulysses size), rounded down (the reward model's: // the
workers), and a result of 0 is refused. posttrain's sizes are per worker, as verl's *_per_gpu keys: translate.py
maps a global key onto its *_global twin (keys.GLOBAL), and resolve() divides it here, where the workers are known
(a layer is translated before the merge, alone).

    resolve(cfg, given)   # 2 workers: actor.ppo_micro_batch_size_global=16 -> actor.ppo_micro_batch_size=8

In place, before validation; the *_global keys are cleared, so the run's config.yaml holds the per-worker sizes.
`given` holds the keys some layer set: a global size beside the per-worker one is refused, as verl refuses both.
"""

from __future__ import annotations

from posttrain.config.checks import get, need
from posttrain.config.dialects.verl.keys import EXACT, GLOBAL, GLOBAL_SIZES
from posttrain.config.schema import Config


def resolve(cfg: Config, given: set[str]) -> None:
    tr, sp = cfg.trainer, cfg.actor.ulysses_sequence_parallel_size
    workers = tr.nnodes * tr.n_gpus_per_node
    if tr.nnodes < 1 or tr.n_gpus_per_node < 1 or sp < 1 or workers % sp:
        return  # validation refuses these sizes, in its own words
    for key, (ours, by_ulysses) in GLOBAL_SIZES.items():
        size = get(cfg, key)
        if size is None:
            continue
        theirs = _named(key, size, GLOBAL)
        need(ours not in given or get(cfg, ours) is None,
             f"{theirs}, verl's deprecated global micro-batch, and the per-worker {_named(ours, get(cfg, ours))} are "
             "both set; keep one (verl refuses both too)")
        split = sp if by_ulysses else 1
        dp = workers // split
        how = f"trainer.nnodes={tr.nnodes} x trainer.n_gpus_per_node={tr.n_gpus_per_node}" + (
            f" / actor.ulysses_sequence_parallel_size={sp}" if split > 1 else "")
        need(size // dp > 0, f"{theirs} is verl's global micro-batch over all workers: divided by the {dp} "
             f"data-parallel workers ({how}) it is {size // dp} per worker; give at least {dp}, or a per-worker "
             f"size: {_named(ours)}")
        section, leaf = ours.rsplit(".", 1)
        setattr(get(cfg, section), leaf, size // dp)
        section, leaf = key.rsplit(".", 1)
        setattr(get(cfg, section), leaf, None)


def _named(key: str, value=None, table: dict[str, str] = EXACT) -> str:
    """`key` as verl spells it (a per-worker key by its *_per_gpu spelling in EXACT, a global one by GLOBAL),
    `=value` when given, and posttrain's spelling after it where the two differ."""
    theirs = next((k for k, ours in table.items() if ours == key and (table is GLOBAL or k.endswith("_per_gpu"))),
                  key)
    shown = theirs if value is None else f"{theirs}={value}"
    return shown if theirs == key else f"{shown} ({key})"
