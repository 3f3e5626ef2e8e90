"""Rewards of the vision-language tasks: NeMo-RL's VLM environment (its reward
functions, weighted) and verl's geometry3k reward.

    compute_score_clevr("<think>3 cubes</think> <answer> 3 </answer>", "3")
    # {"score": 1.0, "format": 1.0, "exact_alnum": 1.0}            0.2 * format + 0.8 * exact_alnum
    compute_score_geometry3k("<answer>\\frac{1}{2}</answer>", "0.5")
    # {"score": 0.975, "format": 0.75, "math_expr": 1.0}           0.1 * format + 0.9 * math_expr
    compute_score_refcoco("<think>..</think><answer>[0, 0, 10, 10]</answer>", "[0, 0, 10, 10]")
    # {"score": 1.0, "format": 1.0, "bbox_giou": 1.0}              0.1 * format + 0.9 * bbox_giou
    compute_score_geo3k("<think>..</think> so \\boxed{2}", "2")  # 1.0: verl's, 0.9 * accuracy + 0.1 * format

NeMo-RL's functions, each (response, ground truth) -> a number, all reading
the text between the FIRST `<answer>` and the LAST `</answer>` (NeMo-RL's
greedy match; none: 0):

- format: 0.25 when the response holds `<think>...</think>` anywhere, plus
  0.75 when it holds `<answer>...</answer>` anywhere (0, 0.25, 0.75 or 1);
- exact_alnum: 1 when the answer's letters and digits, lower-cased, equal the
  ground truth's ("Yes." matches "yes", " 3 " matches "3"), else 0;
- math_expr: 1 when math-verify finds the answer equal to the ground truth
  (each read as if inside `\\boxed{}`), else 0;
- bbox_giou: the GIoU of the answer's box `[x1, y1, x2, y2]` with the ground
  truth's, in [-1, 1] (identical boxes: 1; far apart: towards -1), or the
  plain IoU when the IoU is at least `giou_penalty_thres` (NeMo-RL's default
  10 never is, so GIoU always; its refcoco recipe sets 0.5). Areas of the
  union and of the enclosing box count at least 0.001, as NeMo-RL's, so a
  degenerate box does not divide by zero. An answer that is not four numbers: 0;
- geo3k: verl's reward, below, as NeMo-RL also offers it.

`combine([("format", 0.2), ("exact_alnum", 0.8)])` is NeMo-RL's
env.<task>.reward_functions list: the weights are divided by their sum, and
the score is the weighted sum; the result returns verl's dict, the score and
each function's own (unweighted) number, as multi_reward.py does.
CLEVR, GEOMETRY3K and REFCOCO are the lists of NeMo-RL's vlm_grpo_3B.yaml.
`scorer(functions)` is the reward of a run with reward.functions set (a NeMo-RL
file's env.<name>.reward_functions, as its dialect writes them: name -> weight,
or {weight, kwargs}): every row scored by that weighted sum, whatever its
data_source.

verl's geo3k (`compute_score_geo3k`, data_source "hiyouga/geometry3k"):
0.9 * accuracy + 0.1 * format, a float. format: the response is `<think>`
... `</think>` ... `\\boxed{...}` ..., starting with `<think>`; accuracy: the
last `\\boxed{` (braces balanced) holds an answer equal to the ground truth.
verl grades with mathruler's grade_answer; here math-verify grades it, as
rewards.math and NeMo-RL's own copy of this reward do (not a dependency to add
for one sympy-based check that agrees on numbers, fractions and radicals).

Cheap caps first: an answer or ground truth longer than math.MAX_ANSWER_CHARS
scores 0 without being parsed (math_expr, geo3k), so a runaway response
cannot feed sympy a huge expression. math-verify's own signal timers are off,
as in rewards.math; the limit is reward.timeout_s.
"""

from __future__ import annotations

import inspect
import math as _math
import re
from collections.abc import Callable, Sequence

from posttrain.rewards.math import MAX_ANSWER_CHARS

_ANSWER = re.compile(r"<answer>([\s\S]*)</answer>")  # greedy, as NeMo-RL: first <answer> to last </answer>
_THINK = re.compile(r"<think>[\s\S]*</think>")
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # verl's, matched on the whole text


def answer_text(response: str) -> str | None:
    """The text between the first `<answer>` and the last `</answer>`, or None."""
    m = _ANSWER.search(response)
    return None if m is None else m.group(1)


