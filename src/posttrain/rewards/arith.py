"""The arith task's reward: 1.0 when the last integer in the response is the
sum in ground_truth, else 0.0.

A "-" counts as a sign only where no digit precedes it, so "10-3" reads as
10 and 3, not 10 and -3. Integers are compared by value ("068" equals "68").

    compute_score("68", "68")                    # 1.0
    compute_score("60 ... no, 68", "68")         # 1.0 (the last one counts)
    compute_score("68 or 67", "68")              # 0.0
    compute_score("", "68")                      # 0.0
"""

from __future__ import annotations

import re

_INT = re.compile(r"(?<!\d)-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer in `text` as this reward reads it ("10-3" ends with 3), or None."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def compute_score(solution_str: str, ground_truth) -> float:
    found = last_integer(solution_str)
    if found is None:
        return 0.0
    try:
        return 1.0 if found == int(str(ground_truth).strip()) else 0.0
    except ValueError:  # a ground truth that is not an integer never matches
        return 0.0
