import json

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.cli import main
from posttrain.data.preprocess import arith, countdown, gsm8k
from posttrain.data.schema import read_rows
from posttrain.rewards import compute_score

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
RAW = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more than 800. Price?", "answer": "800+1200=<<800+1200=2000>>2000\n#### 2,000"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gsm8k_rows_match_verls_content(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "train.jsonl", RAW)
    write_jsonl(src / "test.jsonl", RAW[:1])
    gsm8k.run(src, tmp_path / "out")
    rows = read_rows(tmp_path / "out" / "train.parquet")
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "A car costs $1,200 more than 800. Price? " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2000"},
        "extra_info": {"split": "train", "index": 1, "answer": RAW[1]["answer"], "question": RAW[1]["question"]},
    }
    test_rows = read_rows(tmp_path / "out" / "test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in test_rows] == ["7"]
    assert test_rows[0]["extra_info"]["split"] == "test"


def test_gsm8k_from_parquet_and_the_cli(tmp_path, capsys):
    src = tmp_path / "main"
    src.mkdir()
    pq.write_table(pa.Table.from_pylist(RAW), src / "train-00000-of-00001.parquet")
    assert main(["preprocess", "gsm8k", "--input", str(tmp_path), "--output-dir", str(tmp_path / "out")]) == 0
    assert "2 rows" in capsys.readouterr().out
    assert [r["reward_model"]["ground_truth"] for r in read_rows(tmp_path / "out" / "train.parquet")] == ["7", "2000"]
    assert main(["preprocess", "gsm8k", "--input", str(tmp_path / "nope"), "--output-dir", str(tmp_path)]) == 2


def test_arith_rows_and_disjoint_splits(tmp_path):
    arith.run(tmp_path, num_train=50, num_test=20, seed=3)
    train, test = read_rows(tmp_path / "train.parquet"), read_rows(tmp_path / "test.parquet")
    assert len(train) == 50 and len(test) == 20
    r = train[0]
    a, b = r["extra_info"]["a"], r["extra_info"]["b"]
    assert r["prompt"] == [{"role": "user", "content": f"{a}+{b}="}]
    assert r["reward_model"] == {"style": "rule", "ground_truth": str(a + b)} and r["data_source"] == "arith"
    pairs = lambda rows: {(x["extra_info"]["a"], x["extra_info"]["b"]) for x in rows}  # noqa: E731
    assert not pairs(train) & pairs(test)
    full_train, full_test = arith.run(tmp_path / "all")
    assert pq.read_metadata(full_train).num_rows + pq.read_metadata(full_test).num_rows == 90 * 90


def test_countdown_instances_are_solvable_and_seeded(tmp_path):
    import random

    rng = random.Random(0)
    for _ in range(50):
        numbers, target, expr = countdown.random_instance(rng, 4, 99)
        gt = {"target": target, "numbers": numbers}
        assert compute_score("countdown", f"<answer>{expr}</answer>", gt) == 1.0
    countdown.run(tmp_path / "a", num_train=5, num_test=2, seed=7)
    countdown.run(tmp_path / "b", num_train=5, num_test=2, seed=7)
    a, b = read_rows(tmp_path / "a" / "train.parquet"), read_rows(tmp_path / "b" / "train.parquet")
    assert a == b and "<answer>" in a[0]["prompt"][0]["content"]
    assert set(a[0]["reward_model"]["ground_truth"]) == {"target", "numbers"}
