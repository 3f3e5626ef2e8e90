"""The products task's reward (data/preprocess/products.py): the arith rule on the final answer (its
last integer is the product), and whether a tool call of the conversation returned the product.

    compute_score("It is 287663.", "287663",
                  {"tool_calls": [{"name": "calculator", "content": "287663", "error": None}]})
    # {"score": 1.0, "tool_correct": 1.0}
    compute_score("287000", "287663", {"tool_calls": []})      # {"score": 0.0, "tool_correct": 0.0}

"tool_correct" is logged as `reward/tool_correct/mean` and `val/tool_correct/mean`: the share of
samples that used the tool rightly (the call parsed, ran, and its result is the answer), beside the
score (the share answered rightly, whether or not the tool's result was copied).
"""

from __future__ import annotations

from posttrain.rewards import arith

DATA_SOURCE = "products"


def compute_score(solution_str: str, ground_truth, extra_info=None) -> dict:
    calls = extra_info.get("tool_calls") if isinstance(extra_info, dict) else None
    truth = str(ground_truth).strip()
    correct = any(isinstance(c, dict) and c.get("error") is None and str(c.get("content", "")).strip() == truth
                  for c in calls or [])
    return {"score": arith.compute_score(solution_str, ground_truth), "tool_correct": float(correct)}
