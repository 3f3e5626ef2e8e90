"""actor.policy_loss.loss_mode reaches the update: a Worker built from the config trains two PPO epochs on
a hand-made off-policy batch, and its weights end where the same two AdamW steps end with the loss the
mode names, written out here from its paper (and far from where any other mode's steps end).

Plain GRPO passes every learning threshold, so only this shows that gspo or gpg is the loss that trained."""

import copy

import pytest
import torch

from posttrain.algorithms import POLICY_LOSSES
from posttrain.driver.batch import RolloutBatch
from posttrain.config import load_config
from posttrain.rollout.base import RolloutOutput
from posttrain.driver.settings import worker_spec
from posttrain.worker.verbs import Worker

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0


def vanilla(lp, old, adv, mask):
    """PPO-clip with dual clip (Schulman et al. 2017; Ye et al. 2020), per token."""
    r = torch.exp(lp - old)
    clipped = torch.maximum(-adv * r, -adv * r.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    return torch.where(adv < 0, torch.minimum(clipped, -adv * CLIP_C), clipped)


def gspo(lp, old, adv, mask):
    """GSPO (Zheng et al. 2025): the sequence's ratio s = exp(mean_t (lp - old)) on every token, with each
    token's own gradient: s_t = sg(s) exp(lp_t - sg(lp_t)); clipped as PPO, no dual clip."""
    log_s = ((lp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(log_s.detach() + lp - lp.detach())
    return torch.maximum(-adv * s, -adv * s.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))


def gpg(lp, old, adv, mask):
    """GPG (Chu et al. 2025): the plain policy gradient, -A log p; no ratio, no clip."""
    return -adv * lp


LOSSES = {"vanilla": vanilla, "gspo": gspo, "gpg": gpg}
P = 3  # prompt tokens


def make_batch():
    """4 rows, no padding inside the prompt; responses of 4, 3, 2 and 4 tokens (right-padded)."""
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(10, 40, (4, P), generator=g)
    responses = torch.randint(10, 40, (4, 4), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    out = RolloutOutput(prompts, torch.ones_like(prompts), responses * mask, mask)
    batch = RolloutBatch.from_rollout(out, 1, ["arith"] * 4, ["1"] * 4, [{}] * 4, ["r"] * 4)
    # both signs, varying along each row
    batch.advantages = torch.tensor([[1.0, 0.5, 1.5, 1.0], [-1.0, -0.2, -2.0, 0.0], [0.8, 0.8, 0.0, 0.0],
                                     [-0.5, 1.0, -1.5, 0.3]]) * mask
    return batch


def log_probs(model, batch):
    """[4, R] log-probs of the response tokens by a plain forward (no padding before them)."""
    logits = model(input_ids=batch.input_ids).logits[:, P - 1:-1]  # [4, R, V], the position before each token
    return logits.float().log_softmax(-1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


def reference_steps(model, batch, mode, lr, epochs=2):
    """The update by hand: `epochs` AdamW steps over the whole batch, token-mean of LOSSES[mode], gradient
    norm clipped to 1 (the config's defaults) -> (model, [loss of each step])."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.999))
    mask = batch.response_mask.float()
    losses = []
    for _ in range(epochs):
        per_token = LOSSES[mode](log_probs(model, batch), batch.old_log_probs, batch.advantages, mask)
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return model, losses


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def worker_of(tiny_model_dir):
    def make(mode):
        cfg = load_config(None, [
            f"model.path={tiny_model_dir}", "rollout.n=1", "data.train_batch_size=4", "data.max_response_length=4",
            "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=2", "actor.ppo_epochs=2", "actor.lr=1e-3",
            "actor.weight_decay=0", f"actor.clip_ratio_low={CLIP_LOW}", f"actor.clip_ratio_high={CLIP_HIGH}",
            f"actor.clip_ratio_c={CLIP_C}", "actor.loss_agg_mode=token-mean", f"actor.policy_loss.loss_mode={mode}"])
        worker = Worker(worker_spec(cfg, str(tiny_model_dir), None, "cpu", total_steps=1))
        worker.setup()
        return worker
    return make


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
def test_the_update_is_the_one_of_the_configured_loss(worker_of, mode):
    assert set(POLICY_LOSSES) == set(LOSSES)  # a new policy loss needs its formula here
    worker = worker_of(mode)
    batch = make_batch()
    with torch.no_grad():
        assert torch.allclose(log_probs(worker.policy, batch) * batch.response_mask,
                              worker.compute_log_probs(batch) * batch.response_mask, atol=1e-5)
        # off-policy from the first step: log-ratios of -1.2 to 1.2, inside and outside the clip range
        shift = torch.linspace(-1.2, 1.2, 16).reshape(4, 4)[[2, 0, 3, 1]]
        batch.old_log_probs = (log_probs(worker.policy, batch) + shift) * batch.response_mask
    start = copy.deepcopy(worker.policy)
    lr = worker.optimizer.param_groups[0]["lr"]
    metrics = worker.train_step(batch)

    got = flat(worker.policy)
    moved = (got - flat(start)).abs()
    assert moved.max() > 5e-4  # two steps of lr 1e-3 moved the weights
    expected, losses = reference_steps(start, batch, mode, lr)
    torch.testing.assert_close(got, flat(expected), rtol=0, atol=1e-5)  # measured: 3e-7
    assert metrics["actor/pg_loss"] == pytest.approx(sum(losses) / 2, rel=1e-4, abs=1e-6)
    # any other loss would have ended elsewhere, far beyond that tolerance
    for other in set(LOSSES) - {mode}:
        elsewhere, _ = reference_steps(start, batch, other, lr)
        assert (flat(elsewhere) - got).abs().max() > 1e-3, other  # measured: 4e-3
