"""NeMo-RL's importance-sampling correction (loss_fn.use_importance_sampling_correction and
truncated_importance_sampling_*) written as the algorithm.rollout_correction.* keys (verl's names) that reproduce
it: the combinations algorithms/rollout_corr.py's module docstring lists.

    from_nemo_rl(True, "tis", 2.0, None)   # {"rollout_is": "token", "rollout_is_threshold": 2.0, ...}
"""

from __future__ import annotations

NEMO_RL_KEY = "loss_fn."
NEMO_RL_TYPES = ("tis", "icepop", "seq-mask-tis")


def from_nemo_rl(use_importance_sampling_correction: bool, truncated_importance_sampling_type: str | None,
                 truncated_importance_sampling_ratio: float | None,
                 truncated_importance_sampling_ratio_min: float | None,
                 sequence_level: bool = False) -> dict:
    """NeMo-RL's ClippedPGLossFn correction settings (loss_fn.*; sequence_level is its
    sequence_level_importance_ratios) -> the verl keys that reproduce it, for `from_verl`: rollout_is,
    rollout_is_threshold, rollout_is_threshold_lower, rollout_rs, rollout_rs_threshold,
    rollout_rs_threshold_lower; {} with the correction off. With C the ratio and m the ratio_min, the
    level "token" ("sequence" with sequence_level):

    - no type: the raw IS weights (rollout_is_threshold None, not truncated);
    - "tis": IS weights truncated to [m (none when unset), C];
    - "icepop": IS weights (C) and rejection outside [m, C] at the same level;
    - "seq-mask-tis": raw token IS weights and geometric rejection outside [m, C].

    Refused as NeMo-RL refuses them: a type without the correction on, an unknown type, a ratio without
    a type (or not > 0), icepop or seq-mask-tis without ratio_min, ratio_min above the ratio,
    seq-mask-tis with sequence_level. Refused here too: ratio_min without a type (NeMo-RL ignores it),
    ratio_min below 0 or equal to the ratio (an empty band here). NeMo-RL zeroes a rejected token's
    weight and keeps it in the loss's denominator; posttrain removes it from the mask (module docstring)."""
    typ, ratio, ratio_min = (truncated_importance_sampling_type, truncated_importance_sampling_ratio,
                             truncated_importance_sampling_ratio_min)

    def fail(key: str, message: str):
        raise ValueError(f"{NEMO_RL_KEY}{key}: {message}")

    if typ is None:
        if ratio is not None:
            fail("truncated_importance_sampling_ratio", "needs truncated_importance_sampling_type (one of "
                 f"{', '.join(NEMO_RL_TYPES)}); NeMo-RL refuses a ratio without a type")
        if ratio_min is not None:
            fail("truncated_importance_sampling_ratio_min", "needs truncated_importance_sampling_type (one of "
                 f"{', '.join(NEMO_RL_TYPES)}); NeMo-RL would ignore it")
    else:
        if not use_importance_sampling_correction:
            fail("truncated_importance_sampling_type", "needs use_importance_sampling_correction: true")
        if typ not in NEMO_RL_TYPES:
            fail("truncated_importance_sampling_type", f"one of {', '.join(NEMO_RL_TYPES)} or null, got {typ!r}")
        if ratio is None or not ratio > 0:
            fail("truncated_importance_sampling_ratio", f"a number > 0 with type {typ}, got {ratio!r}")
        if ratio_min is None and typ != "tis":
            fail("truncated_importance_sampling_ratio_min", f"type {typ} needs it (the band's lower bound)")
        if ratio_min is not None and not 0 <= ratio_min < ratio:
            fail("truncated_importance_sampling_ratio_min", f"must be >= 0 and below "
                 f"truncated_importance_sampling_ratio ({ratio!r}), got {ratio_min!r}")
        if typ == "seq-mask-tis" and sequence_level:
            fail("sequence_level_importance_ratios", "seq-mask-tis weighs tokens (its band is on the sequence's "
                 "geometric mean): it needs sequence_level_importance_ratios false")
    if not use_importance_sampling_correction:
        return {}
    level = "sequence" if sequence_level else "token"
    keys = dict(rollout_is=level, rollout_is_threshold=None, rollout_is_threshold_lower=None,
                rollout_rs=None, rollout_rs_threshold=None, rollout_rs_threshold_lower=None)
    if typ == "tis":
        keys.update(rollout_is_threshold=ratio, rollout_is_threshold_lower=ratio_min)
    elif typ == "icepop":
        keys.update(rollout_is_threshold=ratio, rollout_rs=level, rollout_rs_threshold=ratio,
                    rollout_rs_threshold_lower=ratio_min)
    elif typ == "seq-mask-tis":
        keys.update(rollout_rs="geometric", rollout_rs_threshold=ratio, rollout_rs_threshold_lower=ratio_min)
    return keys
