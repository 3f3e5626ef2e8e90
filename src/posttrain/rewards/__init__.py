"""Rewards: plain functions picked by a row's `data_source`.

`compute_score(data_source, solution_str, ground_truth, extra_info=None)`
has the signature of verl's `default_compute_score`, so a verl reward file
works here as `reward.custom_fn=FILE.py:FUNCTION`, and a custom file can
fall back on this dispatcher for the data sources it does not handle.

    compute_score("openai/gsm8k", "... #### 18", "18")                              # 1.0
    compute_score("countdown", "<answer>4*6*1</answer>", {"target": 24, "numbers": [4, 6, 1]})  # 1.0
    compute_score("arith", "68", "68")                                              # 1.0
    compute_score("HuggingFaceH4/MATH-500", "... \\boxed{\\frac{1}{2}}", "0.5")          # 1.0
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain.rewards import arith, countdown, gsm8k, math

# data_source -> fn(solution_str, ground_truth) -> float
REWARD_FNS: dict[str, Callable] = {
    "openai/gsm8k": gsm8k.compute_score,  # verl's name, written by `posttrain preprocess gsm8k`
    "gsm8k": gsm8k.compute_score,
    "countdown": countdown.compute_score,
    "arith": arith.compute_score,
    # MATH-style: the last \boxed{} answer, checked for equivalence by math-verify
    "DigitalLearningGmbH/MATH-lighteval": math.compute_score,  # written by `posttrain preprocess math`
    "lighteval/MATH": math.compute_score,
    "HuggingFaceH4/MATH-500": math.compute_score,
}


def reward_fn_for(data_source: str) -> Callable:
    """The built-in reward for a data_source, or ValueError naming the known ones."""
    fn = REWARD_FNS.get(data_source)
    if fn is None and isinstance(data_source, str) and "countdown" in data_source:
        fn = countdown.compute_score  # TinyZero matches any name containing "countdown"
    if fn is None:
        raise ValueError(
            f"no built-in reward for data_source '{data_source}': pass reward.custom_fn=FILE.py:FUNCTION "
            f"(built-in: {', '.join(REWARD_FNS)}, or any name containing 'countdown')"
        )
    return fn


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """The score of one response by its row's data_source (extra_info is
    accepted for verl's signature; the built-in rewards do not use it)."""
    return float(reward_fn_for(data_source)(solution_str, ground_truth))


__all__ = ["REWARD_FNS", "compute_score", "reward_fn_for"]
