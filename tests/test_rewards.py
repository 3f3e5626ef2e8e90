import json
import time
from pathlib import Path

import pytest

from posttrain.data.preprocess.gsm8k import extract_answer
from posttrain.errors import RewardError
from posttrain.rewards import compute_score
from posttrain.rewards import countdown, gsm8k
from posttrain.rewards.custom import load_reward_fn
from posttrain.rewards.scoring import score_batch

HERE = Path(__file__).parent
SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_gsm8k_strict_and_flexible():
    assert gsm8k.compute_score("so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0                 # commas stripped
    assert gsm8k.compute_score("#### -5", "-5") == 1.0
    assert gsm8k.compute_score("#### 8", "7") == 0.0                        # wrong: format_score 0
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("the answer is 7", "7") == 0.0               # strict needs ####
    assert gsm8k.compute_score("#### 6 then #### 7", "7") == 1.0            # the last one counts
    assert gsm8k.compute_score("#### 7" + "x" * 300, "7") == 0.0           # only the last 300 chars
    assert gsm8k.compute_score("the answer is 7", "7", method="flexible") == 1.0
    assert gsm8k.compute_score("the answer is 7.", "7", method="flexible") == 0.0  # verl keeps the "." ("7.")
    assert gsm8k.compute_score("12 and then 7", "7", method="flexible") == 1.0
    assert gsm8k.compute_score("no numbers", "7", method="flexible") == 0.0


def gsm8k_rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def check_reference_solutions(rows):
    for row in rows:
        truth = extract_answer(row["answer"])
        assert compute_score("openai/gsm8k", row["answer"], truth) == 1.0, row["answer"][-80:]
        wrong = str(int(float(truth)) + 1)
        assert compute_score("openai/gsm8k", row["answer"], wrong) == 0.0


def test_gsm8k_reference_solutions_score_one():
    check_reference_solutions(gsm8k_rows(HERE / "data" / "gsm8k_sample.jsonl"))


@pytest.mark.shared_data
@pytest.mark.skipif(not SHARED_GSM8K.exists(), reason="../shared/data/gsm8k is not present")
def test_gsm8k_reference_solutions_score_one_on_the_whole_dataset():
    rows = gsm8k_rows(SHARED_GSM8K / "train.jsonl") + gsm8k_rows(SHARED_GSM8K / "test.jsonl")
    assert len(rows) == 8792
    check_reference_solutions(rows)


GT = {"target": 24, "numbers": [4, 6, 1]}


def test_countdown():
    assert countdown.compute_score("<think>hm</think> <answer> 4 * 6 * 1 </answer>", GT) == 1.0
    assert countdown.compute_score("<answer>(6 - 1 - 1) * 6</answer>", GT) == 0.1   # wrong numbers
    assert countdown.compute_score("<answer>4 + 6 + 1</answer>", GT) == 0.1          # 11, not 24
    assert countdown.compute_score("<answer>4 * 6</answer>", GT) == 0.1              # 1 unused
    assert countdown.compute_score("4 * 6 * 1", GT) == 0.0                           # no tags
    assert countdown.compute_score("<answer>1</answer> <answer>4 * 6 * 1</answer>", GT) == 1.0  # last
    assert countdown.compute_score("<answer>4 * 6 / (1 - 1)</answer>", {"target": 24, "numbers": [4, 6, 1, 1]}) == 0.1
    # text that is not arithmetic is never evaluated: it fails the number check or the character check
    assert countdown.compute_score("<answer>__import__('os') 4 6 1</answer>", GT) == 0.1
    with pytest.raises(ValueError):
        countdown.evaluate("__import__('os')")
    assert compute_score("countdown", "<answer>(4*6)/1</answer>", GT) == 1.0


def test_arith_and_dispatch():
    assert compute_score("arith", "68", "68") == 1.0
    assert compute_score("arith", "it is 60 ... no, 68", "68") == 1.0
    assert compute_score("arith", "67", "68") == 0.0
    assert compute_score("arith", "", "68") == 0.0
    with pytest.raises(ValueError, match="custom_fn"):
        compute_score("my/dataset", "x", "y")


def test_custom_reward_loading(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(solution_str == ground_truth)\n"
                 "def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    assert load_reward_fn(str(f))("d", "a", "a") == 1.0                 # default name compute_score
    assert load_reward_fn(f"{f}:other")("d", "a", "b") == 0.5
    with pytest.raises(RewardError, match="does not exist"):
        load_reward_fn(str(tmp_path / "nope.py"))
    with pytest.raises(RewardError, match="compute_score, other"):
        load_reward_fn(f"{f}:missing")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(RewardError, match="SyntaxError"):
        load_reward_fn(f"{bad}:f")


def test_scoring_survives_bad_rewards():
    def fn(source, text, truth, extra):
        if text == "raise":
            raise RuntimeError("boom")
        if text == "slow":
            time.sleep(5)
        if text == "dict":
            return {"score": 0.5, "acc": 1}
        if text == "bool":
            return True
        if text == "nan":
            return float("nan")
        return 1.0

    texts = ["ok", "raise", "slow", "dict", "bool", "nan"]
    start = time.perf_counter()
    r = score_batch(fn, ["a"] * 6, texts, ["t"] * 6, [{}] * 6, timeout_s=0.2)
    assert time.perf_counter() - start < 3
    assert r.scores == [1.0, 0.0, 0.0, 0.5, 1.0, 0.0]
    assert (r.num_errors, r.num_timeouts) == (2, 1)
    assert r.errors_by_source == {"a": 3}
    assert any("boom" in m for m in r.messages) and any("0.2 s" in m for m in r.messages)
