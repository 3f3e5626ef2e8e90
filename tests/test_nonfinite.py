"""Numerical faults: a NaN or inf skips its update, is counted, and a streak
of them stops the run with the last good state saved."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import posttrain.training.actor as actor_mod
import posttrain.worker.verbs as worker_mod
from posttrain.driver.batch import RolloutBatch
from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.driver.loop import train
from posttrain.driver.nonfinite import NonfiniteGuard, first_nonfinite_input, update_fault
from posttrain.rollout.base import RolloutOutput
from posttrain.training.actor import run_updates

from helpers import one_batch_overrides, read_metrics, write_prompts

NAN, INF = float("nan"), float("inf")


def rows(x: torch.Tensor) -> RolloutBatch:
    """The least a batch needs for run_updates (which plans its micro-batches from the rollout batch's
    tensors): one-token prompts, one-token responses, `x` [N, 2] carried as its advantages (`mb.advantages`)."""
    n = len(x)
    ones = torch.ones(n, 1, dtype=torch.long)
    return RolloutBatch(input_ids=torch.cat([ones, ones], 1), attention_mask=torch.ones(n, 2, dtype=torch.long),
                        position_ids=torch.tensor([[0, 1]] * n), responses=ones, response_mask=ones,
                        group=torch.arange(n), advantages=x)


def test_a_nonfinite_loss_skips_only_its_mini_batch():
    """Two mini-batches: the first's loss is inf while its gradient is
    finite (an inf constant term), the second is fine. Only the second steps:
    with SGD lr 1 and loss = sum(w * x), w moves by -x of the second rows."""
    w = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(w.weight)
    opt = torch.optim.SGD(w.parameters(), lr=1.0)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])

    def loss_fn(mb):
        loss = w(mb.advantages).sum()
        if mb.advantages[0, 0] == 1.0:  # the first row's mini-batch
            loss = loss + INF
        return loss, {"actor/pg_loss": float(loss.detach())}

    m = run_updates(w, opt, rows(x), loss_fn, mini_batch_size=1, micro_batch_size=1, epochs=1,
                    loss_agg_mode="token-mean", grad_clip=1e9)
    assert torch.equal(w.weight.detach(), torch.tensor([[-3.0, -4.0]]))
    assert m["actor/nonfinite_updates"] == 1.0
    assert m["actor/grad_norm"] == pytest.approx(5.0)  # |(3, 4)|: the skipped update's norm is not averaged in
    assert math.isinf(m["actor/loss"])


def test_a_nan_gradient_leaves_weights_and_optimizer_state_untouched():
    w = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.AdamW(w.parameters(), lr=0.1)
    before = w.weight.detach().clone()

    def loss_fn(mb):
        return (w(mb.advantages) * NAN).sum(), {}

    m = run_updates(w, opt, rows(torch.ones(2, 2)), loss_fn, 2, 2, 1, "token-mean", 1.0)
    assert torch.equal(w.weight.detach(), before)
    assert opt.state == {} or all(not s for s in opt.state.values())  # AdamW never stepped: no moments, no count
    assert m["actor/nonfinite_updates"] == 1.0 and math.isnan(m["actor/grad_norm"])


def make_batch():
    out = RolloutOutput(prompt_ids=torch.tensor([[5], [6]]), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                        response_ids=torch.tensor([[1, 2], [3, 0]]), response_mask=torch.tensor([[1, 1], [1, 0]]))
    b = RolloutBatch.from_rollout(out, 1, ["a", "a"], ["x", "y"], [{}, {}], ["r0", "r1"])
    b.old_log_probs = torch.zeros(2, 2)
    b.advantages = torch.zeros(2, 2)
    return b


def test_the_first_nonfinite_input_on_a_valid_token_is_named():
    b = make_batch()
    assert first_nonfinite_input(b) is None
    b.advantages[1, 1] = NAN  # padding: not a fault
    b.old_log_probs[1, 1] = -INF
    assert first_nonfinite_input(b) is None
    b.advantages[0, 1] = INF
    assert first_nonfinite_input(b) == "advantages"
    b.old_log_probs[1, 0] = NAN  # made before the advantages: named first
    assert first_nonfinite_input(b) == "old_log_probs"


def test_update_fault_names_losses_in_order_then_the_gradient_norm():
    assert update_fault({"actor/pg_loss": 0.1, "actor/nonfinite_updates": 0.0}) is None
    assert update_fault({"actor/pg_loss": NAN, "actor/loss": NAN}) == "actor/pg_loss"
    assert update_fault({"critic/vf_loss": INF, "actor/pg_loss": NAN}) == "critic/vf_loss"
    assert update_fault({"actor/pg_loss": 0.1, "actor/nonfinite_updates": 1.0}) == "actor/grad_norm"


def test_the_guard_counts_streaks():
    g = NonfiniteGuard(limit=2)
    assert g.observe(1, None) == 0.0
    assert g.observe(2, "actor/loss") == 1.0 and not g.exhausted
    assert g.observe(3, None) == 1.0  # a good step ends the streak, not the count
    assert g.observe(4, "advantages") == 2.0 and not g.exhausted
    assert g.observe(5, "actor/loss") == 3.0 and g.exhausted
    assert "step 5" in g.message(5, "ckpts") and "non-finite advantages (first at step 4)" in g.message(5, "ckpts")
    again = NonfiniteGuard(limit=2)
    again.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert (again.total, again.streak, again.first, again.exhausted) == (3, 2, (4, "advantages"), True)
    never = NonfiniteGuard(limit=0)
    for step in range(1, 50):
        never.observe(step, "actor/loss")
    assert not never.exhausted


@pytest.fixture
def nan_at_steps(monkeypatch):
    """NaN in the actor's loss at the given 1-based RL steps (counted by the
    worker's update calls), on the chosen steps only."""
    bad, calls = set(), {"step": 0}
    original_update, original_loss = worker_mod.update_policy, actor_mod.micro_loss

    def update_policy(*args, **kwargs):
        calls["step"] += 1
        return original_update(*args, **kwargs)

    def micro_loss(*args, **kwargs):
        loss, m = original_loss(*args, **kwargs)
        return (loss * NAN if calls["step"] in bad else loss), m

    monkeypatch.setattr(worker_mod, "update_policy", update_policy)
    monkeypatch.setattr(actor_mod, "micro_loss", micro_loss)
    return bad


