"""The GSM8K answer checker: verl's Gsm8kTool (tool name `calc_gsm8k_reward`, argument `answer`).

    check_gsm8k_answer({"answer": "18"}, {"ground_truth": "18"})
    # "parsed answer: 18; correct (score 1.0)"

The model submits its answer; the tool scores it against the sample's ground
truth with posttrain's GSM8K reward (rewards.gsm8k) as verl's tool does: the
answer prefixed with "#### " unless it starts so, the last number in it
taken ("flexible" extraction), 1.0 when it equals the ground truth, else 0.0.

The ground truth is verl's per-sample tool argument when the row has one,
extra_info.tools_kwargs.<tool name>.create_kwargs.ground_truth (what verl's
GSM8K multi-turn preprocessing writes), else the row's ground truth.
Unlike verl's tool, a submission earns no reward of its own here (verl gives
-0.05 for one that does not improve on the sample's best): the answer
checker only tells the model how it did.
"""

from __future__ import annotations

import json

from posttrain.rewards import gsm8k

NAME = "calc_gsm8k_reward"  # verl's name: its data's tools_kwargs are keyed by it
SCHEMA = {
    "name": NAME,
    "description": "Check an answer to the GSM8K math problem: 1.0 if the parsed answer is correct, else 0.0.",
    "parameters": {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "The answer to the problem, a number"}},
        "required": ["answer"],
    },
}


def ground_truth_for(tool_name: str, context: dict):
    """The sample's ground truth for this tool: verl's tools_kwargs one, else context["ground_truth"]
    (None if neither)."""
    extra = context.get("extra_info") or {}
    kwargs = extra.get("tools_kwargs") if isinstance(extra, dict) else None
    if isinstance(kwargs, str):  # stored as JSON text
        try:
            kwargs = json.loads(kwargs)
        except ValueError:
            kwargs = None
    create = ((kwargs or {}).get(tool_name) or {}).get("create_kwargs") if isinstance(kwargs, dict) else None
    if isinstance(create, dict) and create.get("ground_truth") is not None:
        return create["ground_truth"]
    return context.get("ground_truth")


def check_gsm8k_answer(arguments: dict, context: dict, tool_name: str = NAME) -> str:
    """What the model reads after submitting arguments["answer"]; ValueError when the sample has no ground truth."""
    answer = str(arguments.get("answer", ""))
    truth = ground_truth_for(tool_name, context)
    if truth is None:
        raise ValueError("this sample has no ground truth to check the answer against")
    response = answer if answer.startswith("#### ") else "#### " + answer
    parsed = gsm8k.extract_answer(response, method="flexible")
    score = gsm8k.compute_score(response, str(truth), method="flexible", format_score=0.0, score=1.0)
    if parsed is None:
        return f"no number found in the answer {answer[:80]!r} (score {score})"
    return f"parsed answer: {parsed}; {'correct' if score == 1.0 else 'incorrect'} (score {score})"
