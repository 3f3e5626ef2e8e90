"""GSM8K's rule-based reward, with verl's semantics (verl/utils/reward_score/gsm8k.py).

Only the last 300 characters of the response are searched (the answer comes
last; long texts make the regex slow).

- strict: the last `#### <number>`, where <number> is `-?[0-9.,]+` right
  after "#### ", with its commas removed. "#### $18" has no number right
  after the marks, so it extracts nothing (verl's `$` stripping never fires).
- flexible: the last run of `-?[0-9.,]+` in the text that is not just "."
  (commas are kept, as in verl: "1,234" does not equal "1234").

The extracted text is compared with ground_truth as a string: "18" == "18"
scores `score` (1.0); "18.0" or "7." does not match "18" / "7" and scores
`format_score` (0.0 by default); nothing extracted scores 0.

    compute_score("... so she makes 18 dollars.\\n#### 18", "18")   # 1.0
    compute_score("#### 1,234", "1234")                             # 1.0
    compute_score("#### 17", "18", format_score=0.1)                # 0.1
    compute_score("the answer is 18", "18")                         # 0.0 (strict needs ####)
    compute_score("the answer is 18", "18", method="flexible")      # 1.0
"""

from __future__ import annotations

import re

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer text found as `method` says, or None."""
    text = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        found = _NUMBER.findall(text)
        if not found:
            return None
        # the last candidate that is not "."; when every one is ".", verl's loop
        # ends on the first, so "." is returned (it then scores format_score)
        return next((c for c in reversed(found) if c != "."), found[0])
    raise ValueError(f"unknown GSM8K extraction method '{method}'; use strict or flexible")


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
