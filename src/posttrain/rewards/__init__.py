"""Rewards: plain functions picked by a row's `data_source`.

`compute_score(data_source, solution_str, ground_truth, extra_info=None)`
has the signature of verl's `default_compute_score`, so a verl reward file
works here as `reward.custom_fn=FILE.py:FUNCTION`, and a custom file can
fall back on this dispatcher for the data sources it does not handle.

    compute_score("openai/gsm8k", "... #### 18", "18")                              # 1.0
    compute_score("countdown", "<answer>4*6*1</answer>", {"target": 24, "numbers": [4, 6, 1]})  # 1.0
    compute_score("arith", "68", "68")                                              # 1.0
    compute_score("math_multi_reward", "<think>..</think>\n<answer>4</answer>", "4")   # {"score": 3.0, "format": 1.0, ...}
    compute_score("products", "287663", "287663", {"tool_calls": [...]})            # {"score": 1.0, "tool_correct": ...}
    compute_score("HuggingFaceH4/MATH-500", "... \\boxed{\\frac{1}{2}}", "0.5")          # 1.0
    compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}")   # 1.0
    compute_score("math_dapo", "...\\nAnswer: 0.75", "\\frac{3}{4}")                     # 1.0 (wrong: -1.0, as verl)
    compute_score("aime2024", "\\boxed{204}", "204")                                  # 1.0 (any "aime*" name)
    compute_score("hiyouga/geometry3k", "<think>..</think> \\boxed{2}", "2")              # 1.0 (verl's geo3k)
    compute_score("clevr-cogent", "<think>..</think><answer>3</answer>", "3")             # {"score": 1.0, "format": ...}
    compute_score("refcoco", "<answer>[0, 0, 2, 2]</answer>", "[1, 1, 3, 3]")             # {"score": 0.1 * 0.75 + 0.9 * GIoU, ...}
    compute_score("apps", "```python\\nprint(input())\\n```", '{"inputs": ["7"], "outputs": ["7"]}',
                  sandbox_fusion_url="http://127.0.0.1:8080/run_code")                 # 1.0, run by SandboxFusion

verl's code sources (SANDBOX_SOURCES) are scored by a SandboxFusion service
(rewards.sandbox): the one this process was configured with
(reward.sandbox_fusion.url), or verl's keyword arguments, as a verl reward
file passes them to verl's default_compute_score.
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain.rewards import arith, countdown, gsm8k, math, multi_reward, products, sandbox, vlm

# data_source -> fn(solution_str, ground_truth) -> float
REWARD_FNS: dict[str, Callable] = {
    "openai/gsm8k": gsm8k.compute_score,  # verl's name, written by `posttrain preprocess gsm8k`
    "gsm8k": gsm8k.compute_score,
    "countdown": countdown.compute_score,
    "arith": arith.compute_score,
    "products": products.compute_score,  # (solution_str, ground_truth, extra_info) -> {"score", "tool_correct"}
    # NeMo-RL's math_multi_reward (GDPO's example): {"score", "correctness", "integer", "format"}
    "math_multi_reward": multi_reward.compute_score,
    # MATH-style: the last \boxed{} answer, checked for equivalence by math-verify
    # (verl 0.9.1's default_compute_score scores these names with its math reward)
    "DigitalLearningGmbH/MATH-lighteval": math.compute_score,  # written by `posttrain preprocess math`
    "lighteval/MATH": math.compute_score,
    "HuggingFaceH4/MATH-500": math.compute_score,
    # verl scores these with math_dapo: a final "Answer: X" line (or a later boxed answer), +1 / -1;
    # also any name starting with "aime" (see reward_fn_for)
    "math": math.compute_score_dapo,
    "math_dapo": math.compute_score_dapo,
    "math_dapo_reasoning": math.compute_score_dapo,
    # verl scores these with prime_math (a boxed answer or an "answer:" marker), 1 / 0
    **{f"numina_{name}": math.compute_score_answer_line
       for name in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12", "olympiads")},
    # vision sets (rewards.vlm): verl's geometry3k reward, 0.9 * boxed answer right + 0.1 * format, a float
    "hiyouga/geometry3k": vlm.compute_score_geo3k,  # written by `posttrain preprocess geo3k`
    # NeMo-RL's VLM environment with vlm_grpo_3B.yaml's weights, by its task names (the named datasets'
    # data_source): {"score": weighted sum, "format": ..., the answer's check: ...}
    "clevr-cogent": vlm.compute_score_clevr,  # 0.2 format + 0.8 exact_alnum
    "geometry3k": vlm.compute_score_geometry3k,  # 0.1 format + 0.9 math_expr
    "refcoco": vlm.compute_score_refcoco,  # 0.1 format + 0.9 bbox_giou (IoU from 0.5 up)
}
# the rewards that read extra_info (a multi-turn sample's tool calls) and return verl's dict
READS_EXTRA_INFO = ("products",)
# verl's code sources: run against their test cases by a SandboxFusion service (reward.sandbox_fusion.url)
SANDBOX_SOURCES = ("codecontests", "apps", "codeforces", "taco")


def reward_fn_for(data_source: str) -> Callable:
    """The built-in reward for a data_source, or ValueError naming the known ones."""
    fn = REWARD_FNS.get(data_source)
    if fn is None and isinstance(data_source, str) and "countdown" in data_source:
        fn = countdown.compute_score  # TinyZero matches any name containing "countdown"
    if fn is None and isinstance(data_source, str) and data_source.startswith("aime"):
        fn = math.compute_score_dapo  # as verl: aime2024, aime25, ...
    if fn is None and data_source in SANDBOX_SOURCES:
        if sandbox.configured() is None:
            raise ValueError(f"no built-in reward for data_source '{data_source}' without a code sandbox: set "
                             "reward.sandbox_fusion.url (verl's reward_model.sandbox_fusion.url) to a SandboxFusion "
                             "/run_code URL")
        fn = sandbox.compute_score
    if fn is None:
        raise ValueError(
            f"no built-in reward for data_source '{data_source}': pass reward.custom_fn=FILE.py:FUNCTION "
            f"(built-in: {', '.join(REWARD_FNS)}, any name starting with 'aime', or any name containing 'countdown')"
        )
    return fn


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, sandbox_fusion_url=None,
                  concurrent_semaphore=None, memory_limit_mb=None) -> float | dict:
    """The score of one response by its row's data_source. The signature is verl's
    default_compute_score's: extra_info is accepted (only READS_EXTRA_INFO's rewards use it); those and
    math_multi_reward return verl's dict, {"score": ..., other numbers},
    and verl's sandbox_fusion_url (with concurrent_semaphore and memory_limit_mb), when given,
    scores a code source in that sandbox."""
    if sandbox_fusion_url and data_source in SANDBOX_SOURCES:
        return sandbox.compute_score(solution_str, ground_truth, url=sandbox_fusion_url,
                                     memory_limit_mb=memory_limit_mb, semaphore=concurrent_semaphore)
    if data_source in READS_EXTRA_INFO:
        return reward_fn_for(data_source)(solution_str, ground_truth, extra_info)
    score = reward_fn_for(data_source)(solution_str, ground_truth)
    return score if isinstance(score, dict) else float(score)  # a dict: verl's, with the reward's components


__all__ = ["READS_EXTRA_INFO", "REWARD_FNS", "SANDBOX_SOURCES", "compute_score", "reward_fn_for"]
