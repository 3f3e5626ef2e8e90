"""verl's keys -> posttrain's, one layer (a file's keys, or the command line's) in one pass: its SFT trainer's
spellings for `posttrain sft` (sft.py), then its RL trainer's (keys.py's tables), its custom reward's two keys
and its one-step off-policy switch. posttrain's own keys pass as they are, and so does a key neither framework
has: config/load.py's checks name it.

    translate({"actor_rollout_ref.actor.optim.lr": 1e-6, "actor.lr": 2e-6}, "on the command line")
    # -> {"actor.lr": 2e-06}
"""

from __future__ import annotations

from typing import Any

from posttrain.config.flat import below_dict_key
from posttrain.config.schema import SCHEMA
from posttrain.config.dialects.verl import sft
from posttrain.config.dialects.verl.resolve import reads
from posttrain.config.dialects.verl.keys import (CUSTOM_REWARD_NAME, CUSTOM_REWARD_PATH, HYBRID_ENGINE, MM_CACHE,
                                          OLD_MM_CACHE, PREFIXES, SEPARATE_ROLLOUT, to_canonical)
from posttrain.errors import ConfigError
from posttrain.text.lines import printable


def translate(flat: dict[str, Any], origin: str, command: str = "train") -> dict[str, Any]:
    """One layer's flat keys (verl's, posttrain's, or both) as posttrain's keys; command="sft" (`posttrain sft`)
    reads verl's SFT trainer's spellings first."""
    if command == "sft":
        flat = sft.translate(flat, origin)
    out: dict[str, Any] = {}
    reward_path = flat.pop(CUSTOM_REWARD_PATH, None)
    reward_name = flat.pop(CUSTOM_REWARD_NAME, None)
    if reward_path:
        out["reward.custom_fn"] = f"{reward_path}:{reward_name or 'compute_score'}"
    separate = flat.pop(HYBRID_ENGINE, True)
    if separate not in (True, False):
        raise ConfigError(f"{HYBRID_ENGINE}={printable(separate)}: true or false")
    for key, value in flat.items():
        ours = to_canonical(key, SCHEMA) or _below_dict_key(key)
        if ours is None:
            out[key] = value  # no key of posttrain's or verl's: the loader's checks refuse it
            continue
        if value is None and key.endswith(".warmup_style"):
            continue  # verl's deprecated spelling, left null beside lr_scheduler_type (its own optim/fsdp.yaml)
        out[ours] = value
    _mm_cache(out)
    if separate is False:  # verl's one-step off-policy: posttrain's asynchronous training, k = 1 unless set
        for key, value in SEPARATE_ROLLOUT.items():
            out.setdefault(key, value)
    return out


def _mm_cache(out: dict) -> None:
    """vLLM's engine argument disable_mm_preprocessor_cache, as verl's VLM scripts pass it
    (+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True), is gone from vLLM (0.13 on):
    true is its mm_processor_cache_gb=0 (no cache of the processor's outputs), false vLLM's default cache, as verl
    converts it itself."""
    value = out.pop(OLD_MM_CACHE, None)
    if value is None:
        return
    if value not in (True, False):
        raise ConfigError(f"{OLD_MM_CACHE}={printable(value)}: true or false")
    if value:
        out.setdefault(MM_CACHE, 0)


def _below_dict_key(key: str) -> str | None:
    """Our spelling of a key inside a free-form mapping (rollout.engine_kwargs.vllm.X, rollout.trace.X), verl's
    prefixes mapped."""
    spellings = [key] + [ours + key[len(verl):] for verl, ours in PREFIXES if key.startswith(verl)]
    return next((k for k in spellings if below_dict_key(k) or reads(k)), None)