def format_score(response: str, ground_truth=None) -> float:
    """NeMo-RL's format reward: 0.25 for `<think>...</think>`, 0.75 for `<answer>...</answer>`."""
    return 0.25 * bool(_THINK.search(response)) + 0.75 * (answer_text(response) is not None)


def _alnum(text: str) -> str:
    return "".join(c for c in text if c.isalnum()).lower()


def exact_alnum(response: str, ground_truth) -> float:
    """1.0 when the answer's alphanumeric characters, case folded, equal the ground truth's."""
    answer = answer_text(response)
    return float(answer is not None and _alnum(answer) == _alnum(str(ground_truth)))


def _boxed(text: str) -> str:
    return text if text.startswith("\\boxed{") else "\\boxed{" + text + "}"


def math_equal(answer: str, ground_truth: str) -> bool:
    """math-verify's verdict as NeMo-RL asks for it: the ground truth read as LaTeX,
    the answer as an expression or LaTeX, both inside `\\boxed{}`. Over-long: False."""
    if len(answer) > MAX_ANSWER_CHARS or len(ground_truth) > MAX_ANSWER_CHARS:
        return False
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    try:
        gold = parse(_boxed(ground_truth), [LatexExtractionConfig()], parsing_timeout=None)
        pred = parse(_boxed(answer), [ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=None)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    except Exception:  # noqa: BLE001 -- NeMo-RL scores what math-verify cannot read as 0; score_one's _Timeout is no Exception
        return False


def math_expr(response: str, ground_truth) -> float:
    """1.0 when the answer is mathematically the ground truth (math-verify), else 0.0."""
    answer = answer_text(response)
    return float(answer is not None and math_equal(answer, str(ground_truth)))


def parse_box(text: str) -> tuple[float, float, float, float] | None:
    """`[x1, y1, x2, y2]` (brackets optional) -> four floats, or None.

        parse_box("[10, 20, 30, 40]") -> (10.0, 20.0, 30.0, 40.0)
    """
    parts = text.replace("[", "").replace("]", "").split(",")
    try:
        box = tuple(float(p) for p in parts)
    except ValueError:
        return None
    # float() takes "nan" and "inf"; a box of them has no area to compare
    return box if len(box) == 4 and all(_math.isfinite(v) for v in box) else None  # type: ignore[return-value]


def giou(pred: Sequence[float], truth: Sequence[float], giou_penalty_thres: float = 10.0) -> float:
    """GIoU of two `(x1, y1, x2, y2)` boxes (IoU minus the share of the enclosing box
    that neither covers), or their IoU when that is at least giou_penalty_thres.

        giou((0, 0, 2, 2), (1, 1, 3, 3)) -> 1/7 - (9 - 7)/9 = -0.0794...
    """
    (x1g, y1g, x2g, y2g), (x1r, y1r, x2r, y2r) = truth, pred
    area_g = (x2g - x1g) * (y2g - y1g)
    area_r = (x2r - x1r) * (y2r - y1r)
    inter = max(0.0, min(x2g, x2r) - max(x1g, x1r)) * max(0.0, min(y2g, y2r) - max(y1g, y1r))
    union = max(1e-3, area_g + area_r - inter)  # NeMo-RL's floor: no division by zero
    iou = inter / union
    if iou >= giou_penalty_thres:
        return iou
    hull = max(1e-3, (max(x2g, x2r) - min(x1g, x1r)) * (max(y2g, y2r) - min(y1g, y1r)))
    return iou - (hull - union) / hull


def bbox_giou(response: str, ground_truth, giou_penalty_thres: float = 10.0) -> float:
    """GIoU (or IoU, see giou) of the answer's box with the ground truth's; 0.0 when either is no box."""
    answer = answer_text(response)
    pred = None if answer is None else parse_box(answer)
    truth = parse_box(str(ground_truth))
    if pred is None or truth is None:
        return 0.0
    return float(giou(pred, truth, giou_penalty_thres))


def _last_boxed_brace(text: str) -> str | None:
    """The content of the last `\\boxed{` with its braces balanced (mathruler's reading), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    body = text[start + len("\\boxed{"):]
    for i, ch in enumerate(body[:MAX_ANSWER_CHARS + 1]):
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return body[:i].strip()
    return None  # never closed (or longer than the cap): no answer


def compute_score_geo3k(solution_str: str, ground_truth, format_weight: float = 0.1) -> float:
    """verl's geometry3k reward: (1 - format_weight) * accuracy + format_weight * format;
    0.0, 0.1, 0.9 or 1.0 with verl's weight 0.1."""
    answer = _last_boxed_brace(solution_str)
    accuracy = float(answer is not None and math_equal(answer, str(ground_truth)))
    formatted = float(_GEO3K_FORMAT.fullmatch(solution_str) is not None)
    return (1.0 - format_weight) * accuracy + format_weight * formatted


# NeMo-RL's reward function names (env.<task>.reward_functions[].name)
FUNCTIONS: dict[str, Callable[..., float]] = {
    "format": format_score, "exact_alnum": exact_alnum, "math_expr": math_expr, "bbox_giou": bbox_giou,
    "geo3k": compute_score_geo3k,
}


def combine(functions: Sequence[tuple]) -> Callable[[str, object], dict]:
    """NeMo-RL's weighted reward: `functions` is [(name, weight), ...] or
    [(name, weight, kwargs), ...]; -> fn(solution_str, ground_truth) ->
    {"score": the weighted sum with weights divided by their sum, name: that
    function's own number, ...}. Unknown names or weights summing to 0: ValueError.

        combine([("format", 1), ("exact_alnum", 3)])("<answer>no</answer>", "No")
        # {"score": 0.25 * 0.75 + 0.75 * 1.0 = 0.9375, "format": 0.75, "exact_alnum": 1.0}
    """
    parts = []
    for item in functions:
        name, weight, kwargs = (*item, {})[:3]  # (name, weight) or (name, weight, kwargs)
        if name not in FUNCTIONS:
            raise ValueError(f"no VLM reward function '{name}'; NeMo-RL's are {', '.join(FUNCTIONS)}")
        parts.append((name, float(weight), dict(kwargs or {})))
    total = sum(w for _, w, _ in parts)
    if not parts or total == 0:
        raise ValueError(f"VLM reward functions {list(functions)} have no weight; give at least one weight > 0")

    def score(solution_str: str, ground_truth) -> dict:
        values = {name: float(FUNCTIONS[name](solution_str, ground_truth, **kw)) for name, _, kw in parts}
        return {"score": sum(w / total * values[name] for name, w, _ in parts), **values}

    return score


def specs(functions: dict) -> list[tuple]:
    """reward.functions (name -> weight, or {"weight": w, "kwargs": {...}}) -> [(name, weight, kwargs), ...],
    combine's arguments. A malformed entry: ValueError naming it.

        specs({"format": 0.1, "bbox_giou": {"weight": 0.9, "kwargs": {"giou_penalty_thres": 0.5}}})
        # [("format", 0.1, {}), ("bbox_giou", 0.9, {"giou_penalty_thres": 0.5})]
    """
    out = []
    for name, spec in dict(functions).items():
        if isinstance(spec, dict):
            unknown = set(spec) - {"weight", "kwargs"}
            if unknown or "weight" not in spec or not isinstance(spec.get("kwargs") or {}, dict):
                raise ValueError(f"{name}: give a weight, or {{weight: W, kwargs: {{...}}}}, got {spec!r}")
            weight, kwargs = spec["weight"], dict(spec.get("kwargs") or {})
        else:
            weight, kwargs = spec, {}
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not _math.isfinite(weight):
            raise ValueError(f"{name}: its weight must be a number, got {weight!r}")
        if name not in FUNCTIONS:
            raise ValueError(f"no VLM reward function '{name}'; NeMo-RL's are {', '.join(FUNCTIONS)}")
        try:
            inspect.signature(FUNCTIONS[name]).bind("", "", **kwargs)
        except TypeError as e:
            raise ValueError(f"{name}: kwargs {kwargs!r} do not fit it ({e})") from None
        out.append((name, float(weight), kwargs))
    return out


def scorer(functions: dict) -> Callable[..., dict]:
    """reward.functions -> compute_score(data_source, solution_str, ground_truth, extra_info=None): every row
    scored by the weighted sum, whatever its data_source, as NeMo-RL's VLM environment scores every response of
    the data that names it (data.*.env_name). What rewards.pool's workers load."""
    score = combine(specs(functions))

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
        return score(solution_str, ground_truth)

    return compute_score


# NeMo-RL's examples/configs/vlm_grpo_3B.yaml, env.<task>.reward_functions
CLEVR = (("format", 0.2), ("exact_alnum", 0.8))
GEOMETRY3K = (("format", 0.1), ("math_expr", 0.9))
REFCOCO = (("format", 0.1), ("bbox_giou", 0.9, {"giou_penalty_thres": 0.5}))

compute_score_clevr = combine(CLEVR)
compute_score_geometry3k = combine(GEOMETRY3K)
compute_score_refcoco = combine(REFCOCO)
