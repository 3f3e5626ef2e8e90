"""MATH-style data and the math-equivalence reward, on literal cases."""

import json
import signal
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.cli import main
from posttrain.data.preprocess import math as prep
from posttrain.data.preprocess.math import INSTRUCTION
from posttrain.data.schema import read_rows
from posttrain.errors import DataError
from posttrain.rewards import REWARD_FNS
from posttrain.rewards import compute_score as dispatch
from posttrain.rewards import math as math_reward
from posttrain.rewards.math import (
    MAX_ANSWER_CHARS, compute_score, compute_score_answer_line, compute_score_dapo, extract_answer, last_boxed,
)
from posttrain.rewards.scoring import score_batch


@pytest.mark.parametrize("response, truth", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("\\boxed{1/3}", "\\frac{1}{3}"),
    ("\\boxed{x = 3}", "3"),
    ("\\boxed{3}", "x=3"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}2"),
    ("\\boxed{(1, 2]}", "(1,2]"),
    ("\\boxed{x \\in [1,2)}", "[1,2)"),
    ("\\boxed{10\\%}", "10"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
    ("\\boxed{\\text{(A)}}", "A"),
    ("first \\boxed{4}, on second thought \\boxed{3}", "3"),  # the last boxed answer counts
    ("\\fbox{12}", "\\boxed{12}"),  # \fbox, and a boxed ground truth is unwrapped
    ("\\boxed{3}", "$3$"),
    ("\\boxed 7$ done", "7"),
])
def test_equivalent_forms_score_one(response, truth):
    assert compute_score(response, truth) == 1.0


@pytest.mark.parametrize("response, truth", [
    ("\\boxed{\\sqrt{2}}", "2"),
    ("\\boxed{1/3}", "0.33"),
    ("\\boxed{0.33}", "\\frac{1}{3}"),
    ("\\boxed{-3}", "3"),
    ("\\boxed{[1, 2]}", "(1,2)"),
    ("\\boxed{(2,3)}", "(3,2)"),
    ("\\boxed{\\pi}", "3.14159"),
    ("first \\boxed{5}, on second thought \\boxed{4}", "5"),  # an earlier right answer does not count
    ("the answer is 5", "5"),  # no boxed answer
    ("Answer: 5", "5"),  # an Answer line counts only for compute_score_dapo
    ("\\boxed{5} and then \\boxed{12", "5"),  # the last one never closes: no answer (as verl)
    ("\\boxed{" + "1+" * 600 + "1}", "601"),  # longer than MAX_ANSWER_CHARS: not parsed
    ("\\boxed{}", "0"),
    ("\\boxed{5}", ""),
])
def test_wrong_or_missing_answers_score_zero(response, truth):
    assert compute_score(response, truth) == 0.0


def test_last_boxed_matches_nested_braces():
    assert last_boxed("\\boxed{1} and \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{\\frac{\\sqrt{2}}{2}}") == "\\frac{\\sqrt{2}}{2}"
    assert last_boxed("\\boxed{\\text{(A)} \\{x\\}}") == "\\text{(A)} \\{x\\}"
    assert last_boxed("\\boxed{1} then \\boxed{2") is None
    assert last_boxed("\\boxedx{3}") is None and last_boxed("none") is None
    assert last_boxed("$\\boxed 42$") == "42" and last_boxed("\\fbox{7}") == "7"


@pytest.mark.timeout(60)
def test_pathological_responses_are_cheap():
    """Linear scans: well under a second here. A quadratic scan of these inputs takes many
    minutes, so the timeout catches one without timing a busy machine's every hiccup."""
    assert compute_score("\\boxed{" * 200_000, "1") == 0.0  # many unclosed boxes: one bounded scan
    assert compute_score("x" * 1_000_000 + "\\boxed{" + "9" * 100_000 + "}", "1") == 0.0
    assert compute_score_answer_line("Answer: " + "9" * 100_000, "1") == 0.0
    assert compute_score_dapo("Answer: " + "9" * 100_000, "1") == -1.0
    assert extract_answer("\\boxed{" + "1" * (MAX_ANSWER_CHARS + 50) + "}").__len__() > MAX_ANSWER_CHARS


@pytest.mark.parametrize("response, truth, score", [
    ("... so we get 3/4.\nAnswer: 0.75", "\\frac{3}{4}", 1.0),
    ("Answer: $x = 5$.", "5", 1.0),
    ("Answer:\n\\boxed{204}", "204", 1.0),
    ("so \\boxed{12}", "12", 1.0),  # a boxed answer alone still counts
    ("Answer: 7 was wrong, so \\boxed{12}", "12", 1.0),  # whichever comes last
    ("\\boxed{7}\nAnswer: 12", "7", 0.0),
    ("the answer is 12", "12", 0.0),
])
def test_dapo_style_answer_lines(response, truth, score):
    assert compute_score_answer_line(response, truth) == score
    assert compute_score_dapo(response, truth) == (1.0 if score else -1.0)  # verl's math_dapo scale


