"""Reward functions in worker processes: scores as in-process, a hang, an
exception or a crash costs only its sample, and no worker outlives the run."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import compute_advantages
from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.errors import RewardError
from posttrain.driver.rollouts import generate_and_score
from posttrain.driver.loop import train
from posttrain.driver.run import Run
from posttrain.models import load_tokenizer
from posttrain.rewards.pool import RewardPool, builtin_rewards, in_process, reward_loader
from posttrain.rollout.base import RolloutOutput, SamplingParams

from helpers import one_batch_overrides, read_metrics, write_prompts

# a user's reward file: what it does is picked by the data source (test_misbehaving_calls_cost_only_their_samples)
# or by the prompt's index (the training run), and every call is logged as "pid what" before it is done
MISBEHAVING = """
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    what = data_source if data_source != "arith" else WHAT[extra_info["index"] % 5]
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {what}\\n")
    if what == "hang":
        time.sleep(1000)  # stopped by the worker's alarm
    if what == "raise":
        raise ValueError("bad " + solution_str)
    if what == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "blocked":  # the alarm cannot stop this one: the pool kills the worker
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(1000)
    if what == "empty":
        raise AssertionError("an empty response is never scored")
    return float(solution_str) / 10 if data_source != "arith" else 1.0

WHAT = ["ok", "raise", "segv", "hang", "blocked"]
"""


def reward_file(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "calls.log"
    path = tmp_path / "misbehaving.py"
    path.write_text(f"LOG = {str(log)!r}\n" + MISBEHAVING)
    return path, log


def reward_workers() -> list[int]:
    """This process's reward workers (children named reward-worker), whatever their state."""
    def read(path):
        try:
            return path.read_text()
        except OSError:  # it has just exited
            return ""

    children = [pid for task in Path("/proc/self/task").iterdir() for pid in read(task / "children").split()]
    return [int(pid) for pid in children if read(Path(f"/proc/{pid}/comm")).strip() == "reward-worker"]


def test_scores_match_in_process_and_keep_their_order(tmp_path):
    path, _ = reward_file(tmp_path)
    sources = ["arith"] * 40 + ["graded"] * 60 + ["empty"]
    texts = [str(i % 7) for i in range(40)] + [str(i) for i in range(60)] + [""]
    truths = ["3"] * 40 + ["-"] * 61
    with RewardPool(builtin_rewards, 2, timeout_s=5) as pool:  # the built-ins by data_source: arith here
        built_in = pool.score_batch(sources[:40], texts[:40], truths[:40], [{}] * 40)
    assert built_in.scores == [1.0 if i % 7 == 3 else 0.0 for i in range(40)]
    extra = [{"index": 0}] * 101  # arith rows: "ok", 1.0
    expected = [1.0] * 40 + [i / 10 for i in range(60)] + [0.0]  # 100 calls: chunks of 12 over 2 workers
    for workers in (0, 2):
        with RewardPool(reward_loader(str(path)), workers, timeout_s=5) as pool:
            result = pool.score_batch(sources, texts, truths, extra)
        assert result.scores == expected
        assert (result.num_errors, result.num_timeouts, result.num_crashes, result.messages) == (0, 0, 0, [])


def test_a_dict_returns_numbers_come_back_from_the_workers(tmp_path):
    path = tmp_path / "extras.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': 1.0, 'acc': float(solution_str == ground_truth), 'pred': solution_str}\n")
    for workers in (0, 2):
        with RewardPool(reward_loader(str(path)), workers, timeout_s=5) as pool:
            r = pool.score_batch(["x"] * 4, ["1", "2", "", "4"], ["1", "1", "1", "4"], [{}] * 4)
        assert r.extras == [{"acc": 1.0}, {"acc": 0.0}, {}, {"acc": 1.0}]  # the empty response is not scored


