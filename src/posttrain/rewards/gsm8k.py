"""GSM8K's rule-based reward, with verl's semantics.

Only the last 300 characters are searched. strict: the last `#### <number>`
with commas and `$` stripped; flexible: the last number. A match scores
`score` (1.0), an extracted but wrong answer `format_score` (0.0 by
default), no answer 0.
"""

from __future__ import annotations

import re

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    text = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        for candidate in reversed(_NUMBER.findall(text)):
            if candidate not in ("", "."):
                return candidate
        return None
    raise ValueError(f"unknown method '{method}'; use strict or flexible")


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
