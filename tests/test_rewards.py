import json
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from posttrain.data.preprocess import gsm8k as gsm8k_pre
from posttrain.data.schema import read_rows
from posttrain.errors import RewardError
from posttrain.rewards import REWARD_FNS, arith, compute_score, countdown, gsm8k
from posttrain.rewards.custom import load_reward_fn
from posttrain.rewards.scoring import ScoreResult, score_batch

from helpers import NO_SHARED_GSM8K, SHARED_GSM8K

HERE = Path(__file__).parent


# --- gsm8k ------------------------------------------------------------------------------------


def test_gsm8k_strict():
    assert gsm8k.compute_score("so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0                     # commas stripped
    assert gsm8k.compute_score("#### -5", "-5") == 1.0                          # negative numbers
    assert gsm8k.compute_score("#### 6 then #### 7", "7") == 1.0                # the last one counts
    assert gsm8k.compute_score("#### 8", "7") == 0.0                            # wrong: format_score 0.0
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("#### 7", "7", score=2.0) == 2.0
    assert gsm8k.compute_score("#### 7.", "7", format_score=0.1) == 0.1         # verl keeps the "."
    assert gsm8k.compute_score("#### $18", "18", format_score=0.1) == 0.0       # "$" before the number: none found
    assert gsm8k.compute_score("####7", "7") == 0.0                             # the space is required
    assert gsm8k.compute_score("the answer is 7", "7") == 0.0                   # strict needs ####
    assert gsm8k.compute_score("", "7") == 0.0
    # only the last 300 characters are searched
    assert gsm8k.compute_score("#### 7" + "x" * 294, "7") == 1.0               # 300 characters in all
    assert gsm8k.compute_score("#### 7" + "x" * 295, "7") == 0.0               # the first "#" is cut off
    assert gsm8k.extract_answer("#### 1,234,567") == "1234567"


def test_gsm8k_flexible():
    flex = {"method": "flexible", "format_score": 0.1}
    assert gsm8k.compute_score("the answer is 7", "7", **flex) == 1.0
    assert gsm8k.compute_score("12 and then 7", "7", **flex) == 1.0
    assert gsm8k.compute_score("it drops to -3", "-3", **flex) == 1.0
    assert gsm8k.compute_score("$18 a day", "18", **flex) == 1.0
    assert gsm8k.compute_score("the answer is 7.", "7", **flex) == 0.1         # "7." is kept whole
    assert gsm8k.compute_score("it is 1,234", "1234", **flex) == 0.1           # flexible keeps commas
    assert gsm8k.compute_score("7 then a dot .", "7", **flex) == 1.0           # a lone "." is skipped
    assert gsm8k.compute_score("only a dot.", "7", **flex) == 0.1              # ... unless nothing else (verl)
    assert gsm8k.compute_score("no numbers", "7", **flex) == 0.0
    assert gsm8k.compute_score("7" + "x" * 300, "7", **flex) == 0.0            # last 300 characters only
    with pytest.raises(ValueError, match="strict or flexible"):
        gsm8k.extract_answer("7", "loose")


def check_reference_solutions(rows):
    """Every reference solution (ending '#### N') scores 1.0 against the
    preprocessor's ground truth and 0.0 against another number."""
    assert rows
    for r in rows:
        answer, truth = r["extra_info"]["answer"], r["reward_model"]["ground_truth"]
        assert compute_score("openai/gsm8k", answer, truth) == 1.0, answer[-80:]
        assert compute_score("openai/gsm8k", answer, truth + "1") == 0.0
        negated = truth[1:] if truth.startswith("-") else "-" + truth
        assert compute_score("openai/gsm8k", answer, negated) == 0.0


def test_gsm8k_reference_solutions_score_one(tmp_path):
    (tmp_path / "in").mkdir()
    shutil.copy(HERE / "data" / "gsm8k_sample.jsonl", tmp_path / "in" / "test.jsonl")
    (path,) = gsm8k_pre.run(tmp_path / "in", tmp_path / "out")
    rows = read_rows(path)
    assert len(rows) == 50 and rows[0]["reward_model"]["ground_truth"] == "18"
    check_reference_solutions(rows)


@pytest.mark.shared_data
@pytest.mark.skipif(not SHARED_GSM8K.exists(), reason=NO_SHARED_GSM8K)
def test_gsm8k_reference_solutions_score_one_on_the_whole_dataset(tmp_path):
    train, test = (read_rows(p) for p in gsm8k_pre.run(SHARED_GSM8K, tmp_path))
    assert (len(train), len(test)) == (7473, 1319)
    check_reference_solutions(train + test)


# --- countdown --------------------------------------------------------------------------------

GT = {"target": 24, "numbers": [4, 6, 1]}


def test_countdown():
    assert countdown.compute_score("<think>4*6=24</think>\n<answer> 4 * 6 * 1 </answer>", GT) == 1.0
    assert countdown.compute_score("<answer>(4*6)/1</answer>", GT) == 1.0
    assert countdown.compute_score("<answer>4 + 6 + 1</answer>", GT) == 0.1          # 11, not 24
    assert countdown.compute_score("<answer>(6 - 1 - 1) * 6</answer>", GT) == 0.1    # 1 and 6 reused, 4 unused
    assert countdown.compute_score("<answer>4 * 6</answer>", GT) == 0.1              # 1 unused
    assert countdown.compute_score("<answer>4 * 6 * 1.0</answer>", GT) == 0.1        # "0" is one more number
    assert countdown.compute_score("4 * 6 * 1", GT) == 0.0                           # no tags
    assert countdown.compute_score("<answer>4 * 6 * 1", GT) == 0.0                   # unclosed
    assert countdown.compute_score("<answer>1</answer> <answer>4 * 6 * 1</answer>", GT) == 1.0  # the last one
    assert countdown.compute_score("<answer>4 * 6 * 1</answer>\nDone.", GT) == 0.0   # not on the last line
    assert countdown.compute_score("<answer>4 *\n6 * 1</answer>", GT) == 0.0         # split across lines
    assert countdown.compute_score("<answer>4 6 1</answer>", GT) == 0.1              # not an expression
    assert countdown.compute_score("<answer>4 * 6 / (1 - 1)</answer>", {"target": 24, "numbers": [4, 6, 1, 1]}) == 0.1
    assert countdown.compute_score("<answer>4 * 6 * 1</answer>", GT, format_score=0.0, score=2.0) == 2.0
    assert countdown.compute_score("<answer>2 ** 3</answer>", {"target": 8, "numbers": [2, 3]}) == 1.0  # as eval
    assert countdown.compute_score("<answer>7 // 2</answer>", {"target": 3, "numbers": [7, 2]}) == 1.0
    assert countdown.compute_score("<answer>1 / 3 * 3</answer>", {"target": 1, "numbers": [1, 3, 3]}) == 1.0  # 1e-5
    assert countdown.compute_score("<answer>4*6*1</answer>", {"target": 24, "numbers": np.array([1, 4, 6])}) == 1.0


@pytest.mark.timeout(60)  # 9 ** 9 ** 9 computed would run for hours: the timeout catches that, not a busy machine
def test_countdown_never_runs_the_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    attack = "<answer>__import__('os').system('touch pwned') or 4 * 6 * 1</answer>"
    assert countdown.compute_score(attack, GT) == 0.1        # an equation was given (TinyZero: format score)
    assert countdown.compute_score("__import__('os').system('touch pwned')", GT) == 0.0   # no tags at all
    assert countdown.compute_score("<answer>(4).__class__ and 6 and 1</answer>", GT) == 0.1
    assert countdown.compute_score("<answer>9 ** 9 ** 9</answer>", {"target": 1, "numbers": [9, 9, 9]}) == 0.1
    assert countdown.compute_score("<answer>" + "(" * 5000 + "4*6*1" + ")" * 5000 + "</answer>", GT) == 0.1
    assert not (tmp_path / "pwned").exists()
    for text in ["__import__('os')", "(4)(6)", "...", "4 + 6 * 1 if 1 else 2", "[4][0]"]:
        with pytest.raises(ValueError):
            countdown.evaluate(text)
    assert countdown.evaluate("(1 + 2) / 3") == 1.0 and countdown.evaluate("-(2 - 5)") == 3


# --- arith, dispatch --------------------------------------------------------------------------


def test_arith():
    assert arith.compute_score("68", "68") == 1.0
    assert arith.compute_score("it is 60 ... no, 68", "68") == 1.0
    assert arith.compute_score("068", "68") == 1.0
    assert arith.compute_score("67", "68") == 0.0
    assert arith.compute_score("68 or 67", "68") == 0.0
    assert arith.compute_score("6 8", "68") == 0.0
    assert arith.compute_score("", "68") == 0.0
    assert arith.compute_score("71-3", "3") == 1.0 and arith.compute_score("x -3", "-3") == 1.0


def test_dispatch():
    assert compute_score("openai/gsm8k", "#### 7", "7") == 1.0
    assert compute_score("gsm8k", "#### 7", "7", {"split": "test"}) == 1.0
    assert compute_score("countdown", "<answer>(4*6)/1</answer>", GT) == 1.0
    assert compute_score("countdown_3to4", "<answer>4+6+1</answer>", GT) == 0.1   # TinyZero's spellings
    assert compute_score("arith", "68", "68") == 1.0 and type(compute_score("arith", "68", "68")) is float
    assert set(REWARD_FNS) >= {"openai/gsm8k", "countdown", "arith"}
    with pytest.raises(ValueError, match=r"no built-in reward for data_source 'my/data': pass reward.custom_fn="
                                         r"FILE.py:FUNCTION \(built-in: openai/gsm8k, gsm8k, countdown, arith, products, "
                                         r"math_multi_reward, DigitalLearningGmbH/MATH-lighteval"):
        compute_score("my/data", "x", "y")


# --- custom reward files ----------------------------------------------------------------------

VERL_STYLE = '''
from dataclasses import dataclass

@dataclass
class Weights:          # needs the module registered while it is imported
    hit: float = 1.0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return Weights().hit if solution_str.strip() == ground_truth else 0.0

def half(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": 1.0}

threshold = 3
'''


def test_custom_reward_loading(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(VERL_STYLE)
    fn = load_reward_fn(str(f))                                     # compute_score by default
    assert fn("openai/gsm8k", " 7 ", "7", {"index": 0}) == 1.0
    assert fn(data_source="x", solution_str="6", ground_truth="7", extra_info=None) == 0.0
    assert load_reward_fn(f"{f}:half")("d", "a", "b", {}) == {"score": 0.5, "acc": 1.0}
    assert load_reward_fn(f"{f}:")("d", "7", "7") == 1.0


def test_custom_reward_errors(tmp_path):
    with pytest.raises(RewardError, match=r"reward file '.*nope.py' does not exist; fix reward.custom_fn"):
        load_reward_fn(f"{tmp_path / 'nope.py'}:compute_score")
    f = tmp_path / "my_reward.py"
    f.write_text(VERL_STYLE)
    with pytest.raises(RewardError, match=r"has no function 'missing' \(it defines: Weights, compute_score, half\); "
                                          "fix reward.custom_fn"):
        load_reward_fn(f"{f}:missing")
    with pytest.raises(RewardError, match=r"'threshold' in reward file .* is not callable \(its type is int\)"):
        load_reward_fn(f"{f}:threshold")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(RewardError, match=r"'.*bad.py' failed to import \(SyntaxError: .*\); fix the file"):
        load_reward_fn(f"{bad}:f")
    raising = tmp_path / "raising.py"
    raising.write_text("import not_a_module_posttrain_knows\n")
    with pytest.raises(RewardError, match="ModuleNotFoundError: No module named 'not_a_module_posttrain_knows'"):
        load_reward_fn(str(raising))


# --- scoring ----------------------------------------------------------------------------------


def misbehaving(source, text, truth, extra):
    if text == "raise":
        raise RuntimeError("boom\nsecond line")
    if text == "slow":
        time.sleep(5)
    if text == "swallow":  # a broad except inside the reward must not hide the time limit
        try:
            time.sleep(5)
        except Exception:  # noqa: BLE001
            return 1.0
    return {"dict": {"score": 0.5, "acc": 1}, "nodict": {"acc": 1}, "bool": True, "int": 2, "np": np.float32(0.25),
            "nan": float("nan"), "inf": float("inf"), "str": "1"}.get(text, 1.0)


def test_scoring_survives_bad_rewards():
    texts = ["ok", "raise", "slow", "dict", "bool", "int", "np", "nan", "swallow", "str", "inf", "nodict"]
    sources = ["a", "b", "a", "a", "a", "a", "a", "b", "a", "a", "a", "a"]
    r = score_batch(misbehaving, sources, texts, ["t"] * 12, [{}] * 12, timeout_s=0.2)
    # "slow" and "swallow" were cut at the limit: had they run on, they would have scored 1.0
    assert isinstance(r, ScoreResult)
    assert r.scores == [1.0, 0.0, 0.0, 0.5, 1.0, 2.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert (r.num_errors, r.num_timeouts) == (5, 2)
    assert r.errors_by_source == {"b": 2, "a": 5}
    assert r.messages[0] == "reward for data_source 'b' raised RuntimeError: boom"
    assert "reward for data_source 'a' ran past 0.2 s" in r.messages and len(r.messages) == 5


def test_a_dict_returns_other_numbers_are_kept_per_response():
    """verl's {"score", "acc", "pred"}: the numbers beside the score are kept (bool as 0/1), text, NaN and
    failures are not, and the means count only the responses that returned the key."""
    def reward(source, text, truth, extra):
        if text == "raise":
            raise ValueError("no")
        return {"a": {"score": 1.0, "acc": True, "pred": "68", "len": 3}, "b": {"score": 0.0, "acc": 0.0},
                "c": {"score": 0.5, "acc": float("nan")}, "d": 1.0}[text]

    r = score_batch(reward, ["x"] * 5, ["a", "b", "c", "d", "raise"], ["t"] * 5, [{}] * 5)
    assert r.scores == [1.0, 0.0, 0.5, 1.0, 0.0]
    assert r.extras == [{"acc": 1.0, "len": 3.0}, {"acc": 0.0}, {}, {}, {}]
    assert r.extra_means() == {"acc": 0.5, "len": 3.0}


def test_the_products_reward_scores_the_answer_and_reports_whether_a_tool_returned_it():
    ok = {"name": "calculator", "arguments": {"expression": "347 * 829"}, "content": "287663", "error": None}
    wrong = {**ok, "content": "287653"}
    failed = {**ok, "content": "287663", "error": "error"}
    assert compute_score("products", "287663", "287663", {"tool_calls": [ok]}) == {"score": 1.0, "tool_correct": 1.0}
    assert compute_score("products", "It is 287663.", "287663", {"tool_calls": [wrong]}) == {
        "score": 1.0, "tool_correct": 0.0}  # guessed right, the tool was used wrongly
    assert compute_score("products", "287653", "287663", {"tool_calls": [wrong, ok]}) == {
        "score": 0.0, "tool_correct": 1.0}  # the tool answered; the copy is wrong
    assert compute_score("products", "287663", "287663", {"tool_calls": [failed]})["tool_correct"] == 0.0
    assert compute_score("products", "287663", "287663", None) == {"score": 1.0, "tool_correct": 0.0}
    r = score_batch(compute_score, ["products", "products"], ["287663", "1"], ["287663"] * 2,
                    [{"tool_calls": [ok]}, {"tool_calls": []}])
    assert r.scores == [1.0, 0.0] and r.extra_means() == {"tool_correct": 0.5}


def test_scoring_restores_the_previous_alarm():
    def handler(signum, frame):
        raise AssertionError("the outer alarm fired")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        r = score_batch(misbehaving, ["a", "a"], ["slow", "ok"], ["t", "t"], [{}, {}], timeout_s=0.1)
        assert r.scores == [0.0, 1.0] and r.num_timeouts == 1
        assert signal.getsignal(signal.SIGALRM) is handler
        assert 99.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_scoring_with_the_dispatcher():
    r = score_batch(compute_score, ["arith", "openai/gsm8k", "mystery"], ["68", "#### 7", "x"], ["68", "8", "y"],
                    [None, {}, {}])
    assert r.scores == [1.0, 0.0, 0.0] and r.errors_by_source == {"mystery": 1}
    assert "reward.custom_fn" in r.messages[0]
    with pytest.raises(ValueError, match="parallel lists"):
        score_batch(compute_score, ["arith"], ["68", "1"], ["68"], [{}])


def test_gsm8k_sample_file_is_the_start_of_the_test_split():
    first = json.loads((HERE / "data" / "gsm8k_sample.jsonl").read_text().splitlines()[0])
    assert first["answer"].endswith("#### 18")
    assert (HERE / "data" / "GSM8K_LICENSE").read_text().startswith("MIT License")


def test_math_multi_reward_scores_its_three_parts_as_nemo_rl_does():
    """NeMo-RL's math_multi_reward (GDPO's example): correctness of the <answer>, an integer answer, and the
    <think>...</think>\\n<answer>...</answer> format, each 0 or 1; the score is their sum (NeMo-RL's total)."""
    ok = "<think>6 * 7</think>\n<answer>42</answer>"
    assert compute_score("math_multi_reward", ok, "42") == {"score": 3.0, "correctness": 1.0, "integer": 1.0,
                                                            "format": 1.0}
    assert compute_score("math_multi_reward", ok, "41") == {"score": 2.0, "correctness": 0.0, "integer": 1.0,
                                                            "format": 1.0}
    assert compute_score("math_multi_reward", "<answer> 42 </answer>", "42")["format"] == 0.0  # no <think>
    assert compute_score("math_multi_reward", "<think>x</think>\n<answer>4.5</answer>", "4.5")["integer"] == 0.0
    two = "<think>x</think>\n<answer>1</answer><answer>42</answer>"
    assert compute_score("math_multi_reward", two, "42") == {"score": 2.0, "correctness": 1.0, "integer": 1.0,
                                                             "format": 0.0}  # the last answer; two is bad form
    assert compute_score("math_multi_reward", "it is 42", "42")["correctness"] == 0.0  # no tags: the whole text


def test_reward_data_source_scores_every_row_as_that_source():
    """reward.data_source: the pool calls the reward with that name for every row, whatever the row says."""
    from posttrain.rewards.pool import RewardPool, builtin_rewards

    pool = RewardPool(builtin_rewards, num_workers=0, timeout_s=5.0, data_source="math_multi_reward")
    result = pool.score_batch(["openai/gsm8k", "arith"], ["<think>a</think>\n<answer>7</answer>", "7"], ["7", "7"],
                              [{}, {}])
    assert result.scores == [3.0, 2.0] and result.extras[0] == {"correctness": 1.0, "integer": 1.0, "format": 1.0}
    assert result.extras[1]["format"] == 0.0
