import copy

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.algorithms import place_on_last_token
from posttrain.rollout.base import RolloutOutput
from posttrain.training.actor import UpdateSettings, loss_units, make_optimizer, update_policy
from posttrain.training.logprobs import compute_log_probs


def make_batch():
    # 2 prompts x 2 samples; prompts left-padded to 3, responses right-padded to 3.
    out = RolloutOutput(
        prompt_ids=torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[11, 12, 1], [13, 1, 0], [14, 15, 16], [1, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]),
    )
    return RolloutBatch.from_rollout(out, 2, ["a", "b"], ["x", "y"], [{}, {}], ["r0", "r1", "r2", "r3"])


def test_batch_layout_and_select():
    b = make_batch()
    assert b.group.tolist() == [0, 0, 1, 1]
    assert b.data_source == ["a", "a", "b", "b"]
    assert b.position_ids[0].tolist() == [0, 0, 1, 2, 3, 4]
    assert b.attention_mask[3].tolist() == [1, 1, 1, 1, 0, 0]
    sub = b.select([3, 0])
    assert sub.response_text == ["r3", "r0"] and sub.responses[0].tolist() == [1, 0, 0]
    assert [len(c) for c in b.split(3)] == [3, 1]


def test_reward_goes_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    got = place_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert got.tolist() == [[0, 0, 1], [0, 2, 0], [3, 0, 0], [0, 0, 0]]


def test_log_probs_match_unpadded_forward(random_qwen2):
    b = make_batch()
    lp, ent = compute_log_probs(random_qwen2, b, micro_batch_size=3, with_entropy=True)
    assert lp.shape == (4, 3) and ent.shape == (4, 3)
    # Row 1: prompt [5, 6], response [13, 1]
    with torch.no_grad():
        logits = random_qwen2(input_ids=torch.tensor([[5, 6, 13, 1]])).logits[0].log_softmax(-1)
    expected = torch.stack([logits[1, 13], logits[2, 1]])
    torch.testing.assert_close(lp[1, :2], expected, atol=1e-5, rtol=1e-5)
    # temperature divides the logits before the softmax
    lp_t, _ = compute_log_probs(random_qwen2, b, micro_batch_size=4, temperature=2.0)
    with torch.no_grad():
        logits_t = (random_qwen2(input_ids=torch.tensor([[5, 6, 13, 1]])).logits[0] / 2.0).log_softmax(-1)
    torch.testing.assert_close(lp_t[1, 0], logits_t[1, 13], atol=1e-5, rtol=1e-5)


