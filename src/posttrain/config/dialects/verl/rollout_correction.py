"""verl's algorithm.rollout_correction.* (posttrain's keys of the same names), either of its spellings, read
into the RolloutCorrection settings algorithms/rollout_corr.py's `correct` takes (its module docstring describes
the mechanisms and the combinations other frameworks name).

    from_verl("token", 2.0)   # RolloutCorrection(is_level="token", is_threshold=2.0, ...)

`parse_rules` reads verl's newer `rollout_rs` / `rollout_rs_threshold` pair (algorithms/rollout_rules.py's
rules): one threshold entry a listed option (comma-separated) or one shared by all; k1 entries "lower_upper" or a
single U, k2/k3 entries a single positive upper bound.
"""

from __future__ import annotations

import math

from posttrain.algorithms.rollout_corr import IS_LEVELS, RS_LEVELS, RolloutCorrection
from posttrain.algorithms.rollout_rules import RS_OPTIONS, RejectRule

VERL_KEY = "algorithm.rollout_correction."


def _verl_number(key: str, value, accepted: str, zero: bool = False) -> float | None:
    """A verl threshold as a float (a number, or a string of one), None kept; > 0 (>= 0 with `zero`).
    ValueError naming the key and what it accepts."""
    if value is None:
        return None
    number = value
    if isinstance(value, str) and "_" not in value:  # float() reads "0.5_2" as 0.52
        try:
            number = float(value)
        except ValueError:
            pass
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not (number >= 0 if zero else number > 0):
        raise ValueError(f"{VERL_KEY}{key}: {accepted}, got {value!r}")
    return float(number)


def _number(spec: str, option: str) -> float:
    try:
        if "_" in spec:  # float() reads "1_5" as 15
            raise ValueError
        value = float(spec)
    except ValueError:
        raise ValueError(f"{VERL_KEY}rollout_rs_threshold: {spec!r} for {option} is not a number") from None
    if not value > 0:  # nan too
        raise ValueError(f"{VERL_KEY}rollout_rs_threshold: {option}'s bounds must be > 0, got {spec!r}")
    return value


def parse_rules(rollout_rs: str, rollout_rs_threshold) -> tuple[RejectRule, ...]:
    """verl's comma list of options and its threshold spec (a number, or a string of comma-separated
    entries) -> the rules, in the listed order. ValueError naming the verl key on anything else."""
    options = [part.strip() for part in rollout_rs.split(",") if part.strip()]
    if not options:
        raise ValueError(f"{VERL_KEY}rollout_rs: no option in {rollout_rs!r}; known: {', '.join(RS_OPTIONS)}")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"{VERL_KEY}rollout_rs: unknown option {option!r}; known: {', '.join(RS_OPTIONS)} "
                             "(or verl 0.6's single token, sequence or geometric)")
        if options.count(option) > 1:
            raise ValueError(f"{VERL_KEY}rollout_rs: {option} is listed twice")
    if rollout_rs_threshold is None:
        raise ValueError(f"{VERL_KEY}rollout_rs_threshold: rollout_rs={rollout_rs!r} needs it: one entry a "
                         "listed option, or one for all ('lower_upper' or a number for k1, a number for k2/k3)")
    if isinstance(rollout_rs_threshold, (int, float)) and not isinstance(rollout_rs_threshold, bool):
        specs = [str(rollout_rs_threshold)]
    elif isinstance(rollout_rs_threshold, str):
        specs = [part.strip() for part in rollout_rs_threshold.split(",") if part.strip()]
    else:
        raise ValueError(f"{VERL_KEY}rollout_rs_threshold: a number or a string of comma-separated entries, "
                         f"got {rollout_rs_threshold!r}")
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{VERL_KEY}rollout_rs_threshold: {len(specs)} entries for {len(options)} options "
                         f"({', '.join(options)}): give one for all or one each")
    specs = specs * len(options) if len(specs) == 1 else specs
    rules = []
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            if "_" in spec:
                lower_s, _, upper_s = spec.partition("_")
                lower, upper = _number(lower_s, option), _number(upper_s, option)
            else:
                upper = _number(spec, option)
                lower = 1.0 / upper
        elif "_" in spec:
            raise ValueError(f"{VERL_KEY}rollout_rs_threshold: {option} takes one upper bound, got {spec!r} "
                             "('lower_upper' is for the k1 options)")
        else:
            lower, upper = None, _number(spec, option)
        rule = RejectRule(option, lower, upper)
        problem = rule.problem()
        if problem:
            raise ValueError(f"{VERL_KEY}rollout_rs_threshold: {spec!r}: {problem}")
        rules.append(rule)
    return tuple(rules)


