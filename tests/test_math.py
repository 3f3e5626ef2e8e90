"""MATH-style data and the math-equivalence reward, on literal cases."""

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.cli import main
from posttrain.data.preprocess.math import INSTRUCTION
from posttrain.data.schema import read_rows
from posttrain.errors import DataError
from posttrain.rewards import compute_score as dispatch
from posttrain.rewards import math as math_reward
from posttrain.rewards.math import compute_score, last_boxed
from posttrain.rewards.scoring import score_batch


@pytest.mark.parametrize("response, truth", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("\\boxed{1/3}", "\\frac{1}{3}"),
    ("\\boxed{x = 3}", "3"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}2"),
    ("\\boxed{(1, 2]}", "(1,2]"),
    ("\\boxed{1,000}", "1000"),
    ("first \\boxed{4}, on second thought \\boxed{5}", "5"),  # the last boxed answer counts
    ("\\fbox{12}", "\\boxed{12}"),  # a boxed ground truth is unwrapped
    ("\\boxed{3}", "$3$"),
    ("\\boxed 7$ done", "7"),
])
def test_equivalent_forms_score_one(response, truth):
    assert compute_score(response, truth) == 1.0


@pytest.mark.parametrize("response, truth", [
    ("\\boxed{\\sqrt{2}}", "2"),
    ("\\boxed{0.33}", "\\frac{1}{3}"),
    ("\\boxed{-3}", "3"),
    ("\\boxed{[1, 2]}", "(1,2)"),
    ("\\boxed{\\pi}", "3.14159"),
    ("first \\boxed{5}, on second thought \\boxed{4}", "5"),
    ("the answer is 5", "5"),  # no boxed answer
    ("\\boxed{12", "12"),  # never closed
    ("\\boxed{" + "1+" * 600 + "1}", "601"),  # longer than MAX_ANSWER_CHARS: not parsed
    ("\\boxed{5}", ""),
])
def test_wrong_or_missing_answers_score_zero(response, truth):
    assert compute_score(response, truth) == 0.0


def test_last_boxed_matches_nested_braces():
    assert last_boxed("\\boxed{1} and \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{\\text{(A)} \\{x\\}}") == "\\text{(A)} \\{x\\}"
    assert last_boxed("\\boxed{1} then \\boxed{2") == "1"  # an unclosed last one falls back to the one before
    assert last_boxed("\\boxedx{3}") is None and last_boxed("none") is None


def test_routing_by_data_source():
    response = "We get \\boxed{\\frac{1}{2}}"
    for source in ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500"):
        assert dispatch(source, response, "0.5") == 1.0
        assert dispatch(source, response, "0.25") == 0.0