def micro_weight(micro_mask: torch.Tensor, mini_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """Share of a micro-batch in its mini-batch, so that summing the weighted
    micro losses gives the loss of the whole mini-batch."""
    total = loss_units(mini_mask, loss_agg_mode)
    return loss_units(micro_mask, loss_agg_mode) / total if total > 0 else 0.0


def test_micro_weights_by_tokens_or_sequences():
    mini = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    assert micro_weight(mini[:1], mini, "token-mean") == pytest.approx(3 / 6)
    # per-sequence modes count the sequences with a valid token: 3 here (the last row is empty)
    assert micro_weight(mini[:1], mini, "seq-mean-token-mean") == pytest.approx(1 / 3)
    assert micro_weight(mini[3:], mini, "seq-mean-token-sum") == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_one_big_batch(random_qwen2, mode):
    """The gradient summed over micro-batches is the full mini-batch's gradient,
    also with an empty response in the batch."""
    b = make_batch()
    b.response_mask = b.response_mask.clone()
    b.response_mask[3] = 0  # a zero-length response
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 4)
    b.old_log_probs = b.old_log_probs + 0.05  # off-policy a little, so clipping is exercised
    b.advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, 3) * b.response_mask
    grads = []
    for micro in (4, 1):
        model = copy.deepcopy(random_qwen2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        update_policy(model, opt, b, UpdateSettings(mini_batch_size=4, micro_batch_size=micro,
                                                    loss_agg_mode=mode, grad_clip=1e9))
        grads.append(torch.cat([(p0 - p.detach()).flatten() for p0, p in zip(before, model.parameters())]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_update_moves_weights_towards_positive_advantage(random_qwen2):
    b = make_batch()
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 4)
    b.advantages = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]).expand(4, 3) * b.response_mask
    b.ref_log_probs = b.old_log_probs.clone()
    opt = make_optimizer(random_qwen2, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999))
    m = update_policy(random_qwen2, opt, b, UpdateSettings(mini_batch_size=4, micro_batch_size=2,
                                                            use_kl_loss=True, ppo_epochs=2))
    after, _ = compute_log_probs(random_qwen2, b, 4)
    mask = b.response_mask.bool()
    delta = (after - b.old_log_probs)[mask]
    sign = b.advantages[mask].sign()
    assert (delta * sign).mean() > 0  # likelier where A > 0, less likely where A < 0
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert key in m
    assert m["actor/grad_norm"] > 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_overlong_filtering_leaves_truncated_rows_out_of_the_update(random_qwen2, mode):
    """algorithm.overlong_filtering: a truncated row counts in its group's advantages, then adds nothing to
    the update (policy loss, KL loss, entropy bonus, the counts the loss is averaged over): the update is the
    one of the other rows alone."""
    import dataclasses

    from posttrain.algorithms import grpo_advantages, truncated_rows
    from posttrain.driver.loop import overlong_filtered

    b = make_batch()  # responses [11, 12, EOS], [13, EOS], [14, 15, 16], [EOS]; EOS = 1, limit 3 tokens
    b.truncated = torch.tensor([False, False, True, False])  # row 2 reached the limit without an EOS
    # advantages with every row: group 1 (rows 2, 3) scores [1, 0] -> +-0.707107; row 3 keeps its -0.707107
    b.advantages, _ = grpo_advantages(place_on_last_token(torch.tensor([1.0, 0.0, 1.0, 0.0]), b.response_mask),
                                      b.response_mask, b.group.tolist())
    assert b.advantages[3, 0].item() == pytest.approx(-0.707106, abs=1e-5)
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 4)
    b.old_log_probs = b.old_log_probs + 0.05
    b.ref_log_probs = b.old_log_probs - 0.1
    m = {}
    filtered = overlong_filtered(b, 3, m)
    assert m == {"actor/overlong_filtered_ratio": 0.25}
    assert filtered.response_mask.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert b.response_mask[2].tolist() == [1, 1, 1]  # the step's batch keeps it: response_length/* counts it
    # an engine that does not report truncation: every response as long as the limit (rows 0 and 2)
    assert truncated_rows(None, b.response_mask, 3).tolist() == [True, False, True, False]
    none = {}
    kept = b.select([0, 1, 3])
    assert overlong_filtered(kept, 3, none) is kept and none == {"actor/overlong_filtered_ratio": 0.0}

    settings = UpdateSettings(mini_batch_size=4, micro_batch_size=2, loss_agg_mode=mode, grad_clip=1e9,
                              use_kl_loss=True, kl_loss_coef=0.5, entropy_coeff=0.01)

    def update(batch):
        model = copy.deepcopy(random_qwen2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        metrics = update_policy(model, opt, batch, dataclasses.replace(settings, mini_batch_size=len(batch)))
        return torch.cat([(p0 - p.detach()).flatten() for p0, p in zip(before, model.parameters())]), metrics

    step, metrics = update(filtered)
    alone, alone_metrics = update(b.select([0, 1, 3]))  # the batch without the truncated row
    assert step.abs().sum() > 0
    torch.testing.assert_close(step, alone, atol=1e-6, rtol=1e-4)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert metrics[key] == pytest.approx(alone_metrics[key], rel=1e-4, abs=1e-6)
    # whatever the truncated row holds (advantages, old log-probs) changes nothing
    filtered.advantages = filtered.advantages.clone()
    filtered.advantages[2] = 100.0
    filtered.old_log_probs = filtered.old_log_probs.clone()
    filtered.old_log_probs[2] = -30.0
    torch.testing.assert_close(update(filtered)[0], alone, atol=1e-6, rtol=1e-4)


def test_nonfinite_gradient_skips_the_update(random_qwen2):
    b = make_batch()
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 4)
    b.advantages = torch.full((4, 3), float("nan"))
    before = [p.detach().clone() for p in random_qwen2.parameters()]
    opt = make_optimizer(random_qwen2, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999))
    m = update_policy(random_qwen2, opt, b, UpdateSettings(mini_batch_size=4, micro_batch_size=4))
    assert m["actor/nonfinite_updates"] == 1.0
    assert all(torch.equal(p0, p) for p0, p in zip(before, random_qwen2.parameters()))


def test_responses_decode_without_padding(tiny_model_dir):
    from posttrain.rollout.base import decode_responses
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    out = RolloutOutput(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        # "68<|im_end|>" and "7" followed by padding; pad id and id 0 (a NUL byte here, "!" in Qwen) are not text
        response_ids=torch.tensor([[ord("6"), ord("8"), tok.eos_token_id], [ord("7"), 0, tok.pad_token_id]]),
        response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]),
    )
    assert decode_responses(tok, out) == ["68", "7"]