def test_dapo_reads_the_last_300_characters_as_verl():
    assert compute_score_dapo("Answer: 5\n" + "." * 400, "5") == -1.0
    assert compute_score_answer_line("Answer: 5\n" + "." * 400, "5") == 1.0


def test_routing_by_data_source():
    response = "We get \\boxed{\\frac{1}{2}}"
    for source in ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math",
                   "math_dapo", "math_dapo_reasoning", "aime2024", "aime25", "numina_olympiads"):
        assert dispatch(source, response, "0.5") == 1.0, source
        wrong = -1.0 if source.startswith(("math", "aime")) else 0.0  # verl's math_dapo scores -1
        assert dispatch(source, response, "0.25") == wrong, source
    assert dispatch("math_dapo", "...\nAnswer: 1/2", "0.5") == 1.0
    assert dispatch("HuggingFaceH4/MATH-500", "...\nAnswer: 1/2", "0.5") == 0.0  # verl's MATH reward: boxed only
    assert REWARD_FNS["DigitalLearningGmbH/MATH-lighteval"] is compute_score
    with pytest.raises(ValueError, match="any name starting with 'aime'"):
        dispatch("MATH", response, "0.5")


def test_a_slow_comparison_is_cut_off_by_the_reward_time_limit(monkeypatch):
    calls = []

    def slow(answer, truth):
        calls.append(answer)
        if answer == "slow":
            time.sleep(30)
        return answer == truth

    monkeypatch.setattr(math_reward, "is_equivalent", slow)
    source = "HuggingFaceH4/MATH-500"
    result = score_batch(dispatch, [source] * 3, ["\\boxed{slow}", "\\boxed{7}", "\\boxed{8}"], ["7"] * 3,
                         [{}] * 3, timeout_s=0.5)
    assert result.scores == [0.0, 1.0, 0.0] and result.num_timeouts == 1 and result.num_errors == 0
    assert result.errors_by_source == {source: 1} and calls == ["slow", "7", "8"]


def test_math_verify_runs_without_signals_inside_the_limit_and_in_threads(monkeypatch):
    """math-verify's own signal.alarm timeouts are off: they would cancel
    score_batch's timer, and they fail outside the main thread."""
    alarms = []
    monkeypatch.setattr(signal, "alarm", lambda *args: alarms.append(args))
    result = score_batch(dispatch, ["HuggingFaceH4/MATH-500"] * 2, ["\\boxed{2\\sqrt{2}}", "\\boxed{3}"],
                         ["\\sqrt{8}", "4"], [{}, {}], timeout_s=20)
    assert result.scores == [1.0, 0.0] and result.num_timeouts == 0 and result.num_errors == 0
    assert alarms == []

    out = []
    worker = threading.Thread(target=lambda: out.append(compute_score("\\boxed{\\frac{3}{6}}", "0.5")))
    worker.start()
    worker.join(30)
    assert out == [1.0]


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
    write_jsonl(tmp_path / "in" / ".cache" / "train.jsonl", [{"not": "read"}])  # hidden: skipped
    assert cli(["--input", str(tmp_path / "in"), "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 train row without an answer" in out
    assert f"wrote {tmp_path / 'out' / 'train.parquet'} (2 rows)" in out
    assert f"wrote {tmp_path / 'out' / 'test.parquet'} (1 rows)" in out
    train = read_rows(tmp_path / "out" / "train.parquet")
    assert train[1] == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": "Simplify $\\sqrt{8}$. " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2\\sqrt{2}"},
        "extra_info": {"split": "train", "index": 1, "problem": "Simplify $\\sqrt{8}$.",
                       "solution": "First \\boxed{2} no: $\\boxed{2\\sqrt{2}}$", "level": "Level 2",
                       "subject": "Algebra"},
    }
    assert INSTRUCTION == "Let's think step by step and output the final answer within \\boxed{}."
    assert [r["reward_model"]["ground_truth"] for r in read_rows(tmp_path / "out" / "test.parquet")] == ["0.5"]
    # the rows score with the MATH reward through the dispatcher
    assert dispatch(train[1]["data_source"], "so \\boxed{\\sqrt{8}}", train[1]["reward_model"]["ground_truth"]) == 1.0