def test_misbehaving_calls_cost_only_their_samples(tmp_path):
    path, log = reward_file(tmp_path)
    kinds = ["ok", "hang", "ok", "raise", "segv", "ok", "blocked", "ok", "raise", "segv", "hang", "ok"]
    texts = [str(i) for i in range(len(kinds))]
    with RewardPool(reward_loader(f"{path}:compute_score"), 2, timeout_s=0.5) as pool:
        r = pool.score_batch(kinds, texts, ["-"] * len(kinds), [{}] * len(kinds))
        assert r.scores == [i / 10 if k == "ok" else 0.0 for i, k in enumerate(kinds)]
        assert (r.num_errors, r.num_timeouts, r.num_crashes) == (2, 3, 2)
        assert r.errors_by_source == {"hang": 2, "raise": 2, "segv": 2, "blocked": 1}
        assert "reward for data_source 'segv' crashed: worker process died (SIGSEGV)" in r.messages
        assert "reward for data_source 'blocked' ran past 0.5 s and its worker process was killed" in r.messages
        assert "reward for data_source 'raise' raised ValueError: bad 3" in r.messages
        # every call ran exactly once (none resent after a crash) and a crash took a worker with it
        calls = [line.split() for line in log.read_text().splitlines()]
        assert sorted(what for _, what in calls) == sorted(kinds)
        assert len({pid for pid, _ in calls}) > 2
        again = pool.score_batch(["ok"] * 4, ["1", "2", "3", "4"], ["-"] * 4, [{}] * 4)
        assert again.scores == [0.1, 0.2, 0.3, 0.4] and again.num_crashes == 0
    assert reward_workers() == []


def test_a_worker_that_cannot_load_the_function_is_a_reward_error(tmp_path):
    pool = RewardPool(reward_loader(str(tmp_path / "gone.py")), 1, timeout_s=1)
    with pytest.raises(RewardError, match="could not load the reward function.*gone.py.*does not exist"):
        pool.score_batch(["a"], ["1"], ["1"], [{}])
    assert reward_workers() == []


def run_config(tmp_path, model_dir, steps: int, *more):
    write_prompts(tmp_path, 8)
    return load_config(None, one_batch_overrides(model_dir, tmp_path, tmp_path / "run", steps, "reward.timeout_s=0.5",
                                                 "reward.num_workers=2", *more))


def test_a_run_survives_a_reward_that_hangs_raises_and_crashes(tmp_path, tiny_model_dir, capsys):
    path, log = reward_file(tmp_path)
    summary = train(build_run(run_config(tmp_path, tiny_model_dir, 2, f"reward.custom_fn={path}")))
    assert summary["steps"] == 2
    steps = [x for x in read_metrics(tmp_path / "run") if "reward/num_errors" in x]
    calls = [line.split() for line in log.read_text().splitlines()]
    did = {what: sum(w == what for _, w in calls) for what in ("ok", "raise", "segv", "hang", "blocked")}
    assert all(did.values()), did  # each kind happened (no prompt of the 8 got only empty responses)

    def total(key):
        return sum(x.get(key, 0.0) for x in steps)

    assert total("reward/num_errors") == did["raise"]
    assert total("reward/num_timeouts") == did["hang"] + did["blocked"]
    assert total("reward/num_crashes") == did["segv"]
    assert total("reward/arith/num_errors") == did["raise"] + did["hang"] + did["blocked"] + did["segv"]
    assert "worker process died (SIGSEGV)" in capsys.readouterr().err
    # no worker outlives the run, including the ones that scored calls
    assert reward_workers() == []
    assert not any(Path(f"/proc/{pid}").exists() for pid, _ in calls)


def test_no_worker_outlives_a_run_that_raises(tmp_path, tiny_model_dir):
    run = build_run(run_config(tmp_path, tiny_model_dir, 1))
    seen = []

    def broken_update(batch):
        seen.extend(reward_workers())  # the workers that just scored the step
        raise RuntimeError("update failed")

    run.actor.train_step = broken_update
    with pytest.raises(RuntimeError, match="update failed"):
        train(run)
    assert seen and reward_workers() == []


