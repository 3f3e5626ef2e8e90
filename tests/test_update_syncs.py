"""The actor update and the log-prob passes wait for the device at most once per micro-batch, with the
arithmetic unchanged.

Host syncs are counted on the CPU with runtime.syncs.HostSyncs (what would stall a GPU). The update is
checked bitwise against a plain reimplementation, here, of the loop it replaces: micro-batches cut and trimmed
by reading the batch's tensors (reference_passes.length_order, trim_padding), shared prompts found on the device
(forward.py without a plan), loss weights from actor.loss_units, metrics summed as Python floats.
"""

import copy

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.runtime.syncs import HostSyncs
from posttrain.training import forward
from posttrain.training.actor import UpdateSettings, loss_units, make_optimizer, micro_loss, pinned_loss_scale, \
    update_policy
from posttrain.training.logprobs import PassOptions, compute_log_probs, gathered_log_probs, token_log_probs
from posttrain.training.microbatch import micro_batches, row_stats
from posttrain.training.tally import Tally

from reference_passes import length_order, trim_padding


def synthetic_batch(n_prompts=16, n=4, prompt_width=12, response_width=16, vocab=40, pad=0, seed=0,
                    same_prompt=True) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of random lengths, n samples per prompt; with
    `same_prompt` groups 0 and 1 hold the same prompt (adjacent once ordered: runs of unequal sizes)."""
    g = torch.Generator().manual_seed(seed)
    rows = n_prompts * n
    ids = torch.full((rows, prompt_width + response_width), pad)
    mask = torch.zeros_like(ids)
    response_mask = torch.zeros((rows, response_width), dtype=torch.long)
    prompts = []
    for p in range(n_prompts):
        length = int(torch.randint(2, prompt_width + 1, (1,), generator=g))
        prompts.append(prompts[0] if same_prompt and p == 1 else torch.randint(1, vocab, (length,), generator=g))
        prompt = prompts[-1]
        for j in range(n):
            i = p * n + j
            ids[i, prompt_width - len(prompt):prompt_width], mask[i, prompt_width - len(prompt):prompt_width] = prompt, 1
            r = int(torch.randint(1, response_width + 1, (1,), generator=g))
            ids[i, prompt_width:prompt_width + r] = torch.randint(1, vocab, (r,), generator=g)
            mask[i, prompt_width:prompt_width + r] = 1
            response_mask[i, :r] = 1
    b = RolloutBatch(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                     responses=ids[:, prompt_width:].clone(), response_mask=response_mask,
                     group=torch.arange(rows) // n, data_source=["d"] * rows)
    b.advantages = torch.randn(rows, 1, generator=g) * response_mask
    return b


def with_log_probs(model, b: RolloutBatch) -> RolloutBatch:
    lp, _ = compute_log_probs(model, b, 8)
    b.old_log_probs = lp + 0.05 * b.response_mask  # a little off-policy: clipping is exercised
    b.ref_log_probs = lp - 0.1 * b.response_mask
    return b


def reference_update(model, optimizer, batch, s: UpdateSettings) -> dict[str, float]:
    """run_updates as it was: every read on the batch's tensors, metrics as Python floats."""
    s = pinned_loss_scale(s, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    sums, losses, norms, counted = {}, [], [], 0
    for _ in range(s.ppo_epochs):
        for mini in batch.split(s.mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            total = loss_units(mini.response_mask, s.loss_agg_mode)
            counted += total > 0
            order = length_order(mini) if s.remove_padding else torch.arange(len(mini))
            ordered = mini.select(order)
            mini_loss = 0.0
            for mb in ordered.split(s.micro_batch_size):
                mb = trim_padding(mb) if s.remove_padding else mb
                w = loss_units(mb.response_mask, s.loss_agg_mode) / total
                loss, m = micro_loss(model, mb, s, "cpu")  # a plain batch: no plan, groups found on the device
                (loss * w).backward()
                mini_loss += float(loss.detach()) * w
                for key, v in m.items():
                    sums[key] = sums.get(key, 0.0) + float(v) * w
            norm = float(torch.nn.utils.clip_grad_norm_(params, s.grad_clip))
            optimizer.step()
            norms.append(norm)
            losses.append(mini_loss)
    out = {k: v / counted for k, v in sums.items()}
    out["actor/loss"], out["actor/grad_norm"] = sum(losses) / len(losses), sum(norms) / len(norms)
    return out


@pytest.mark.parametrize("remove_padding,share_prompt,micro,mode", [
    (True, True, 4, "token-mean"), (True, True, 9, "seq-mean-token-mean"), (False, True, 9, "token-mean"),
    (True, False, 6, "seq-mean-token-sum-norm")])
def test_the_update_is_bitwise_the_plain_loop(random_qwen2, remove_padding, share_prompt, micro, mode):
    b = with_log_probs(random_qwen2, synthetic_batch(n_prompts=8, n=3))
    s = UpdateSettings(mini_batch_size=12, micro_batch_size=micro, ppo_epochs=2, use_kl_loss=True,
                       loss_agg_mode=mode, remove_padding=remove_padding, share_prompt=share_prompt, grad_clip=0.5)
    runs = []
    for update in (update_policy, reference_update):
        model = copy.deepcopy(random_qwen2)
        optimizer = make_optimizer(model, 1e-2, 0.01, (0.9, 0.999))
        runs.append((model, update(model, optimizer, b, s)))
    (new, m_new), (old, m_old) = runs
    assert any(not torch.equal(p, q) for p, q in zip(new.parameters(), random_qwen2.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(new.parameters(), old.parameters()))
    for key, value in m_old.items():  # the same float64 sums in the same order: equal, no tolerance
        assert m_new[key] == value, key


def test_the_plan_cuts_trims_and_groups_as_the_reads_did():
    b = synthetic_batch(n_prompts=8, n=3)
    for size in (4, 9):
        order = length_order(b)
        ordered = b.select(order)
        for k, ((rows, mb), plain) in enumerate(zip(micro_batches(b, size, True), ordered.split(size))):
            plain = trim_padding(plain)
            assert torch.equal(rows, order[k * size:(k + 1) * size])
            for name in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages"):
                assert torch.equal(getattr(mb, name), getattr(plain, name)), name
            assert mb.data_source == plain.data_source
            width = plain.prompt_width
            assert mb.layout.padded == bool((plain.attention_mask[:, :-1] == 0).any())
            found = forward._distinct_prompts(plain.input_ids[:, :width], plain.attention_mask[:, :width])
            if found is None:
                assert mb.layout.prompts is None
                continue
            inverse, first, blocks, count = found
            planned = mb.layout.prompts
            assert torch.equal(planned.inverse, inverse) and planned.blocks == blocks and planned.count == count
            assert torch.equal(planned.first, first)
            assert mb.layout.padded_prompts == bool((plain.attention_mask[first, :width] == 0).any())
    assert any(not mb.layout.prompts.blocks for _, mb in micro_batches(b, 9, True) if mb.layout.prompts)


def test_padding_of_several_ids_leaves_the_shared_prompts_to_the_pass():
    b = synthetic_batch(n_prompts=4, n=2)
    assert row_stats(b).key is not None
    row = int((b.attention_mask[:, 0] == 0).nonzero()[0, 0])
    b.input_ids[row, 0] = 7  # a padding position (mask 0) with another id than the others'
    assert row_stats(b).key is None
    assert all(mb.layout is None for _, mb in micro_batches(b, 4, True))


def test_the_planned_mask_is_the_one_transformers_builds(random_qwen2):
    from transformers.masking_utils import create_causal_mask

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    built = forward.planned_mask(random_qwen2, mask, padded=True, cached=False)
    embeds = torch.zeros(3, 4, random_qwen2.config.hidden_size)
    want = create_causal_mask(random_qwen2.config, embeds, mask, None, position_ids=None)
    assert built.dim() == 4 and torch.equal(built, want)
    assert forward.planned_mask(random_qwen2, torch.ones(3, 4), padded=False, cached=True) is None
    eager = copy.deepcopy(random_qwen2)
    eager.config._attn_implementation = "eager"
    assert forward.planned_mask(eager, mask, padded=True, cached=False) is mask  # not its masks: unchanged


def test_gathered_log_probs_equal_the_log_softmax_ones(monkeypatch):
    torch.manual_seed(0)
    logits, tokens = 4 * torch.randn(3, 5, 50), torch.randint(0, 50, (3, 5))
    whole = gathered_log_probs(logits, tokens)
    # float32 rounding: a different order of the same operations, 2 ulps of log-probs around -20
    torch.testing.assert_close(whole, token_log_probs(logits, tokens), atol=1e-6, rtol=2.4e-7)
    monkeypatch.setattr("posttrain.training.logprobs.LOGSUMEXP_ELEMENTS", 100)  # two positions a piece
    assert torch.equal(gathered_log_probs(logits, tokens), whole)


def test_metrics_summed_on_the_device_equal_the_python_sums():
    torch.manual_seed(0)
    values, weights = torch.randn(7), torch.rand(7).tolist()
    tally, plain = Tally(), 0.0
    for v, w in zip(values, weights):
        tally.add({"m": v, "c": 0.5}, w)
        plain += float(v) * w
    with HostSyncs() as syncs:
        read = tally.read()
    assert read["m"] == plain and read["c"] == pytest.approx(0.5 * sum(weights)) and syncs.count == 1


@pytest.fixture(scope="module")
def embedded():
    from posttrain.models import load_model
    from posttrain.models.shipped import embedded_model

    return load_model(embedded_model())


@pytest.mark.parametrize("share_prompt", [True, False])
def test_an_update_and_a_log_prob_pass_wait_at_most_once_per_micro_batch(embedded, share_prompt):
    """64 sequences in micro-batches of 8, two optimizer steps (the optimizer's own reads aside: SGD keeps no
    step counter; AdamW's are CPU tensors, read on the host)."""
    b = synthetic_batch(n_prompts=16, n=4, prompt_width=20, response_width=24, vocab=250, pad=256)
    options = PassOptions(remove_padding=True, share_prompt=share_prompt)
    with HostSyncs() as syncs:
        lp, _ = compute_log_probs(embedded, b, 8, options=options)
    assert syncs.count <= 8, dict(syncs.by_op)
    b.old_log_probs, b.ref_log_probs = lp + 0.01 * b.response_mask, lp - 0.05 * b.response_mask
    model = copy.deepcopy(embedded)
    s = UpdateSettings(mini_batch_size=32, micro_batch_size=8, use_kl_loss=True, share_prompt=share_prompt)
    with HostSyncs() as syncs:
        metrics = update_policy(model, torch.optim.SGD(model.parameters(), lr=1e-3), b, s)
    assert syncs.count <= 8, dict(syncs.by_op)
    assert metrics["actor/nonfinite_updates"] == 0.0 and metrics["actor/kl_loss"] > 0


def test_workers_agree_on_a_step_in_the_same_one_read(tmp_path):
    import torch.distributed as dist

    from posttrain.training.tally import step_values

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        with HostSyncs() as syncs:
            ok, loss, norm = step_values(torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0), world_size=2)
        assert ok and (loss, norm) == (2.0, 3.0) and syncs.count == 1
        assert not step_values(torch.tensor(float("inf")), torch.tensor(1.0), world_size=2)[0]
        assert not step_values(torch.tensor(1.0), torch.tensor(float("nan")), world_size=2)[0]
    finally:
        dist.destroy_process_group()