def test_a_slow_comparison_is_cut_off_by_the_reward_time_limit(monkeypatch):
    calls = []

    def slow(answer, truth):
        calls.append(answer)
        if answer == "slow":
            time.sleep(30)
        return answer == truth

    monkeypatch.setattr(math_reward, "is_equivalent", slow)
    source = "HuggingFaceH4/MATH-500"
    start = time.monotonic()
    result = score_batch(dispatch, [source] * 3, ["\\boxed{slow}", "\\boxed{7}", "\\boxed{8}"], ["7"] * 3,
                         [{}] * 3, timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert result.scores == [0.0, 1.0, 0.0] and result.num_timeouts == 1 and result.num_errors == 0
    assert calls == ["slow", "7", "8"]


def test_the_real_comparison_runs_inside_the_time_limit():
    """math-verify's own signal timeouts are off: they would cancel score_batch's timer."""
    result = score_batch(dispatch, ["HuggingFaceH4/MATH-500"] * 2, ["\\boxed{2\\sqrt{2}}", "\\boxed{3}"],
                         ["\\sqrt{8}", "4"], [{}, {}], timeout_s=20)
    assert result.scores == [1.0, 0.0] and result.num_timeouts == 0 and result.num_errors == 0


# ---------------------------------------------------------------- preprocessing

MATH_ROWS = [
    {"problem": "What is $1/2$ as a decimal?", "solution": "It is $\\boxed{0.5}$.", "level": "Level 1",
     "type": "Prealgebra"},
    {"problem": "Simplify $\\sqrt{8}$.", "solution": "First \\boxed{2} no: $\\boxed{2\\sqrt{2}}$", "level": "Level 2",
     "type": "Algebra"},
    {"problem": "No answer here.", "solution": "We never box it.", "level": "Level 3", "type": "Algebra"},
]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli(argv):
    return main(["preprocess", "math", *argv])


def test_math_jsonl_splits_rows_and_skips_unanswered(tmp_path, capsys):
    write_jsonl(tmp_path / "in" / "train.jsonl", MATH_ROWS)
    write_jsonl(tmp_path / "in" / "test.jsonl", MATH_ROWS[:1])
    assert cli(["--input", str(tmp_path / "in"), "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 train row without an answer" in out and "train.parquet (2 rows)" in out
    train = read_rows(tmp_path / "out" / "train.parquet")
    assert train[1] == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": "Simplify $\\sqrt{8}$. " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2\\sqrt{2}"},
        "extra_info": {"split": "train", "index": 1, "level": "Level 2", "subject": "Algebra"},
    }
    assert [r["reward_model"]["ground_truth"] for r in read_rows(tmp_path / "out" / "test.parquet")] == ["0.5"]
    # the rows score with the MATH reward through the dispatcher
    assert dispatch(train[1]["data_source"], "so \\boxed{\\sqrt{8}}", train[1]["reward_model"]["ground_truth"]) == 1.0


def test_the_math_tarball_tree_json_lists_and_parquet(tmp_path):
    for i, row in enumerate(MATH_ROWS[:2]):  # MATH/train/<subject>/<n>.json, one object each
        (tmp_path / "MATH" / "train" / "algebra").mkdir(parents=True, exist_ok=True)
        (tmp_path / "MATH" / "train" / "algebra" / f"{i}.json").write_text(json.dumps(row))
    (tmp_path / "MATH" / "test" / "geometry").mkdir(parents=True)
    (tmp_path / "MATH" / "test" / "geometry" / "list.json").write_text(json.dumps(MATH_ROWS[:1] * 2))
    paths = main(["preprocess", "math", "--input", str(tmp_path / "MATH"), "--output-dir", str(tmp_path / "o")])
    assert paths == 0
    assert len(read_rows(tmp_path / "o" / "train.parquet")) == 2 and len(read_rows(tmp_path / "o" / "test.parquet")) == 2
    # MATH-500 / DeepScaleR: an `answer` field wins over the solution; a file named neither train nor test
    rows = [{"problem": "p", "solution": "\\boxed{wrong}", "answer": "\\frac{3}{4}", "subject": "Algebra",
             "level": 3, "unique_id": "test/algebra/1.json"},
            {"problem": "q", "answer": "12", "solution": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "math500.parquet")
    assert cli(["--input", str(tmp_path / "math500.parquet"), "--output-dir", str(tmp_path / "m"),
                "--data-source", "HuggingFaceH4/MATH-500"]) == 0
    out = read_rows(tmp_path / "m" / "math500.parquet")
    assert [r["reward_model"]["ground_truth"] for r in out] == ["\\frac{3}{4}", "12"]
    assert out[0]["extra_info"] == {"split": "math500", "index": 0, "level": "3", "subject": "Algebra",
                                    "unique_id": "test/algebra/1.json"}
    assert out[0]["data_source"] == "HuggingFaceH4/MATH-500"


@pytest.mark.parametrize("content, message", [
    ('{"question": "q", "answer": "1"}\n', "row 0 has no 'problem' text field"),
    ('{"problem": "q", "level": 1}\n', "row 0 has neither an 'answer' nor a 'solution' field"),
    ("not json\n", "is unreadable"),
])
def test_files_that_are_not_math_shaped_are_clear_errors(tmp_path, content, message):
    (tmp_path / "train.jsonl").write_text(content)
    with pytest.raises(DataError, match=message) as e:
        from posttrain.data.preprocess import math as prep

        prep.run([str(tmp_path / "train.jsonl")], tmp_path / "out")
    assert "train.jsonl" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_missing_inputs_and_empty_results(tmp_path, capsys):
    assert cli(["--input", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "MATH input" in capsys.readouterr().err
    write_jsonl(tmp_path / "train.jsonl", MATH_ROWS[2:])
    assert cli(["--input", str(tmp_path / "train.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "no MATH rows with an answer" in capsys.readouterr().err
