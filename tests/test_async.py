"""Asynchronous training (async_training.*): the rollout engine in a process of its own, sampling up to k updates
ahead of the trainer (driver/ahead.py, rollout/remote.py, Worker.engine_weights)."""

import os
import re
import signal
import threading
import time
import warnings

import pytest
import torch
from safetensors.torch import load_file

from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.driver.loop import train
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.remote import RolloutProcessError

from helpers import comparable, read_metrics, resume_overrides, small_run_overrides

ASYNC = ("async_training.enable=true", "async_training.rollout_threads=1")


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    """Trainer and rollout process one torch thread each, on any machine (the split of a 2-core one), so the
    synchronous runs they are compared with can use the same one thread; the session's threads come back after."""
    monkeypatch.setattr("posttrain.driver.settings.os.cpu_count", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(args):
    return train(build_run(load_config(None, args)))


def final_weights(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "model.safetensors")


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def without_async(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if not k.startswith("async/")} for line in lines]


def test_k_0_is_the_synchronous_run(tmp_path, data, trained_tiny_model_dir):
    """The rollout process samples each step with the weights of the update just made: the same samples,
    updates and metrics as the engine inside the trainer, bit for bit."""
    sync = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "sync", 4, "trainer.save_freq=4")
    run(sync)
    run([*sync, f"trainer.run_dir={tmp_path / 'async'}", *ASYNC, "async_training.max_trajectory_age_steps=0"])
    a, b = comparable(tmp_path / "sync"), comparable(tmp_path / "async")
    assert all(line.get("async/trajectory_age", 0) == 0 for line in b)
    assert without_async(b) == a
    assert same_weights(final_weights(tmp_path / "sync", 4), final_weights(tmp_path / "async", 4))


def test_k_1_trains_on_the_batches_of_one_update_ago_as_stale_updates_1_does(tmp_path, data, trained_tiny_model_dir):
    """One-step off-policy: step j's batch was sampled with the weights of j - 2 updates, while step j - 1
    trained. That is rollout.stale_updates=1's schedule, computed in parallel: the same run."""
    base = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "stale", 4, "trainer.save_freq=4",
                               "rollout.calculate_log_probs=true")
    run([*base, "rollout.stale_updates=1"])
    run([*base, f"trainer.run_dir={tmp_path / 'async'}", *ASYNC, "async_training.max_trajectory_age_steps=1"])
    a, b = comparable(tmp_path / "stale"), comparable(tmp_path / "async")
    steps = [line for line in b if "critic/score/mean" in line]
    assert [line["async/trajectory_age"] for line in steps] == [0, 1, 1, 1]
    assert without_async(b) == a
    assert same_weights(final_weights(tmp_path / "stale", 4), final_weights(tmp_path / "async", 4))
    assert max(line["rollout_corr/k3_kl"] for line in steps) > 0  # stale: a real gap, measured


@pytest.mark.parametrize("stop_at", [3, 2])
def test_stop_and_resume_is_exact_with_the_batches_sampled_ahead_in_the_checkpoint(
        tmp_path, data, tiny_model_dir, stop_at):
    """k = 2: a checkpoint holds the batches sampled for the next steps (and the data position and random
    stream after them); the resumed run takes them and goes on as the whole run did."""
    k2 = (*ASYNC, "async_training.max_trajectory_age_steps=2")
    run(resume_overrides(tiny_model_dir, data, tmp_path / "whole", 6, "trainer.save_freq=6", *k2))
    run(resume_overrides(tiny_model_dir, data, tmp_path / "split", stop_at, f"trainer.save_freq={stop_at}", *k2))
    ckpt = tmp_path / "split" / "checkpoints" / f"global_step_{stop_at}"
    saved = torch.load(ckpt / "rollouts_ahead.pt", weights_only=True)
    assert [b["step"] for b in saved["batches"]] == [stop_at + 1, stop_at + 2]
    assert [b["version"] for b in saved["batches"]] == [stop_at - 2, stop_at - 1]
    summary = run(resume_overrides(tiny_model_dir, data, tmp_path / "split", 6, "trainer.save_freq=6", *k2))
    assert summary["steps"] == 6
    assert same_weights(final_weights(tmp_path / "whole", 6), final_weights(tmp_path / "split", 6))
    whole, split = comparable(tmp_path / "whole"), comparable(tmp_path / "split")
    if not any(k.startswith("val/") for k in whole[stop_at]):  # the first half validated at its last step
        split[stop_at] = {k: v for k, v in split[stop_at].items() if not k.startswith("val/")}
    assert whole == split


