import argparse
import json
from fractions import Fraction
from itertools import combinations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.data import arith as arith_task
from posttrain.data.preprocess import arith, countdown, gsm8k, register
from posttrain.data.schema import read_rows
from posttrain.errors import DataError
from posttrain.rewards import compute_score

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
RAW = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more than 800. Price?", "answer": "800+1200=<<800+1200=2000>>2000\n#### 2,000"},
    {"question": "It is 5 degrees and drops 8. Now?", "answer": "5-8=<<5-8=-3>>-3\n#### -3"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def gsm8k_row(raw, split, index, truth):
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]},
    }


def cli(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="dataset", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_gsm8k_rows_match_verls_content(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "train.jsonl", RAW)
    write_jsonl(src / "test.jsonl", RAW[:1])
    write_jsonl(src / "train_socratic.jsonl", RAW[:1])  # GSM8K's other variant: not mixed in
    paths = gsm8k.run(src, tmp_path / "out")
    assert paths == [tmp_path / "out" / "train.parquet", tmp_path / "out" / "test.parquet"]
    assert read_rows(paths[0]) == [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many? Let's think step by step "
                                                   'and output the final answer after "####".'}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "7"},
            "extra_info": {"split": "train", "index": 0, "answer": "3+4=<<3+4=7>>7\n#### 7",
                           "question": "Tom has 3 apples and buys 4. How many?"},
        },
        gsm8k_row(RAW[1], "train", 1, "2000"),  # commas dropped from the ground truth
        gsm8k_row(RAW[2], "train", 2, "-3"),
    ]
    assert read_rows(paths[1]) == [gsm8k_row(RAW[0], "test", 0, "7")]
    assert pq.read_schema(paths[0]).names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def test_gsm8k_from_hub_parquet_and_single_files(tmp_path, capsys):
    (tmp_path / "hub" / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(RAW[:2]), tmp_path / "hub" / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(RAW[2:]), tmp_path / "hub" / "main" / "test-00000-of-00001.parquet")
    assert cli(["gsm8k", "--input", str(tmp_path / "hub"), "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'out' / 'train.parquet'} (2 rows)" in out and "test.parquet (1 rows)" in out
    assert read_rows(tmp_path / "out" / "train.parquet") == [gsm8k_row(RAW[0], "train", 0, "7"),
                                                             gsm8k_row(RAW[1], "train", 1, "2000")]
    write_jsonl(tmp_path / "test_small.jsonl", RAW[1:])
    assert gsm8k.run(tmp_path / "test_small.jsonl", tmp_path / "one") == [tmp_path / "one" / "test.parquet"]
    assert [r["extra_info"]["index"] for r in read_rows(tmp_path / "one" / "test.parquet")] == [0, 1]


def test_gsm8k_input_errors(tmp_path):
    with pytest.raises(DataError, match="GSM8K input '.*nope' does not exist; pass the GSM8K directory"):
        gsm8k.run(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no GSM8K train/test .jsonl or .parquet files in"):
        gsm8k.run(tmp_path / "empty", tmp_path / "out")
    write_jsonl(tmp_path / "sample.jsonl", RAW)
    with pytest.raises(DataError, match="cannot tell the split.*name it train"):
        gsm8k.run(tmp_path / "sample.jsonl", tmp_path / "out")
    write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "no marks"}])
    with pytest.raises(DataError, match="no '#### <number>' line"):
        gsm8k.run(tmp_path / "train.jsonl", tmp_path / "out")
    write_jsonl(tmp_path / "test.jsonl", [{"q": "x"}])
    with pytest.raises(DataError, match="line 1 is not"):
        gsm8k.run(tmp_path / "test.jsonl", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_arith_rows(tmp_path):
    train_pairs, test_pairs = arith_task.split_pairs(5, 1, 3)  # 9 pairs: 8 train, 1 test
    paths = arith.run(tmp_path, seed=5, min_value=1, max_value=3)
    train, test = read_rows(paths[0]), read_rows(paths[1])
    (a, b), (c, d) = train_pairs[0], test_pairs[0]
    assert train[0] == {"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                        "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                        "extra_info": {"split": "train", "index": 0, "a": a, "b": b}}
    assert test == [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{c}+{d}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(c + d)},
                     "extra_info": {"split": "test", "index": 0, "a": c, "b": d}}]
    assert [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in train] == train_pairs
    assert all(compute_score("arith", r["reward_model"]["ground_truth"], r["reward_model"]["ground_truth"]) == 1.0
               for r in train)


def test_arith_splits_are_disjoint_and_capped(tmp_path, capsys):
    assert cli(["arith", "--output-dir", str(tmp_path), "--num-train", "50", "--num-test", "20", "--seed", "3"]) == 0
    assert "(50 rows)" in capsys.readouterr().out
    train, test = read_rows(tmp_path / "train.parquet"), read_rows(tmp_path / "test.parquet")
    assert len(train) == 50 and len(test) == 20
    pairs = lambda rows: {(x["extra_info"]["a"], x["extra_info"]["b"]) for x in rows}
    assert len(pairs(train)) == 50 and not pairs(train) & pairs(test)
    full_train, full_test = (read_rows(p) for p in arith.run(tmp_path / "all"))
    assert len(full_train) + len(full_test) == 90 * 90 and not pairs(full_train) & pairs(full_test)
    with pytest.raises(DataError, match="only 1 distinct test pairs for values 1..3, 2 asked; lower --num-test"):
        arith.run(tmp_path / "small", num_test=2, min_value=1, max_value=3)


