"""MATH-style answers: the last `\\boxed{...}` of a response, checked for
mathematical equivalence with the ground truth by math-verify (sympy
underneath), not by string equality. Scores are 1.0 or 0.0.

    compute_score("... so the answer is \\boxed{\\frac{1}{2}}.", "0.5")      # 1.0
    compute_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")                          # 1.0
    compute_score("\\boxed{x = 3}", "$3$")                                     # 1.0
    compute_score("\\boxed{0.33}", "\\frac{1}{3}")                             # 0.0
    compute_score("the answer is 5", "5")                                      # 0.0: no boxed answer
    compute_score_answer_line("...\\nAnswer: 5", "5")                          # 1.0: an `Answer:` line also counts
    compute_score_dapo("...\\nAnswer: 4", "5")                                 # -1.0 (verl's math_dapo scale)

The answer is the content of the LAST `\\boxed{...}` / `\\fbox{...}` (nested
braces matched) or `\\boxed 5`; if that one never closes, there is no answer
(as in verl). `compute_score_answer_line` also reads a final `Answer: X`
line, whichever of the two comes last (1 / 0). `compute_score_dapo`, for
the names verl scores with its math_dapo reward (math_dapo, math, aime*),
does the same on the response's last 300 characters and, like verl's,
scores +1 / -1. The ground truth may itself be written as `\\boxed{x}` or
`$x$`.

Time limit: math-verify (0.8, 0.9) times its parse and verify calls with
`signal.alarm`, which would cancel the per-call SIGALRM timer that
`rewards.scoring.score_one` sets around every reward call, and which raises
outside the main thread. Both are switched off here (`parsing_timeout=None`,
`timeout_seconds=None`), so no signal is touched and the reward works in
any thread; the limit is `reward.timeout_s`, enforced by score_one (its
`_Timeout` is a BaseException, which math-verify's `except Exception` lets
through). Cheap caps come first: an answer or ground truth longer than
MAX_ANSWER_CHARS scores 0 without being parsed, and the brace scan stops
there, so a runaway response cannot feed sympy a huge expression.
"""

from __future__ import annotations

import logging
import re

MAX_ANSWER_CHARS = 1000
# its one-off "Timeout is disabled ..." warning: on purpose, the limit is score_one's
logging.getLogger("math_verify").setLevel(logging.ERROR)
_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_LINE = re.compile(r"(?i)\banswer\s*:\s*([^\n]+)")


def _last_boxed_at(text: str, limit: int | None = None) -> tuple[int, str] | None:
    """(position, content) of the last boxed answer of `text`, or None. With
    a limit, braces are scanned no further than that many characters: an
    answer still open there comes back cut to limit + 1 characters (too
    long for the caller to score)."""
    m = None
    for m in _BOXED.finditer(text):
        pass
    if m is None:
        return None
    rest = text[m.end():] if limit is None else text[m.end():m.end() + limit + 2]
    if rest.startswith("{"):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                return m.start(), rest[1:i].strip()
        if limit is not None and len(rest) > limit + 1:  # still open at the cap
            return m.start(), rest[1:]
        return None  # never closed
    if rest[:1] == " ":  # `\boxed 5`: up to the next `$` or line end
        answer = re.split(r"[$\n]", rest[1:], maxsplit=1)[0].strip()
        return (m.start(), answer) if answer else None
    return None


def last_boxed(text: str, limit: int | None = None) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces
    matched), or of `\\boxed 5` (up to the next `$` or line end); None when
    there is none or the last one never closes. `limit`: see _last_boxed_at.

        last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") -> "\\frac{a}{b}"
    """
    found = _last_boxed_at(text, limit)
    return None if found is None else found[1]


def _strip_wrappers(answer: str) -> str:
    """`\\boxed{x}`, `$x$` or `x.` (a ground truth or an `Answer:` line) -> `x`."""
    answer = answer.strip()
    if _BOXED.match(answer):
        inner = last_boxed(answer)
        if inner is not None:
            answer = inner
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$").strip()
    return answer


def extract_answer(solution_str: str, answer_line: bool = False) -> str | None:
    """The response's final answer: its last boxed one; with answer_line,
    the last `Answer: X` line instead when that comes later. None if none."""
    found = _last_boxed_at(solution_str, MAX_ANSWER_CHARS)
    if answer_line:
        m = None
        for m in _ANSWER_LINE.finditer(solution_str):
            pass
        if m is not None and (found is None or m.start() > found[0]):
            line = m.group(1).strip()
            if len(line) > MAX_ANSWER_CHARS:
                return line  # too long: scores 0 unparsed
            inline = re.findall(r"\$([^$]+)\$", line)  # "the answer is $5$." -> "5"
            return _strip_wrappers(inline[-1] if inline else line.rstrip(".")) or None
    return None if found is None else found[1]


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


def _score(answer: str | None, ground_truth) -> float:
    truth = _strip_wrappers(str(ground_truth))
    if not answer or not truth or len(answer) > MAX_ANSWER_CHARS or len(truth) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if is_equivalent(answer, truth) else 0.0


def compute_score(solution_str: str, ground_truth) -> float:
    """1.0 when the response's last boxed answer equals the ground truth
    mathematically, else 0.0 (also when there is no boxed answer)."""
    return _score(extract_answer(solution_str), ground_truth)


def compute_score_answer_line(solution_str: str, ground_truth) -> float:
    """compute_score, where a final `Answer: X` line also counts: whichever
    of it and the last boxed answer comes last. 1.0 or 0.0."""
    return _score(extract_answer(solution_str, answer_line=True), ground_truth)


def compute_score_dapo(solution_str: str, ground_truth) -> float:
    """DAPO's reward, on verl's scale: +1.0 when the final `Answer: X` line
    (or, if later, the last boxed answer) in the response's last 300
    characters equals the ground truth, else -1.0, as verl's math_dapo."""
    correct = _score(extract_answer(solution_str[-300:], answer_line=True), ground_truth)
    return 1.0 if correct == 1.0 else -1.0