@pytest.mark.parametrize("failures", [0, 1])
def test_a_killed_rollout_process_is_replaced_or_stops_the_run_with_its_cause(tmp_path, data, tiny_model_dir,
                                                                              failures, capfd):
    """Killed after step 1: replaced and the run goes on to its end (async_training.max_rollout_failures=1), or,
    with no replacement allowed, the run stops at once with a line naming the process and the signal."""
    steps = 4 if failures else 50
    r = build_run(load_config(None, small_run_overrides(tiny_model_dir, data, tmp_path / "run", steps, *ASYNC,
                                                        "trainer.save_last=false", "trainer.test_freq=-1",
                                                        f"async_training.max_rollout_failures={failures}")))
    pool = r.actor.engine
    first = pool.workers[0]

    def kill_after_step_1():
        while not (tmp_path / "run" / "metrics.jsonl").exists() or len(read_metrics(tmp_path / "run")) < 2:
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)

    threading.Thread(target=kill_after_step_1, daemon=True).start()
    start = time.perf_counter()
    if failures:
        train(r)
        assert [m["step"] for m in read_metrics(tmp_path / "run") if "actor/pg_loss" in m] == [1, 2, 3, 4]
        assert pool.failures == 1 and pool.workers[0] is not first
        assert re.search(r"rollout process \(pid \d+\) was killed by signal 9 during \w+; replacing it",
                         capfd.readouterr().err)
    else:
        with pytest.raises(RolloutProcessError, match=r"^the rollout process \(pid \d+\) was killed by signal 9 "
                           r"during \w+ \(rollout worker 0 of 1; 0 replacements of async_training.max_rollout_"
                           r"failures=0 already made\): the run stops here"):
            train(r)
        assert time.perf_counter() - start < 120
    assert not first.process.is_alive()


def test_the_rollout_process_samples_as_the_engine_in_the_trainer_does(trained_tiny_model_dir):
    """RemoteEngine: an engine built in its own process, weights pushed in, the same samples for the same seed
    as the HF engine in this one; its errors come back with the child's traceback."""
    from functools import partial

    from posttrain.worker.engines import build_rollout_engine
    from posttrain.models import load_model
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.rollout.remote import RemoteEngine
    from posttrain.rollout.weights import named_full_weights
    from posttrain.driver.settings import worker_spec

    cfg = load_config(None, [f"model.path={trained_tiny_model_dir}", *ASYNC])
    spec = worker_spec(cfg, str(trained_tiny_model_dir), None, "cpu", 1)
    model = load_model(trained_tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # weights other than the directory's: they must travel
    local = HFRolloutEngine(model, [2], 0, seed=spec.seed)
    remote = RemoteEngine(partial(build_rollout_engine, spec, [2], 0, 0), threads=1)
    try:
        remote.load_weights(named_full_weights(model))
        params = SamplingParams(max_new_tokens=5, n=2, logprobs=True)
        prompts = [[5, 6, 7], [8, 9]]
        a, b = local.generate(prompts, params), remote.generate(prompts, params)
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)
        assert torch.equal(local.generator.get_state(), remote.generator.get_state())
        with pytest.raises(RuntimeError, match="(?s)failed in generate:.*ValueError: generate"):
            remote.generate([], params)
    finally:
        remote.close()
    assert not remote.process.is_alive()


