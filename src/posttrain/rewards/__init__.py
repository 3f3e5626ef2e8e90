"""Rewards: plain functions picked by `data_source`.

`compute_score(data_source, solution_str, ground_truth, extra_info=None)`
has verl's signature, so a verl reward file works as
`reward.custom_fn=FILE.py:FUNCTION` and this dispatcher can be called from one.
"""

from __future__ import annotations

from typing import Callable

from posttrain.rewards import arith, countdown, gsm8k

REWARD_FNS: dict[str, Callable] = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "countdown": countdown.compute_score,
    "arith": arith.compute_score,
}


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    fn = REWARD_FNS.get(data_source)
    if fn is None and isinstance(data_source, str) and "countdown" in data_source:
        fn = countdown.compute_score  # TinyZero's data sources are spelt several ways
    if fn is None:
        raise ValueError(
            f"no built-in reward for data_source '{data_source}' (known: {', '.join(REWARD_FNS)}); "
            "pass reward.custom_fn=FILE.py:FUNCTION"
        )
    return float(fn(solution_str, ground_truth))


__all__ = ["compute_score", "REWARD_FNS"]
