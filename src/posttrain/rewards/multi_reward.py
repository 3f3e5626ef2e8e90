"""NeMo-RL's multi-reward math check (its `math_multi_reward` environment, GDPO's example): three rewards of a
response in `<think>...</think>\n<answer>...</answer>` form, for the GDPO estimator to normalize one by one.

    compute_score("<think>2+2</think>\n<answer>4</answer>", "4")
    # {"score": 3.0, "correctness": 1.0, "integer": 1.0, "format": 1.0}

- correctness: the text inside the last `<answer>...</answer>` (or after the last `<answer>` when it is not
  closed; the whole response when there is none), stripped, equals the ground truth exactly;
- integer: that text is all digits;
- format: the whole response is `<think>...</think>` then a newline then `<answer>...</answer>`, with one
  `<answer>` and one `</answer>`.

"score" (what the run's score and validation report) is their sum, NeMo-RL's total reward; the parts are
logged as reward/correctness/mean, reward/integer/mean, reward/format/mean (val/... in validation).
"""

from __future__ import annotations

import re

_FORMAT = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)


def answer_text(response: str) -> str:
    return response.split("<answer>")[-1].split("</answer>")[0].strip()


def compute_score(solution_str: str, ground_truth) -> dict:
    answer = answer_text(solution_str)
    correct = float(answer == str(ground_truth).strip())
    formatted = bool(_FORMAT.search(solution_str)) and solution_str.count("<answer>") == 1 \
        and solution_str.count("</answer>") == 1
    parts = {"correctness": correct, "integer": float(answer.isdigit()), "format": float(formatted)}
    return {"score": sum(parts.values()), **parts}