@pytest.mark.parametrize("overrides, message", [
    (["async_training.max_trajectory_age_steps=-1"], "max_trajectory_age_steps must be an integer >= 0"),
    (["async_training.enable=true", "rollout.stale_updates=1"], "set rollout.stale_updates=0"),
    (["async_training.enable=true", "async_training.rollout_n_gpus_per_node=3", "rollout.tensor_model_parallel_size=2"],
     r"rollout_nnodes x async_training.rollout_n_gpus_per_node = 3 devices is not a multiple of "
     r"rollout.tensor_model_parallel_size=2"),
    (["async_training.enable=true", "async_training.max_rollout_failures=-1"],
     "max_rollout_failures must be an integer >= 0"),
    (["async_training.enable=true", "async_training.rollout_nnodes=0"], "rollout_nnodes must be an integer >= 1"),
    (["async_training.enable=true", "model.lora_rank=4", "rollout.lora_sync=adapter"], "lora_sync=merged"),
])
def test_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(None, overrides)
    assert "\n" not in str(refused.value)


def test_in_flight_updates_take_the_hf_or_the_vllm_engine():
    """vLLM takes in-flight updates by partial rollout (rollout/vllm_partial.py); another engine name is refused
    in one line naming the two."""
    from posttrain.config.validate_rollout import validate_async

    for name in ("hf", "vllm"):
        c = load_config(None, ["async_training.enable=true", "async_training.in_flight_weight_updates=true",
                               f"rollout.name={name}", "algorithm.rollout_correction.rollout_is=token"])
        assert (c.rollout.name, c.async_training.in_flight_weight_updates) == (name, True)
    c.rollout.name = "sglang"  # refused before this check by rollout.name's own; the check still names both
    with pytest.raises(ConfigError, match="in_flight_weight_updates=true needs rollout.name=hf or vllm") as refused:
        validate_async(c)
    assert "\n" not in str(refused.value)


def test_a_trainer_group_runs_beside_rollout_workers_of_their_own():
    """Several trainer workers (on Ray) beside R = nnodes x n_gpus_per_node / rollout TP rollout workers: 2 x 4 / 2."""
    c = load_config(None, ["async_training.enable=true", "trainer.nnodes=2", "trainer.n_gpus_per_node=4",
                           "trainer.use_ray=true", "async_training.rollout_nnodes=2",
                           "async_training.rollout_n_gpus_per_node=4", "rollout.tensor_model_parallel_size=2",
                           "async_training.max_rollout_failures=0", "algorithm.rollout_correction.rollout_is=token"])
    a = c.async_training
    assert (c.trainer.nnodes, c.trainer.n_gpus_per_node, c.trainer.use_ray) == (2, 4, True)
    assert (a.enable, a.rollout_nnodes, a.rollout_n_gpus_per_node, a.max_rollout_failures) == (True, 2, 4, 0)
    assert load_config(None, []).async_training.max_rollout_failures == 3  # the default


def test_verls_one_step_off_policy_keys_are_asynchronous_training_with_k_1():
    """verl's one-step off-policy recipe: actor_rollout_ref.hybrid_engine=False (rollout and trainer apart) and
    the rollout's own devices, rollout.nnodes / rollout.n_gpus_per_node."""
    a = load_config(None, ["actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
                           "algorithm.rollout_correction.bypass_mode=true"]).async_training
    assert (a.enable, a.max_trajectory_age_steps) == (True, 1)
    a = load_config(None, ["async_training.max_trajectory_age_steps=2", "actor_rollout_ref.hybrid_engine=False",
                           "algorithm.rollout_correction.rollout_is=token"]).async_training
    assert (a.enable, a.max_trajectory_age_steps) == (True, 2)  # a k the run sets wins
    assert not load_config(None, ["actor_rollout_ref.hybrid_engine=True"]).async_training.enable
    a = load_config(None, ["actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=2", "rollout.n_gpus_per_node=4",
                           "trainer.n_gpus_per_node=4", "algorithm.rollout_correction.bypass_mode=true"]).async_training
    assert (a.enable, a.rollout_nnodes, a.rollout_n_gpus_per_node) == (True, 2, 4)