def small_run_args(tmp_path, model_dir, steps: int, *extra):
    write_prompts(tmp_path, 8)
    return one_batch_overrides(model_dir, tmp_path, tmp_path / "run", steps, "actor.lr=1e-3", *extra)


def test_a_nan_step_changes_no_weight_and_the_run_goes_on(tmp_path, tiny_model_dir, nan_at_steps):
    nan_at_steps.add(2)
    run = build_run(load_config(None, small_run_args(tmp_path, tiny_model_dir, 4)))
    moved, original = [], run.actor.train_step

    def train_step(batch, *args):
        before = [p.detach().clone() for p in run.actor.policy.parameters()]
        m = original(batch, *args)
        moved.append(any(not torch.equal(b, p) for b, p in zip(before, run.actor.policy.parameters())))
        return m

    run.actor.train_step = train_step
    assert train(run)["steps"] == 4
    assert moved == [True, False, True, True]
    lines = read_metrics(tmp_path / "run")
    assert [x["actor/nonfinite_steps"] for x in lines] == [0, 1, 1, 1]
    assert [x["actor/nonfinite_updates"] for x in lines] == [0, 1, 0, 0]


def test_a_streak_of_nan_steps_stops_with_the_last_good_state_saved(tmp_path, tiny_model_dir, nan_at_steps, capsys):
    from posttrain.cli import main

    nan_at_steps.update(range(2, 10))
    args = small_run_args(tmp_path, tiny_model_dir, 8, "trainer.max_nonfinite_steps=2", "trainer.save_freq=1",
                          "trainer.max_ckpt_to_keep=5")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "stopped at step 3: 2 steps in a row had a non-finite actor/loss (first at step 2)" in err
    ckpts = tmp_path / "run" / "checkpoints"
    step1, step3 = (load_file(ckpts / f"global_step_{n}" / "actor" / "model.safetensors") for n in (1, 3))
    assert step1.keys() == step3.keys() and all(torch.equal(step1[k], step3[k]) for k in step1)
    assert json.loads((ckpts / "global_step_3" / "trainer_state.json").read_text())["nonfinite"]["streak"] == 2
    lines = read_metrics(tmp_path / "run")
    assert [x["training/global_step"] for x in lines] == [1, 2, 3]  # every step logged; nothing after the stop
