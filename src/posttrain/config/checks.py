"""The checks config validation is written in: each raises a ConfigError of one line that names the key, the
value and the fix (config.validate and config.validate_rollout use them; values are shown by posttrain.text.lines'
printable, repr_cut, clipped)."""

from __future__ import annotations

import math

from posttrain.config.schema import DTYPE_SPELLINGS, Config
from posttrain.errors import ConfigError
from posttrain.text.lines import printable


def get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def choice(key: str, value, allowed) -> None:
    need(value in allowed, f"{key}={printable(value)} is not one of: {', '.join(map(str, allowed))}")


def positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        value = get(cfg, key)
        need(value > 0, f"{key} must be a positive integer, got {value}")


def positive_or_null(cfg: Config, *keys: str) -> None:
    for key in keys:
        value = get(cfg, key)
        need(value is None or value > 0, f"{key} must be a positive integer or null, got {value}")


def dtype(cfg: Config, key: str) -> None:
    """verl's bf16 / fp32 / fp16 spelled out in place, then checked."""
    section, leaf = key.rsplit(".", 1)
    value = DTYPE_SPELLINGS.get(get(cfg, key), get(cfg, key))
    setattr(get(cfg, section), leaf, value)
    if value is not None:
        choice(key, value, ("float32", "bfloat16", "float16"))


def warmup_start_factor(cfg: Config, key: str) -> None:
    value = get(cfg, key)
    need(value is None or 0 < value <= 1, f"{key} must be in (0, 1] (the LR factor of the first step, as "
          f"torch's LinearLR start_factor) or null (warm-up from 1/W), got {value}")


def lr_schedule(cfg: Config, section: str) -> None:
    """<section>.lr_scheduler_type, min_lr_ratio and num_cycles (the LR after the warm-up)."""
    # training.actor.LR_SCHEDULES, spelled out: importing it would load transformers with the config
    choice(f"{section}.lr_scheduler_type", get(cfg, f"{section}.lr_scheduler_type"), ("constant", "cosine"))
    ratio, cycles = get(cfg, f"{section}.min_lr_ratio"), get(cfg, f"{section}.num_cycles")
    need(0 <= ratio <= 1, f"{section}.min_lr_ratio must be in [0, 1] (the cosine's floor as a share of "
          f"{section}.lr), got {ratio}")
    need(cycles > 0 and math.isfinite(cycles), f"{section}.num_cycles must be a number > 0 (cosine waves after "
          f"the warm-up; 0.5: one decay to the floor), got {cycles}")


def no_hybrid_sharding(cfg: Config, section: str) -> None:
    n = get(cfg, f"{section}.fsdp_size")
    need(n == -1, f"{section}.fsdp_size={n}: hybrid sharding is not supported, FSDP2 shards over every worker; "
                   "set it to -1")


def whole(value, minimum: int = 0) -> bool:
    """An integer (not a bool) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
