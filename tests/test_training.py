import copy

import pytest
import torch

from posttrain.batch import RolloutBatch
from posttrain.loop import place_on_last_token
from posttrain.rollout.base import RolloutOutput
from posttrain.training.actor import UpdateSettings, make_optimizer, micro_weight, update_policy
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


# ---------------------------------------------------------------- token-budget micro-batches (use_dynamic_bsz)

def test_spans_fill_a_token_budget_and_a_longer_row_runs_alone():
    from posttrain.training.logprobs import spans

    # budget 8: 5+3 fit; 4 then 9 would not; 9 alone is over budget and runs alone; 2 is left
    assert spans([5, 3, 4, 9, 2], size=2, max_tokens=8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert spans([5, 3, 4, 9, 2], size=2) == [(0, 2), (2, 4), (4, 5)]
    assert spans([], size=2, max_tokens=8) == []


@pytest.mark.parametrize("remove_padding", [True, False])
def test_token_budget_micro_batches_cover_every_row_once_within_the_budget(remove_padding):
    from posttrain.training.logprobs import micro_batches

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
