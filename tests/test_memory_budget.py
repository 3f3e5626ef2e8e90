"""The no-gradient log-prob passes' token budget from free device memory (model.log_prob_budget_from_memory):
the arithmetic by hand, the memory read (mocked), the switch's default, and the pass's log-probs against the
fixed-count path's."""

import torch

from posttrain.training.actor import UpdateSettings
from posttrain.training.microbatch import memory_token_budget
from posttrain.worker import passes
from posttrain.worker.spec import WorkerSpec

from test_pass_syncs import tiny_qwen2
from test_update_syncs import synthetic_batch

GIB = 2 ** 30


def test_the_budget_is_the_docstrings_formula():
    # Qwen2.5-7B in bf16: (4 + 2) 152064 + 2 (4 3584 + 3 18944) + 2 2 28 512 = 912384 + 142336 + 57344 bytes
    per_token = 1_112_064
    assert memory_token_budget(60 * GIB, 152064, 3584, 18944, 28, 512, 2) == 30 * GIB // per_token == 28966
    assert memory_token_budget(60 * GIB, 152064, 3584, 18944, 28, 512, 2, fraction=1.0) == 57932
    # the tiny Qwen2 in float32: 8 40 + 4 (4 32 + 3 64) + 2 4 2 16 = 320 + 1280 + 256 = 1856 bytes a token
    assert memory_token_budget(1856 * 600, 40, 32, 64, 2, 16, 4) == 300
    assert memory_token_budget(1000, 152064, 3584, 18944, 28, 512, 2) == 1  # a row runs alone, however long


def test_the_free_memory_counts_what_torchs_allocator_holds_unused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * GIB)
    assert passes.free_bytes(torch.device("cuda", 0)) == 12 * GIB


def test_the_model_shape_read_for_the_budget(monkeypatch):
    model = tiny_qwen2("lm")  # V 40, H 32, I 64, 2 layers, 2 key/value heads of 8
    monkeypatch.setattr(passes, "free_bytes", lambda device: 1856 * 600)
    assert passes.memory_budget(model) == 300  # float32 weights: 4 bytes
    assert passes.memory_budget(model, "bfloat16") == 600 * 1856 // 2 // (6 * 40 + 2 * 320 + 4 * 32)


def spec(on: bool | None) -> WorkerSpec:
    return WorkerSpec(model_dir="-", update=UpdateSettings(mini_batch_size=64, micro_batch_size=8),
                      log_prob_micro_batch_size=8, log_prob_budget_from_memory=on)


def test_on_by_default_on_cuda_only_and_a_set_budget_wins(monkeypatch):
    model = tiny_qwen2("lm")
    assert not passes.budget_from_memory(spec(None), model)  # a CPU model: nothing changes
    assert passes.budget_from_memory(spec(True), model) and not passes.budget_from_memory(spec(False), model)
    monkeypatch.setattr(passes, "compute_device", lambda model: torch.device("cuda", 0))
    assert passes.budget_from_memory(spec(None), model)
    seen = []
    monkeypatch.setattr(passes, "compute_log_probs", lambda *a, max_tokens=None, **k: seen.append(max_tokens) or
                        (None, None))
    monkeypatch.setattr(passes, "free_bytes", lambda device: 1856 * 600)
    b = synthetic_batch(n_prompts=2, n=2)
    for which in ("policy", "ref"):
        passes.log_probs(spec(None), b, which, None, model, model, {}, None)
    with_budget = WorkerSpec(**{**spec(None).__dict__, "log_prob_max_tokens": 77})
    passes.log_probs(with_budget, b, "policy", None, model, model, {}, None)
    assert seen == [300, 300, 77]


def test_the_budgets_log_probs_are_the_fixed_counts_within_float32_rounding(monkeypatch):
    """Log-probs do not depend on how rows are grouped, up to rounding: a micro-batch's trimmed width (and so
    its matmuls' shapes) changes with its rows. Measured: at most 8.3 float32 eps relative on the embedded
    model, 1.1 on this one; about a third of the tokens differ at all."""
    model = tiny_qwen2("lm")
    b = synthetic_batch(n_prompts=16, n=4, prompt_width=20, response_width=24)
    mask = b.response_mask.bool()
    fixed = passes.log_probs(spec(False), b, "policy", None, model, None, {}, None)
    for tokens in (60, 300, 5000):  # a few rows a micro-batch, many more than 8, all 64 at once
        monkeypatch.setattr(passes, "free_bytes", lambda device, t=tokens: 1856 * 2 * t)
        budget = passes.log_probs(spec(True), b, "policy", None, model, None, {}, None)
        torch.testing.assert_close(budget[mask], fixed[mask], rtol=1e-6, atol=0)


def test_the_key_reaches_the_workers_spec():
    from posttrain.config import load_config
    from posttrain.driver.settings import worker_spec

    def of(*overrides):
        return worker_spec(load_config(None, ["model.path=/m", *overrides]), "/m", None, "cpu", total_steps=1)

    assert of().log_prob_budget_from_memory is None  # null: decided by the model's device, in the worker
    assert of("model.log_prob_budget_from_memory=false").log_prob_budget_from_memory is False
    assert of("actor_rollout_ref.model.log_prob_budget_from_memory=true").log_prob_budget_from_memory is True
