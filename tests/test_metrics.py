"""Metrics a person watches: the console line, throughput and MFU, sample
completions, and what a real run writes."""

import json
import re
import subprocess

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.metrics.flops import ModelFlops
from posttrain.metrics.logger import format_line, perf_metrics
from posttrain.metrics.samples import sample_rows, val_sample_rows

from helpers import POSTTRAIN, read_metrics


def test_console_lines_line_up_from_step_to_step():
    a = {"critic/score/mean": 0.25, "actor/entropy": 0.632, "response_length/mean": 3.6, "timing_s/gen": 0.27,
         "timing_s/reward": 0.01, "timing_s/old_log_prob": 0.2, "timing_s/update_actor": 0.94, "timing_s/step": 1.44,
         "perf/throughput": 5099.0, "perf/mfu/actor": 0.0123}
    b = {**a, "critic/score/mean": 0.5, "val/score/mean": 0.863, "actor/kl_loss": 0.0012, "timing_s/ref": 0.11,
         "timing_s/gen": 12.5, "timing_s/step": 15.01, "perf/throughput": 123.0, "perf/mfu/actor": 0.3}
    la, lb = format_line(9, 100, a), format_line(100, 100, b)
    assert la.startswith("step 9/100   | score  0.250 | val     - | kl      - |")
    assert lb.startswith("step 100/100 | score  0.500 | val 0.863 | kl 0.0012 |")
    assert [m.start() for m in re.finditer(r"\|", la)] == [m.start() for m in re.finditer(r"\|", lb)]
    assert "gen  0.27 rew 0.01 logp 0.20 ref    - upd  0.94 step  1.44 s" in la
    assert la.endswith("5099 tok/s | mfu  1.23%") and lb.endswith(" 123 tok/s | mfu 30.00%")
    assert format_line(0, 100, {"val/score/mean": 0.5, "val/arith/score/mean": 0.5}) == (
        "step 0/100 | validation score 0.500 (arith 0.500)")


def literal_batch():
    """Two prompts of lengths 2 and 1 (left-padded to 2), two samples each,
    responses of lengths 3, 1, 0, 2 (right-padded to 3)."""
    prompt_mask = torch.tensor([[1, 1], [1, 1], [0, 1], [0, 1]])
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    out = type("Out", (), {})()
    out.prompt_ids = torch.tensor([[10, 11], [10, 11], [0, 12], [0, 12]])
    out.prompt_mask = prompt_mask
    out.response_ids = torch.tensor([[20, 21, 22], [23, 0, 0], [0, 0, 0], [24, 25, 0]])
    out.response_mask = response_mask
    batch = RolloutBatch.from_rollout(out, 2, ["arith", "gsm8k"], ["5", "7"], [{}, {}],
                                      ["a b c", "d", "", "e f"])
    batch.scores = torch.tensor([0.0, 1.0, 0.5, 0.5])
    batch.token_level_rewards = torch.zeros(4, 3)
    batch.token_level_rewards[0, 2], batch.token_level_rewards[1, 0] = -0.1, 0.9
    batch.token_level_rewards[3, 1] = 0.5
    batch.advantages = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [2.0, 4.0, 0.0]])
    return batch


def test_throughput_and_mfu_of_a_step():
    batch = literal_batch()  # real tokens: 5, 3, 1, 3 = 12
    flops = ModelFlops(matmul_params=1000, attn_width=10)
    m = {"timing_s/step": 2.0, "timing_s/gen": 0.5, "timing_s/update_actor": 1.0, "perf/flops/rollout": 1e6}
    out = perf_metrics(m, batch, flops, peak_flops=1e7, ppo_epochs=2, devices=2)
    assert out["perf/total_num_tokens"] == 12 and out["perf/throughput"] == 12 / 2.0 / 2
    # training: 3 * sum(2*1000*s + 4*10*s^2) over s = 5, 3, 1, 3, times 2 epochs
    train = 3 * sum(2000 * s + 40 * s * s for s in (5, 3, 1, 3))
    assert out["perf/flops/actor"] == 2 * train
    assert out["perf/mfu/actor"] == pytest.approx(2 * train / (1.0 * 1e7 * 2))
    assert out["perf/mfu/rollout"] == pytest.approx(1e6 / (0.5 * 1e7 * 2))
    # model.share_prompt: each group's prompt once (groups 0, 0, 1, 1), responses without their last token
    # attending to prompt + response. Prompts 2, 2, 1, 1 with responses 3, 1, 0, 2 real tokens -> run 2, 0, 0, 1
    shared = perf_metrics(m, batch, flops, peak_flops=1e7, ppo_epochs=1, devices=1, share_prompt=True)
    prompts = sum(2000 * p + 40 * p * p for p in (2, 1))
    responses = sum(2000 * r + 40 * r * (p + r) for p, r in ((2, 2), (2, 0), (1, 0), (1, 1)))
    assert shared["perf/flops/actor"] == 3 * (prompts + responses)
    warmup = perf_metrics({"timing_s/step": 2.0}, batch, flops, peak_flops=None, ppo_epochs=1, devices=1)
    assert set(warmup) == {"perf/total_num_tokens", "perf/throughput"}  # no peak, no update: no MFU


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 10) for i in ids)