# verl's fully asynchronous trainer's keys as its scripts pass them (verl.experimental.fully_async_policy/shell/*.sh)
VERL_FULLY_ASYNC = ["actor_rollout_ref.hybrid_engine=False", "data.train_batch_size=0", "data.gen_batch_size=1",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                    "actor_rollout_ref.rollout.calculate_log_probs=True",
                    "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "rollout.total_rollout_steps=20",
                    "rollout.test_freq=2", "rollout.total_epochs=10", "async_training.staleness_threshold=0.5",
                    "async_training.trigger_parameter_sync_step=2", "async_training.require_batches=2",
                    "async_training.partial_rollout=True", "async_training.use_rollout_log_probs=True"]


def test_verls_fully_asynchronous_keys_make_a_step_of_one_weight_version():
    """A weight version is mini x require x trigger prompts (2 x 2 x 2 = 8): one step of 8 prompts, 4 optimizer
    steps; k = ceil(0.5) = 1; partial rollouts are in-flight updates (hf, vllm); the rollout's log-probs are the old
    policy's (bypass mode); 20 prompts = ceil(20 / 8) = 3 steps."""
    c = load_config(None, VERL_FULLY_ASYNC)
    a = c.async_training
    assert (a.enable, a.max_trajectory_age_steps, a.in_flight_weight_updates) == (True, 1, True)
    assert a.stream_samples  # verl's rollouter hands samples over as they finish
    c2 = load_config(None, [*VERL_FULLY_ASYNC, "async_training.stream_samples=false"])
    assert not c2.async_training.stream_samples
    assert (c.data.train_batch_size, c.actor.ppo_mini_batch_size) == (8, 2)
    assert (c.trainer.total_training_steps, c.trainer.test_freq, c.trainer.total_epochs) == (3, 2, 10)
    assert c.algorithm.rollout_correction.bypass_mode
    c = load_config(None, [*VERL_FULLY_ASYNC, "async_training.staleness_threshold=0",
                           "async_training.compute_prox_log_prob=True"])
    assert (c.async_training.max_trajectory_age_steps, c.async_training.in_flight_weight_updates) == (0, False)
    assert not c.algorithm.rollout_correction.bypass_mode  # the trainer computes the old log-probs: decoupled
    c = load_config(None, [*VERL_FULLY_ASYNC, "trainer.n_gpus_per_node=2"])  # two trainer workers, one rollout's
    a = c.async_training
    assert (c.trainer.n_gpus_per_node, a.enable, a.rollout_nnodes, a.rollout_n_gpus_per_node) == (2, True, 1, 1)
    c = load_config(None, [*VERL_FULLY_ASYNC, "actor_rollout_ref.rollout.name=vllm"])  # vLLM's partial rollout
    assert (c.rollout.name, c.async_training.in_flight_weight_updates) == ("vllm", True)
    with pytest.raises(ConfigError, match="make a weight version .* = 8 prompts; set data.train_batch_size=0"):
        load_config(None, [*VERL_FULLY_ASYNC, "data.train_batch_size=16"])
    with pytest.raises(ConfigError, match="disagree; set one of them"):
        load_config(None, [*VERL_FULLY_ASYNC, "async_training.max_trajectory_age_steps=3"])
    with pytest.raises(ConfigError, match="trigger_parameter_sync_step must be an integer >= 1"):
        load_config(None, [*VERL_FULLY_ASYNC, "async_training.trigger_parameter_sync_step=0"])