def solvable(numbers, target) -> bool:
    """Brute force: can + - * / over all of `numbers` (each once) reach target?"""
    def values(terms):
        if len(terms) == 1:
            yield terms[0]
            return
        for i, j in combinations(range(len(terms)), 2):
            x, y = terms[i], terms[j]
            rest = [t for k, t in enumerate(terms) if k not in (i, j)]
            for v in {x + y, x - y, y - x, x * y, *([x / y] if y else []), *([y / x] if x else [])}:
                yield from values(rest + [v])
    return any(v == target for v in values([Fraction(n) for n in numbers]))


def test_countdown_instances_are_solvable_and_seeded(tmp_path):
    import random

    rng = random.Random(0)
    for _ in range(200):
        numbers, target, expr = countdown.random_instance(rng, rng.randint(2, 5), 99)
        assert compute_score("countdown", f"<answer>{expr}</answer>", {"target": target, "numbers": numbers}) == 1.0
        assert 1 <= target <= 1000 and all(1 <= n <= 99 for n in numbers)

    paths = countdown.run(tmp_path / "a", num_train=20, num_test=10, seed=7)
    train, test = read_rows(paths[0]), read_rows(paths[1])
    assert len(train) == 20 and len(test) == 10
    for r in train + test:
        gt = r["reward_model"]["ground_truth"]
        assert set(gt) == {"target", "numbers"} and 3 <= len(gt["numbers"]) <= 4
        assert solvable(gt["numbers"], gt["target"])
    def key(r):
        gt = r["reward_model"]["ground_truth"]
        return tuple(sorted(gt["numbers"])), gt["target"]

    assert not {key(r) for r in train} & {key(r) for r in test}
    r = train[0]
    gt = r["reward_model"]["ground_truth"]
    assert r["data_source"] == "countdown" and r["ability"] == "math" and r["extra_info"] == {"split": "train",
                                                                                             "index": 0}
    content = r["prompt"][0]["content"]
    assert r["prompt"][0]["role"] == "user" and "<answer>" in content and "</answer>" in content
    assert content.startswith(f"Using the numbers {gt['numbers']}, create an equation that equals {gt['target']}.")

    assert read_rows(countdown.run(tmp_path / "b", num_train=20, num_test=10, seed=7)[0]) == train  # same seed
    assert read_rows(countdown.run(tmp_path / "c", num_train=20, num_test=10, seed=8)[0]) != train
    assert read_rows(countdown.run(tmp_path / "d", num_train=5, num_test=10, seed=7)[1]) == test  # test fixed
    assert cli(["countdown", "--output-dir", str(tmp_path / "e"), "--num-train", "3", "--num-test", "0",
                "--min-operands", "5", "--max-operands", "5"]) == 0
    assert [len(x["reward_model"]["ground_truth"]["numbers"]) for x in read_rows(tmp_path / "e" / "train.parquet")] \
        == [5, 5, 5]
    assert not (tmp_path / "e" / "test.parquet").exists()
    with pytest.raises(DataError, match="num_operands"):
        countdown.run(tmp_path / "f", 1, 1, num_operands=(4, 3))


def test_guess_number_rows_hold_the_secrets(tmp_path, capsys):
    """Train secrets drawn (seeded) from low..high; test rows hold every secret in turn; the game reads them."""
    from posttrain.envs.games import GuessTheNumber

    assert cli(["guess-number", "--output-dir", str(tmp_path / "a"), "--num-train", "200", "--num-test", "10",
                "--low", "3", "--high", "6"]) == 0
    assert "train.parquet (200 rows)" in capsys.readouterr().out
    train, test = read_rows(tmp_path / "a" / "train.parquet"), read_rows(tmp_path / "a" / "test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in test] == ["3", "4", "5", "6", "3", "4", "5", "6", "3", "4"]
    assert {r["reward_model"]["ground_truth"] for r in train} == {"3", "4", "5", "6"}
    assert train[7] == {"data_source": "guess_number", "prompt": [{"role": "user", "content": "Guess the number: game 7"}],
                        "ability": "game", "reward_model": {"style": "env", "ground_truth": train[7]["reward_model"]
                                                            ["ground_truth"]}, "extra_info": {"split": "train",
                                                                                              "index": 7}}
    game = GuessTheNumber(low=3, high=6)
    game.reset(test[2])
    assert game.secret == 5
    again = cli(["guess-number", "--output-dir", str(tmp_path / "b"), "--num-train", "200", "--low", "3", "--high", "6"])
    assert again == 0 and read_rows(tmp_path / "b" / "train.parquet") == train  # the same seed, the same secrets
    with pytest.raises(DataError, match="--low below --high"):
        cli(["guess-number", "--output-dir", str(tmp_path / "c"), "--low", "5", "--high", "5"])
