"""The arith task's reward: 1.0 when the last integer in the response is the sum."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def compute_score(solution_str: str, ground_truth: str) -> float:
    found = _INT.findall(solution_str)
    return 1.0 if found and found[-1].lstrip("+") == str(ground_truth).strip() else 0.0