def test_the_dialect_translates_verls_fully_asynchronous_keys_before_the_merge():
    """fully_async.translate reads verl's keys and posttrain's as the merge will make them (`value`), and gives
    posttrain's keys; a key the run sets itself wins, a contradiction is refused."""
    from posttrain.config.dialects.verl import fully_async

    ours = {"actor.ppo_mini_batch_size": 3, "data.train_batch_size": 0, "rollout.name": "hf",
            "async_training.max_trajectory_age_steps": 1, "algorithm.rollout_correction.bypass_mode": False}
    verl = {"async_training.staleness_threshold": 1.5, "async_training.require_batches": 2,
            "async_training.total_rollout_prompts": 100}
    # 3 prompts x 2 mini-batches x 4 syncs (verl's default trigger) = 24 prompts a step; ceil(100 / 24) = 5 steps;
    # k = ceil(1.5) = 2; partial rollouts (verl's default) are in-flight updates on hf; the rollout's log-probs
    # (verl's default) are the old policy's: bypass mode; samples streamed, as verl's rollouter hands them over
    assert fully_async.translate(verl, ours.get, {"data.train_batch_size"}) == {
        "async_training.enable": True, "async_training.max_trajectory_age_steps": 2, "data.train_batch_size": 24,
        "trainer.total_training_steps": 5, "async_training.in_flight_weight_updates": True,
        "async_training.stream_samples": True, "algorithm.rollout_correction.bypass_mode": True}
    # the run's own steps, in-flight switch, streaming and bypass mode win; its k must agree
    given = {"trainer.total_training_steps", "async_training.in_flight_weight_updates",
             "algorithm.rollout_correction.bypass_mode", "async_training.stream_samples"}
    assert fully_async.translate({**verl, "async_training.compute_prox_log_prob": True}, ours.get, given) == {
        "async_training.enable": True, "async_training.max_trajectory_age_steps": 2, "data.train_batch_size": 24}
    with pytest.raises(ConfigError, match=r"max_trajectory_age_steps=1 and verl's async_training.staleness_threshold"
                                          r"=1.5 \(at most ceil\(1.5\) = 2 updates ahead\) disagree"):
        fully_async.translate(verl, ours.get, {"async_training.max_trajectory_age_steps"})
    assert fully_async.translate({}, ours.get, set()) == {}


def test_a_verl_fully_asynchronous_command_runs(tmp_path, data, trained_tiny_model_dir):
    keep = [a for a in small_run_overrides(trained_tiny_model_dir, data, tmp_path / "run", 2)
            if not a.startswith(("data.train_batch_size=", "actor.ppo_mini_batch_size=", "trainer.total_training_steps"))]
    summary = run([*keep, *VERL_FULLY_ASYNC, "async_training.rollout_threads=1", "rollout.total_rollout_steps=16",
                   "actor_rollout_ref.rollout.n=2"])
    assert summary["steps"] == 2
    steps = [line for line in read_metrics(tmp_path / "run") if "critic/score/mean" in line]
    assert [line["async/trajectory_age"] <= 1 for line in steps] == [True, True]
    assert all("rollout_corr/rollout_is_mean" not in line and "training/rollout_probs_diff_mean" in line
               for line in steps)