def test_warmup_schedule():
    from posttrain.training.actor import make_lr_scheduler, warmup_steps

    assert warmup_steps(5, 0.5, 100) == 5          # an explicit count wins
    assert warmup_steps(-1, 0.1, 100) == 10        # -1: ratio x total steps
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_lr_scheduler(opt, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_warmup_with_a_start_factor_is_torchs_linear_lr():
    """actor.lr_warmup_start_factor=s: s + (1 - s) * min(step, W) / W, NeMo-RL's LinearLR warm-up."""
    from posttrain.training.actor import make_lr_scheduler, warmup_lr_factor

    # W = 4, s = 0.2: 0.2 + 0.8 * [0, 1, 2, 3, 4, 4] / 4 = [0.2, 0.4, 0.6, 0.8, 1, 1]
    # W = 3, s = 0.1: 0.1 + 0.9 * [0, 1, 2, 3, 3] / 3 = [0.1, 0.4, 0.7, 1, 1]
    # W = 4, s = None (verl's, unchanged): (step + 1) / 4 = [0.25, 0.5, 0.75, 1, 1, 1]; W = 0: no warm-up
    assert [warmup_lr_factor(t, 4, 0.2) for t in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert [warmup_lr_factor(t, 3, 0.1) for t in range(5)] == pytest.approx([0.1, 0.4, 0.7, 1.0, 1.0])
    assert [warmup_lr_factor(t, 4) for t in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert warmup_lr_factor(0, 0, 0.2) == 1.0 and warmup_lr_factor(0, 0) == 1.0
    for s in (0.2, 1.0, 1 / 3):  # the scheduler gives torch's LinearLR, stepped once per update
        ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        torchs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        sched = make_lr_scheduler(ours, warmup_steps=5, start_factor=s)
        ref = torch.optim.lr_scheduler.LinearLR(torchs, start_factor=s, end_factor=1.0, total_iters=5)
        for _ in range(8):
            assert ours.param_groups[0]["lr"] == pytest.approx(torchs.param_groups[0]["lr"])
            ours.step(), torchs.step(), sched.step(), ref.step()
    # a scheduler resumed from its state_dict goes on where it was
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_lr_scheduler(opt, 4, 0.2)
    for _ in range(2):
        opt.step(), sched.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = make_lr_scheduler(opt2, 4, 0.2)
    opt2.load_state_dict(opt.state_dict()), sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.6)
    opt2.step(), sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.8)


# W = 2, T = 6, by hand: the warm-up is posttrain's (step + 1) / 2 -> 0.5, 1; from step 2 the progress
# p = (step - 2) / 4 = 0, 0.25, 0.5, 0.75, 1 and (1 + cos(pi p)) / 2 = 1, (1 + 0.70711) / 2, 0.5, (1 - 0.70711) / 2, 0
COSINE_W2_T6 = [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0]
# min_lr_ratio 0.1: 0.1 + 0.9 x the above after the warm-up: 1, 0.868198, 0.55, 0.231802, 0.1
COSINE_W2_T6_FLOOR = [0.5, 1.0, 1.0, 0.868198, 0.55, 0.231802, 0.1]


def test_cosine_schedule_is_verls_after_posttrains_warm_up():
    from posttrain.training.actor import lr_factor

    assert [lr_factor(t, 2, 6, schedule="cosine") for t in range(7)] == pytest.approx(COSINE_W2_T6, abs=1e-6)
    assert [lr_factor(t, 2, 6, schedule="cosine", min_lr_ratio=0.1)
            for t in range(7)] == pytest.approx(COSINE_W2_T6_FLOOR, abs=1e-6)
    # with a start factor the warm-up is LinearLR's: 0.2, then 0.2 + 0.8 x 1/2 = 0.6; the cosine is unchanged
    assert [lr_factor(t, 2, 6, 0.2, "cosine") for t in range(4)] == pytest.approx([0.2, 0.6, 1.0, 0.853553], abs=1e-6)
    # no warm-up, T = 4: p = 0, 0.25, 0.5, 0.75, 1
    assert [lr_factor(t, 0, 4, schedule="cosine") for t in range(5)] == pytest.approx(COSINE_W2_T6[2:], abs=1e-6)
    # num_cycles 1: a whole wave, T = 4: cos(2 pi p) = 1, 0, -1, 0, 1 -> 1, 0.5, 0, 0.5, 1
    assert [lr_factor(t, 0, 4, schedule="cosine", num_cycles=1.0)
            for t in range(5)] == pytest.approx([1.0, 0.5, 0.0, 0.5, 1.0], abs=1e-9)
    # the constant schedule is the warm-up alone, whatever the total
    assert [lr_factor(t, 2, 6) for t in range(7)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="linear"):
        lr_factor(3, 2, 6, schedule="linear")


def test_cosine_scheduler_sets_the_lr_and_resumes_from_its_state_dict():
    from posttrain.training.actor import make_lr_scheduler

    def scheduler(lr=2.0):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        return opt, make_lr_scheduler(opt, 2, None, 6, "cosine", 0.1)

    opt, sched = scheduler()
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step(), sched.step()
    assert lrs == pytest.approx([2.0 * f for f in COSINE_W2_T6_FLOOR], abs=1e-6)
    # resumed after three updates (as a checkpoint saves and loads them): the same LRs from step 3 on
    opt, sched = scheduler()
    for _ in range(3):
        opt.step(), sched.step()
    state = sched.state_dict()
    assert state["lr_lambdas"] == [None]  # a plain function: nothing of the schedule's own in the checkpoint
    opt2, sched2 = scheduler()
    opt2.load_state_dict(opt.state_dict()), sched2.load_state_dict(state)
    resumed = []
    for _ in range(4):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step(), sched2.step()
    assert resumed == pytest.approx([2.0 * f for f in COSINE_W2_T6_FLOOR[3:]], abs=1e-6)


# ---------------------------------------------------------------- token-budget micro-batches (use_dynamic_bsz)

def test_spans_fill_a_token_budget_and_a_longer_row_runs_alone():
    from posttrain.training.microbatch import spans

    # budget 8: 5+3 fit; 4 then 9 would not; 9 alone is over budget and runs alone; 2 is left
    assert spans([5, 3, 4, 9, 2], size=2, max_tokens=8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert spans([5, 3, 4, 9, 2], size=2) == [(0, 2), (2, 4), (4, 5)]
    assert spans([], size=2, max_tokens=8) == []


@pytest.mark.parametrize("remove_padding", [True, False])
def test_token_budget_micro_batches_cover_every_row_once_within_the_budget(remove_padding):
    from posttrain.training.microbatch import micro_batches

    b = make_batch()  # real tokens (prompt + response) per row: 5, 4, 6, 4
    parts = micro_batches(b, 1, remove_padding, max_tokens=9)
    rows = sorted(int(r) for idx, _ in parts for r in idx)
    assert rows == [0, 1, 2, 3]
    real = b.attention_mask.sum(-1)
    for idx, mb in parts:
        assert len(idx) == 1 or int(real[idx].sum()) <= 9
        assert int(mb.attention_mask.sum()) == int(real[idx].sum())  # trimming drops padding only
    assert len(parts) < 4  # the budget packs rows together


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("remove_padding", [True, False])
def test_token_budget_micro_batches_give_the_fixed_count_loss_and_gradient(random_qwen2, mode, remove_padding):
    """actor.use_dynamic_bsz: micro-batches cut by a token budget (here 1 to 3
    rows each) give the loss, the gradient and the log-probs of micro-batches of
    a fixed count (here the whole mini-batch at once), for every loss_agg_mode."""
    b = make_batch()
    b.response_mask = b.response_mask.clone()
    b.response_mask[3] = 0  # an empty response
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 4)
    lp_budget, _ = compute_log_probs(random_qwen2, b, 4, max_tokens=9)
    mask = b.response_mask.bool()  # outside it a trimmed micro-batch leaves 0
    torch.testing.assert_close(lp_budget[mask], b.old_log_probs[mask], atol=1e-6, rtol=1e-5)
    b.old_log_probs = b.old_log_probs + 0.05
    b.advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, 3) * b.response_mask
    grads, losses = [], []
    for budget in (None, 9):
        model = copy.deepcopy(random_qwen2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        m = update_policy(model, opt, b, UpdateSettings(mini_batch_size=4, micro_batch_size=4, loss_agg_mode=mode,
                                                        grad_clip=1e9, remove_padding=remove_padding,
                                                        micro_max_tokens=budget))
        losses.append(m["actor/loss"])
        grads.append(torch.cat([(p0 - p.detach()).flatten() for p0, p in zip(before, model.parameters())]))
    assert grads[0].abs().sum() > 0
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