def test_an_empty_response_is_not_scored_and_adds_no_loss(tiny_model_dir):
    """Rows 0 and 1 answer prompt 0; row 1 is EOS alone, which decodes to ''."""
    tok = load_tokenizer(tiny_model_dir)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    digits = tok.encode("7", add_special_tokens=False)

    class Actor:
        def generate(self, prompts, params):
            return RolloutOutput(torch.tensor([[5], [5]]), torch.ones(2, 1, dtype=torch.long),
                                 torch.tensor([digits + [eos], [eos] + [pad] * len(digits)]),
                                 torch.tensor([[1] * (len(digits) + 1), [1] + [0] * len(digits)]))

    def reward(source, text, truth, extra=None):
        assert text, "an empty response was scored"
        return 1.0

    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    item = SimpleNamespace(prompt_ids=[5], data_source="arith", ground_truth="7", extra_info={}, messages=[{"role": "user", "content": "3+4="}])
    run = Run(cfg=cfg, run_dir=None, actor=Actor(), tokenizer=tok, kl_ctrl=None, rewards=in_process(reward), train_data=None,
              val_data=None, sampler=None, sampling=SamplingParams(max_new_tokens=4, n=2), val_sampling=None,
              total_steps=1)
    m = {}
    batch = generate_and_score(run.rollouts, [item], m)
    assert batch.response_text[1] == "" and batch.scores.tolist() == [1.0, 0.0]
    assert batch.response_mask[1].sum() == 0 and batch.token_level_scores[1].abs().sum() == 0
    assert m["response/empty_ratio"] == 0.5 and m["reward/num_errors"] == 0
    adv, _ = compute_advantages("grpo", batch.token_level_scores, batch.response_mask, [0, 0])
    assert adv[1].abs().sum() == 0 and adv[0].abs().sum() > 0


def test_a_dict_returns_numbers_are_logged_in_training_and_validation(tiny_model_dir):
    """verl's {"score", "acc", "pred"}: acc's mean is logged as reward/acc/mean in a step, and as
    val/acc/mean and val/<data_source>/acc/mean in validation; the text "pred" is not."""
    from posttrain.driver.validation import validate

    tok = load_tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    answers = {5: "7", 6: "8"}

    class Actor:  # prompt [5] answers "7" twice, prompt [6] answers "8" twice
        def generate(self, prompts, params):
            rows = [tok.encode(answers[p[0]], add_special_tokens=False) + [eos] for p in prompts
                    for _ in range(params.n)]
            ids = torch.tensor(rows)
            return RolloutOutput(torch.tensor([[p[0]] for p in prompts for _ in range(params.n)]),
                                 torch.ones(len(rows), 1, dtype=torch.long), ids, torch.ones_like(ids))

    def reward(source, text, truth, extra=None):
        return {"score": 1.0, "acc": float(text == truth), "pred": text}

    items = [SimpleNamespace(prompt_ids=[5], data_source="a", ground_truth="7", extra_info={}, messages=[]),
             SimpleNamespace(prompt_ids=[6], data_source="b", ground_truth="9", extra_info={}, messages=[])]
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    run = Run(cfg=cfg, run_dir=None, actor=Actor(), tokenizer=tok, kl_ctrl=None, rewards=in_process(reward),
              train_data=None, val_data=None, sampler=None, sampling=SamplingParams(max_new_tokens=4, n=2),
              val_sampling=None, total_steps=1)
    m = {}
    generate_and_score(run.rollouts, items, m)
    assert m["reward/acc/mean"] == 0.5 and not any("pred" in key for key in m)
    metrics, _ = validate(Actor(), tok, items, SamplingParams(max_new_tokens=4, n=1), in_process(reward))
    assert (metrics["val/acc/mean"], metrics["val/a/acc/mean"], metrics["val/b/acc/mean"]) == (0.5, 1.0, 0.0)
    assert metrics["val/score/mean"] == 1.0 and not any("pred" in key for key in metrics)
