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


def put(cfg, key: str, value) -> None:
    section, leaf = key.rsplit(".", 1)
    setattr(get(cfg, section), leaf, value)


def fill(cfg: Config, nulls: dict[str, str]) -> None:
    """Each key of `nulls` left null takes the value of the key it names (critic.ppo_epochs: actor.ppo_epochs)."""
    for key, source in nulls.items():
        if get(cfg, key) is None:
            put(cfg, key, get(cfg, source))


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def choice(key: str, value, allowed) -> None:
    need(value in allowed, f"{key}={printable(value)} is not one of: {', '.join(map(str, allowed))}")


# a range as messages spell it -> the test of a value
RANGES = {"a positive": lambda v: v > 0, "> 0": lambda v: v > 0, "> 1": lambda v: v > 1,
          ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "in (0, 1]": lambda v: 0 < v <= 1,
          "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1}


def in_range(cfg: Config, rule: str, *keys: str) -> None:
    """Each key's value within `rule`, the range as the message says it: one of RANGES, then what it means, if
    anything; "or null" in it lets null through. Else: `{key} must be {rule}, got {value}`."""
    test = next(test for spelled, test in RANGES.items() if rule.startswith(spelled))
    for key in keys:
        value = get(cfg, key)
        need(value is None and "or null" in rule or value is not None and test(value),
             f"{key} must be {rule}, got {value}")


def positive(cfg: Config, *keys: str) -> None:
    in_range(cfg, "a positive integer", *keys)


def positive_or_null(cfg: Config, *keys: str) -> None:
    in_range(cfg, "a positive integer or null", *keys)


def dtype(cfg: Config, key: str) -> None:
    """verl's bf16 / fp32 / fp16 spelled out in place, then checked."""
    value = DTYPE_SPELLINGS.get(get(cfg, key), get(cfg, key))
    put(cfg, key, value)
    if value is not None:
        choice(key, value, ("float32", "bfloat16", "float16"))


def adamw(cfg: Config, section: str) -> None:
    """<section>'s AdamW settings (schema.OptimizerConfig): eps, lr, grad_clip, betas."""
    positive(cfg, f"{section}.eps")
    in_range(cfg, "> 0", f"{section}.lr", f"{section}.grad_clip")
    betas = get(cfg, f"{section}.betas")
    need(len(betas) == 2 and all(0 <= b < 1 for b in betas),
         f"{section}.betas must be two numbers in [0, 1), got {betas}")


def lr_schedule(cfg: Config, section: str) -> None:
    """<section>'s LR schedule (schema.OptimizerConfig): lr_warmup_start_factor, then lr_scheduler_type,
    min_lr_ratio and num_cycles (the LR after the warm-up)."""
    in_range(cfg, "in (0, 1] (the LR factor of the first step, as torch's LinearLR start_factor) or null (warm-up "
             "from 1/W)", f"{section}.lr_warmup_start_factor")
    # training.actor.LR_SCHEDULES, spelled out: importing it would load transformers with the config
    choice(f"{section}.lr_scheduler_type", get(cfg, f"{section}.lr_scheduler_type"), ("constant", "cosine"))
    in_range(cfg, f"in [0, 1] (the cosine's floor as a share of {section}.lr)", f"{section}.min_lr_ratio")
    cycles = get(cfg, f"{section}.num_cycles")
    need(cycles > 0 and math.isfinite(cycles), f"{section}.num_cycles must be a number > 0 (cosine waves after "
          f"the warm-up; 0.5: one decay to the floor), got {cycles}")


def whole(value, minimum: int = 0) -> bool:
    """An integer (not a bool) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