def test_stale_batches_without_a_correction_are_warned_about():
    with pytest.warns(UserWarning, match="without algorithm.rollout_correction"):
        load_config(None, ["async_training.enable=true"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*rollout_correction.*")
        load_config(None, ["async_training.enable=true", "algorithm.rollout_correction.rollout_is=token"])
        load_config(None, ["async_training.enable=true", "async_training.max_trajectory_age_steps=0"])


def test_in_flight_the_hf_engine_takes_new_weights_between_two_tokens_and_tags_each_token(trained_tiny_model_dir):
    """weights_hook runs before every forward: a version loaded there decides the tokens from the next one on;
    the tokens before keep theirs (the same as without the update)."""
    from posttrain.models import load_model
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.rollout.weights import named_full_weights

    model = load_model(trained_tiny_model_dir)
    other = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in named_full_weights(load_model(trained_tiny_model_dir))}
    params = SamplingParams(max_new_tokens=6, n=2, logprobs=True, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9]]
    plain = HFRolloutEngine(model, [2], 0, seed=1).generate(prompts, params)
    engine = HFRolloutEngine(model, [2], 0, seed=1)
    calls = []

    def hook():  # before each forward: the prefill (token 0's logits), then one per token; new weights before the 4th
        calls.append(1)
        if len(calls) == 4:
            engine.load_weights(iter(other.items()))
            engine.weights_version = 7

    engine.weights_hook = hook
    out = engine.generate(prompts, params)
    assert out.weight_versions.tolist() == [[0, 0, 0, 7, 7, 7]] * 4  # the 4th forward chooses token 3
    assert torch.equal(out.log_probs[:, :3], plain.log_probs[:, :3])
    assert not torch.equal(out.log_probs[:, 3:], plain.log_probs[:, 3:])


def test_in_flight_with_k_0_is_still_the_synchronous_run(tmp_path, data, trained_tiny_model_dir):
    """With k = 0 no update happens while a batch is sampled: in flight or not, the synchronous run."""
    sync = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "sync", 3, "trainer.save_freq=3")
    run(sync)
    run([*sync, f"trainer.run_dir={tmp_path / 'async'}", *ASYNC, "async_training.max_trajectory_age_steps=0",
         "async_training.in_flight_weight_updates=true"])
    a, b = comparable(tmp_path / "sync"), comparable(tmp_path / "async")
    assert all(line.get("async/in_flight_updated_share", 0) == 0 for line in b)
    assert without_async(b) == a
    assert same_weights(final_weights(tmp_path / "sync", 3), final_weights(tmp_path / "async", 3))


@pytest.mark.parametrize("streamed", [(), ("async_training.stream_samples=true", "async_training.stream_piece_size=1",
                                             "async_training.rollout_n_gpus_per_node=2")], ids=["batches", "streamed"])
def test_in_flight_with_k_2_stays_within_k_and_tags_the_tokens(tmp_path, data, trained_tiny_model_dir, streamed):
    """In flight, whole batches or streamed over two rollout workers (each piece waits for its batch's version,
    then takes every newer one at its next token): within k, each token tagged."""
    summary = run(small_run_overrides(trained_tiny_model_dir, data, tmp_path / "run", 6, *ASYNC,
                                      "async_training.max_trajectory_age_steps=2",
                                      "async_training.in_flight_weight_updates=true",
                                      "algorithm.rollout_correction.rollout_is=token", *streamed))
    assert summary["steps"] == 6
    steps = [line for line in read_metrics(tmp_path / "run") if "critic/score/mean" in line]
    assert all(0 <= line["async/trajectory_age"] <= 2 for line in steps)
    assert all(0 <= line["async/token_age_mean"] <= line["async/trajectory_age"] for line in steps)
    assert all("rollout_corr/rollout_is_mean" in line for line in steps)


def test_a_lora_policy_reaches_the_rollout_process_merged(tmp_path, data, trained_tiny_model_dir):
    """The rollout process holds a plain model: a LoRA policy's adapters arrive merged into its weights, and a
    one-update-ahead run equals rollout.stale_updates=1's (whose copy is merged the same way)."""
    pytest.importorskip("peft")
    lora = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "stale", 2, "trainer.test_freq=-1",
                               "model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "trainer.save_last=false")
    run([*lora, "rollout.stale_updates=1"])
    run([*lora, f"trainer.run_dir={tmp_path / 'async'}", *ASYNC, "async_training.max_trajectory_age_steps=1"])
    assert without_async(comparable(tmp_path / "async")) == comparable(tmp_path / "stale")
