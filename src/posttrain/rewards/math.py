"""MATH-style answers: the last `\\boxed{...}` of a response, checked for
mathematical equivalence with the ground truth by math-verify (sympy
underneath), not by string equality.

    compute_score("... so the answer is \\boxed{\\frac{1}{2}}.", "0.5")      # 1.0
    compute_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")                          # 1.0
    compute_score("\\boxed{0.33}", "\\frac{1}{3}")                             # 0.0
    compute_score("the answer is 5", "5")                                      # 0.0: no boxed answer

Time limit: math-verify's own timeouts use `signal.alarm`, which would
cancel the per-call timer that `rewards.scoring.score_batch` sets around
every reward call (and fails outside the main thread), so they are switched
off here: the limit is `reward.timeout_s`, enforced by score_batch. Answers
longer than MAX_ANSWER_CHARS score 0 without being parsed, so a runaway
response cannot feed sympy a huge expression.
"""

from __future__ import annotations

import logging
import re

MAX_ANSWER_CHARS = 1000
# "Timeout is disabled ...": on purpose, the limit is score_batch's
logging.getLogger("math_verify").setLevel(logging.ERROR)
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces
    matched), or of `\\boxed 5` (up to the next `$` or line end); None when
    there is none or its braces never close.

        last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") -> "\\frac{a}{b}"
    """
    starts = [m for m in _BOXED.finditer(text)]
    for m in reversed(starts):
        rest = text[m.end():]
        if rest.startswith("{"):
            depth = 0
            for i, ch in enumerate(rest):
                depth += ch == "{"
                depth -= ch == "}"
                if depth == 0:
                    return rest[1:i].strip()
            continue  # unclosed: try an earlier one
        if rest[:1] == " ":
            answer = re.split(r"[$\n]", rest[1:], maxsplit=1)[0].strip()
            if answer:
                return answer
    return None


def _strip_wrappers(answer: str) -> str:
    """A ground truth written as `\\boxed{x}` or `$x$` -> `x`."""
    answer = answer.strip()
    inner = last_boxed(answer) if _BOXED.match(answer) else None
    if inner is not None:
        answer = inner
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$").strip()
    return answer


def _normalise(s: str) -> str:
    return re.sub(r"\s+", "", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """Whether two answers (LaTeX or plain) are mathematically equal, by math-verify."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if _normalise(answer) == _normalise(ground_truth):
        return True
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    # wrapped in \boxed{} so math-verify reads the whole string as the answer
    gold = parse(f"\\boxed{{{ground_truth}}}", configs, parsing_timeout=None)
    pred = parse(f"\\boxed{{{answer}}}", configs, parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def compute_score(solution_str: str, ground_truth) -> float:
    """1.0 when the response's last boxed answer equals the ground truth
    mathematically, else 0.0."""
    answer = last_boxed(solution_str)
    truth = _strip_wrappers(str(ground_truth))
    if answer is None or not truth or len(answer) > MAX_ANSWER_CHARS or len(truth) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if is_equivalent(answer, truth) else 0.0