def test_best_and_worst_of_each_group():
    rows = sample_rows(literal_batch(), CharTokenizer(), prompts=4)
    assert [(r["group"], r["which"], r["response"]) for r in rows] == [(0, "best", "d"), (0, "worst", "a b c"),
                                                                        (1, "best", "")]  # equal scores: one row
    best = rows[0]
    assert best["prompt"] == "ab" and best["data_source"] == "arith" and best["ground_truth"] == "5"
    assert best["score"] == 1.0 and best["reward"] == pytest.approx(0.9) and best["advantage"] == 1.0
    assert best["response_length"] == 1 and rows[1]["advantage"] == -1.0
    assert rows[2]["prompt"] == "c" and rows[2]["advantage"] is None  # an empty response has no tokens to average
    assert len(sample_rows(literal_batch(), CharTokenizer(), prompts=1)) == 2
    val = val_sample_rows(literal_batch(), [1.0, 0.0, 0.0, 1.0], CharTokenizer(), limit=3)
    assert [(r["which"], r["response"], r["score"]) for r in val] == [("val", "a b c", 1.0), ("val", "d", 0.0),
                                                                        ("val", "", 0.0)]


def test_a_run_piped_to_a_file_logs_everything_plainly(tmp_path, trained_tiny_model_dir):
    """stdout and stderr to a file: no progress-bar control characters; every
    phase timed; MFU, memory and samples written."""
    log = tmp_path / "out.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [POSTTRAIN, "train", "trainer.total_training_steps=3", "trainer.test_freq=2", "data.val_max_samples=32",
             "trainer.save_freq=2", "trainer.log_samples_freq=2", "trainer.log_samples_prompts=2",
             "trainer.log_val_generations=3", "actor.use_kl_loss=true", f"trainer.run_dir={tmp_path / 'run'}",
             "trainer.logger=[console]"], stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text and "\x1b" not in text, repr(text[:2000])
    assert re.search(r"^step 3/3 \| score", text, re.M) and "done: validation score" in text
    lines = read_metrics(tmp_path / "run")
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    for phase in ("gen", "reward", "ref", "adv", "update_actor", "update_weights", "step"):
        assert all(x[f"timing_s/{phase}"] > 0 for x in lines[1:]), phase
    # one epoch, one mini-batch: the update takes its old log-probs from its own forward, no separate pass
    assert not any("timing_s/old_log_prob" in x for x in lines)
    assert "timing_s/testing" in lines[2] and "timing_s/save_checkpoint" in lines[2]
    assert lines[2]["timing_s/step"] > lines[2]["timing_s/testing"] + lines[2]["timing_s/update_actor"]
    for x in lines[1:]:
        assert 0 < x["perf/mfu/actor"] < 1 and 0 < x["perf/mfu/rollout"] < 1
        assert x["perf/throughput"] > 0 and x["perf/total_num_tokens"] > 0 and x["perf/max_rss_gb"] > 0.1
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    train_rows = [r for r in samples if r["which"] != "val"]
    assert sorted({r["step"] for r in train_rows}) == [1, 2]  # the first step, then every 2
    assert {r["which"] for r in train_rows} <= {"best", "worst"} and len({r["group"] for r in train_rows}) <= 2
    assert all("+" in r["prompt"] and isinstance(r["score"], float) for r in train_rows)
    val_rows = [r for r in samples if r["which"] == "val"]
    assert [r["step"] for r in val_rows] == [0] * 3 + [2] * 3 + [3] * 3