def from_verl(rollout_is: str | None = None, rollout_is_threshold: float | str | None = 2.0,
              rollout_is_threshold_lower: float | str | None = None, rollout_is_batch_normalize: bool = False,
              rollout_rs: str | None = None, rollout_rs_threshold: float | str | None = None,
              rollout_rs_threshold_lower: float | str | None = None,
              rollout_token_veto_threshold: float | str | None = None) -> RolloutCorrection | None:
    """verl's algorithm.rollout_correction.* values -> a validated RolloutCorrection, or None when
    nothing is on (no IS weights, no rejection, no veto). `rollout_rs` in either spelling: verl 0.6's
    token | sequence | geometric (rs_level; a number rollout_rs_threshold and an optional
    rollout_rs_threshold_lower), or the newer comma list of options (rs_rules, rollout_rules.py;
    rollout_rs_threshold_lower unset). rollout_is_threshold None: IS weights not truncated (math.inf;
    posttrain's schema reads null so, where verl 0.7 computes no IS weights then).
    rollout_is_threshold_lower is posttrain's (OpenRLHF's and NeMo-RL's tis floor), not verl's. Settings
    that would do nothing (a rollout_rs_threshold without rollout_rs, ...) are refused. ValueError names
    the key and what it accepts."""
    def fail(key: str, message: str):
        raise ValueError(f"{VERL_KEY}{key}: {message}")

    if rollout_is is not None and rollout_is not in IS_LEVELS:
        fail("rollout_is", f"one of {', '.join(IS_LEVELS)} or null (no IS weights), got {rollout_is!r}")
    is_threshold = _verl_number("rollout_is_threshold", rollout_is_threshold,
                                "a number > 0, or null (not truncated)")
    is_threshold = math.inf if is_threshold is None else is_threshold
    is_lower = _verl_number("rollout_is_threshold_lower", rollout_is_threshold_lower, "a number >= 0 or null",
                            zero=True)
    if not isinstance(rollout_is_batch_normalize, bool):
        fail("rollout_is_batch_normalize", f"true or false, got {rollout_is_batch_normalize!r}")
    if rollout_is is None and (is_lower is not None or rollout_is_batch_normalize):
        key = "rollout_is_threshold_lower" if is_lower is not None else "rollout_is_batch_normalize"
        fail(key, "acts on IS weights: set rollout_is (token or sequence) too")
    if is_lower is not None and not is_lower < is_threshold:
        fail("rollout_is_threshold_lower", f"must be below rollout_is_threshold ({is_threshold!r}), got {is_lower!r}")

    rs_level, rs_threshold, rs_lower, rules = None, None, None, ()
    if rollout_rs is None:
        if rollout_rs_threshold is not None or rollout_rs_threshold_lower is not None:
            key = "rollout_rs_threshold" if rollout_rs_threshold is not None else "rollout_rs_threshold_lower"
            fail(key, "bounds rejection sampling: set rollout_rs too")
    elif not isinstance(rollout_rs, str):
        fail("rollout_rs", f"a string (token, sequence, geometric, or a comma list of options), got {rollout_rs!r}")
    elif rollout_rs.strip() in RS_LEVELS:  # verl 0.6
        rs_level = rollout_rs.strip()
        rs_threshold = _verl_number("rollout_rs_threshold", rollout_rs_threshold,
                                    f"a number > 0 with rollout_rs={rs_level} (the ratio band's upper bound; "
                                    "its lower bound is rollout_rs_threshold_lower)")
        if rs_threshold is None:
            fail("rollout_rs_threshold", f"rollout_rs={rs_level} needs it (the ratio band's upper bound)")
        rs_lower = _verl_number("rollout_rs_threshold_lower", rollout_rs_threshold_lower,
                                "a number >= 0 or null (1 / rollout_rs_threshold)", zero=True)
        lower = 1.0 / rs_threshold if rs_lower is None else rs_lower
        if not lower < rs_threshold:
            fail("rollout_rs_threshold_lower", f"the band [{lower!r}, {rs_threshold!r}] is empty: the lower bound "
                 "(1 / rollout_rs_threshold when null) must be below rollout_rs_threshold")
    else:
        if any(part.strip() in RS_LEVELS for part in rollout_rs.split(",")):
            fail("rollout_rs", f"verl 0.6's {', '.join(RS_LEVELS)} stand alone, not in a list of the newer "
                 f"options: {rollout_rs!r}")
        if rollout_rs_threshold_lower is not None:
            fail("rollout_rs_threshold_lower", "is verl 0.6's, for rollout_rs token, sequence or geometric; the "
                 "newer k1 options take 'lower_upper' in rollout_rs_threshold")
        rules = parse_rules(rollout_rs, rollout_rs_threshold)
    veto = _verl_number("rollout_token_veto_threshold", rollout_token_veto_threshold, "a number > 0 or null")

    if rollout_is is None and rs_level is None and not rules and veto is None:
        return None
    return RolloutCorrection(
        is_level=rollout_is, is_threshold=is_threshold, is_threshold_lower=is_lower,
        is_batch_normalize=rollout_is_batch_normalize, rs_level=rs_level, rs_threshold=rs_threshold,
        rs_threshold_lower=rs_lower, token_veto_threshold=veto, rs_rules=rules).validate()


def from_config(rc) -> RolloutCorrection | None:
    """from_verl of a config's algorithm.rollout_correction section (posttrain's keys are verl's names)."""
    return from_verl(rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_threshold_lower,
                     rc.rollout_is_batch_normalize, rc.rollout_rs, rc.rollout_rs_threshold,
                     rc.rollout_rs_threshold_lower, rc.rollout_token_veto_threshold)
