"""Bad input ends with one line naming the problem and the fix, exit 2, and
nothing in the run directory touched."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.data.schema import write_rows


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if line.startswith("posttrain: error:")]


def good_rows(n=4):
    return [
        {"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+1="}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(a + 1)}, "extra_info": {"index": a}}
        for a in range(10, 10 + n)
    ]


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    return d


def assert_untouched(run_dir: Path):
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "keep me"


def test_misspelt_key(capsys, run_dir):
    code, err = run_cli(["train", "actor.lrr=1e-4", f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and len(err) == 1
    assert "actor.lrr" in err[0] and "actor.lr" in err[0]
    assert_untouched(run_dir)


def test_misspelt_verl_key(capsys):
    code, err = run_cli(["train", "actor_rollout_ref.actor.optim.lrr=1e-4"], capsys)
    assert code == 2 and "actor_rollout_ref.actor.optim.lr" in err[0]


def test_wrong_type(capsys, run_dir):
    code, err = run_cli(["train", "data.train_batch_size=abc", f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and "data.train_batch_size" in err[0]
    assert_untouched(run_dir)


def test_model_path_missing(capsys, run_dir, tmp_path):
    code, err = run_cli(["train", f"actor_rollout_ref.model.path={tmp_path / 'nope'}",
                         f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and "nope" in err[0]
    assert_untouched(run_dir)


def test_model_without_weights(capsys, run_dir, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    code, err = run_cli(["train", f"model.path={model}", f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and "weights" in err[0].lower()
    assert_untouched(run_dir)


def test_parquet_missing(capsys, run_dir, tmp_path, tiny_model_dir):
    code, err = run_cli(["train", f"data.train_files={tmp_path / 'missing.parquet'}", f"model.path={tiny_model_dir}",
                         f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and "missing.parquet" in err[0]
    assert_untouched(run_dir)


def test_parquet_unreadable(capsys, run_dir, tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.parquet"
    bad.write_text("this is not parquet")
    code, err = run_cli(["train", f"data.train_files={bad}", f"model.path={tiny_model_dir}",
                         f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and "bad.parquet" in err[0]
    assert_untouched(run_dir)


def test_parquet_missing_column(capsys, run_dir, tmp_path, tiny_model_dir):
    path = tmp_path / "noprompt.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"data_source": "arith", "question": "1+1="}]), path)
    code, err = run_cli(["train", f"data.train_files={path}", f"model.path={tiny_model_dir}",
                         f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and "prompt" in err[0]
    assert_untouched(run_dir)


def test_empty_after_length_filtering(capsys, run_dir, tmp_path, tiny_model_dir):
    path = tmp_path / "train.parquet"
    write_rows(good_rows(), path)
    code, err = run_cli(["train", f"data.train_files={path}", f"model.path={tiny_model_dir}",
                         "data.max_prompt_length=3", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                         f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and "max_prompt_length" in err[0]
    assert_untouched(run_dir)


@pytest.mark.parametrize("which", ["file", "function"])
def test_custom_reward_missing(capsys, run_dir, tmp_path, which):
    reward = tmp_path / "my_reward.py"
    if which == "function":
        reward.write_text("def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    code, err = run_cli(["train", f"reward.custom_fn={reward}:my_score", f"trainer.run_dir={run_dir}"], capsys)
    assert code == 2 and ("my_reward.py" in err[0] or "my_score" in err[0])
    if which == "function":
        assert "my_score" in err[0]
    assert_untouched(run_dir)


def test_console_script_prints_no_traceback(tmp_path):
    exe = Path(sys.executable).with_name("posttrain")
    proc = subprocess.run([str(exe), "train", "trainer.totl_training_steps=3"], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "POSTTRAIN_DEBUG": "0"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [line for line in proc.stderr.strip().splitlines()
                                                if line.startswith("posttrain: error:")]
    assert "trainer.total_training_steps" in proc.stderr