def test_the_math_tarball_tree(tmp_path):
    for i, row in enumerate(MATH_ROWS):  # MATH/train/<subject>/<n>.json, one object each
        (tmp_path / "MATH" / "train" / "algebra").mkdir(parents=True, exist_ok=True)
        (tmp_path / "MATH" / "train" / "algebra" / f"{i}.json").write_text(json.dumps(row))
    (tmp_path / "MATH" / "test" / "geometry").mkdir(parents=True)
    (tmp_path / "MATH" / "test" / "geometry" / "0.json").write_text(json.dumps(MATH_ROWS[0]))
    assert cli(["--input", str(tmp_path / "MATH"), "--output-dir", str(tmp_path / "o")]) == 0
    train = read_rows(tmp_path / "o" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in train] == ["0.5", "2\\sqrt{2}"]
    assert [r["extra_info"]["index"] for r in train] == [0, 1]
    assert len(read_rows(tmp_path / "o" / "test.parquet")) == 1


def test_json_list_and_single_file_names(tmp_path, capsys):
    (tmp_path / "math_train.json").write_text(json.dumps(MATH_ROWS))  # a list; "train" in the name
    (tmp_path / "extra.json").write_text(json.dumps(MATH_ROWS[0]))  # one object; named neither
    assert prep.run([tmp_path / "math_train.json", tmp_path / "extra.json"], tmp_path / "o") == [
        tmp_path / "o" / "train.parquet", tmp_path / "o" / "extra.parquet"]
    assert "skipped 1 train row" in capsys.readouterr().out
    assert len(read_rows(tmp_path / "o" / "train.parquet")) == 2
    assert read_rows(tmp_path / "o" / "extra.parquet")[0]["extra_info"]["split"] == "extra"


def test_math500_parquet_and_deepscaler_answers(tmp_path):
    # MATH-500: an `answer` field wins over the solution; integer levels
    rows = [{"problem": "p", "solution": "\\boxed{wrong}", "answer": "\\frac{3}{4}", "subject": "Algebra",
             "level": 3, "unique_id": "test/algebra/1.json"},
            {"problem": "q", "solution": "so \\boxed{12}", "answer": "12", "subject": "Geometry", "level": 1,
             "unique_id": "test/geometry/2.json"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test-00000-of-00001.parquet")
    assert cli(["--input", str(tmp_path / "test-00000-of-00001.parquet"), "--output-dir", str(tmp_path / "m"),
                "--data-source", "HuggingFaceH4/MATH-500"]) == 0
    out = read_rows(tmp_path / "m" / "test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in out] == ["\\frac{3}{4}", "12"]
    assert out[0]["extra_info"] == {"split": "test", "index": 0, "problem": "p", "solution": "\\boxed{wrong}",
                                    "level": "3", "subject": "Algebra", "unique_id": "test/algebra/1.json"}
    assert out[0]["data_source"] == "HuggingFaceH4/MATH-500"
    # DeepScaleR: a json list of {problem, answer, solution}; an answer-less row falls back to the boxed solution
    deepscaler = [{"problem": "a", "answer": "\\sqrt{2}", "solution": "long text"},
                  {"problem": "b", "answer": "", "solution": "thus \\boxed{\\frac{1}{3}}"},
                  {"problem": "c", "answer": None, "solution": "no box"},
                  {"problem": "d", "answer": 204, "solution": None}]  # AIME sets give numbers
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "deepscaler.json").write_text(json.dumps(deepscaler))
    assert prep.run(tmp_path / "ds", tmp_path / "d") == [tmp_path / "d" / "deepscaler.parquet"]
    out = read_rows(tmp_path / "d" / "deepscaler.parquet")
    assert [r["reward_model"]["ground_truth"] for r in out] == ["\\sqrt{2}", "\\frac{1}{3}", "204"]
    assert [r["extra_info"]["index"] for r in out] == [0, 1, 2]


@pytest.mark.parametrize("content, message", [
    ('{"question": "q", "answer": "1"}\n', "row 0 has no 'problem' field"),  # GSM8K
    ('{"problem": "q", "answer": "1"}\n{"problem": "r", "level": 1}\n',
     "row 1 has neither an 'answer' nor a 'solution' field"),
    ('[1, 2]\n', "row 0 has no 'problem' field"),
    ("not json\n", "is unreadable"),
])
def test_files_that_are_not_math_shaped_are_clear_errors(tmp_path, content, message):
    (tmp_path / "train.jsonl").write_text(content)
    with pytest.raises(DataError, match=message) as e:
        prep.run([str(tmp_path / "train.jsonl")], tmp_path / "out")
    assert "train.jsonl" in str(e.value) and "pass MATH-style files" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_missing_inputs_and_empty_results(tmp_path, capsys):
    assert cli(["--input", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "MATH input" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert cli(["--input", str(tmp_path / "notes.txt"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "is not a .jsonl, .json or .parquet file" in capsys.readouterr().err
    write_jsonl(tmp_path / "train.jsonl", MATH_ROWS[2:])
    assert cli(["--input", str(tmp_path / "train.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "no MATH rows with an answer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
