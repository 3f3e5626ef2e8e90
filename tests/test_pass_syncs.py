"""The critic's passes, the teacher's top-k pass, rollout correction's metrics and explained variance wait for
the device at most once per micro-batch (HostSyncs counts on the CPU what would stall a GPU), with their
results checked against the code they replace, reimplemented here."""

import math

import pytest
import torch

from posttrain.algorithms.critic import explained_variance
from posttrain.runtime.syncs import HostSyncs


def old_explained_variance(values, returns, mask):
    """explained_variance as it was: the valid tokens selected, torch.var, a count read."""
    m = mask.bool()
    if int(m.sum()) < 2:
        return torch.zeros(())
    r, v = returns[m].float(), values[m].float()
    return 1.0 - (r - v).var() / (r.var() + 1e-5)


def test_explained_variance_reads_nothing_and_matches_the_selected_tokens_variance():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        returns, values = torch.randn(6, 9, generator=g) * 3, torch.randn(6, 9, generator=g)
        mask = (torch.rand(6, 9, generator=g) < 0.6).int()
        with HostSyncs() as syncs:
            ev = explained_variance(values, returns, mask)
        assert syncs.count == 0
        # masked sums round differently from torch.var over the selection: the ratio of variances within a
        # few float32 ulps (measured: 2.2e-7 at most, absolute)
        torch.testing.assert_close(ev, old_explained_variance(values, returns, mask), rtol=3e-7, atol=3e-7)
    one = torch.tensor([[0, 1, 0]])
    with HostSyncs() as syncs:
        assert explained_variance(torch.ones(1, 3), torch.zeros(1, 3), one).item() == 0.0  # one token: 0
    assert syncs.count == 1  # .item() alone


def tiny_qwen2(head: str):
    """A random 2-layer Qwen2 (40-token vocabulary): "lm", or "value" (a scalar head on every position)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1,
                      pad_token_id=0, bos_token_id=None, num_labels=1, classifier_dropout=0.0)  # as load_value_model
    return (Qwen2ForCausalLM if head == "lm" else Qwen2ForTokenClassification)(cfg).eval()


def old_values(model, batch, size):
    """compute_values as it was: each field moved on its own, transformers' mask, a copy back per micro-batch."""
    from posttrain.training.critic import response_values
    from posttrain.training.microbatch import micro_batches

    values = torch.zeros(batch.responses.shape)
    with torch.no_grad():
        for rows, mb in micro_batches(batch, size, True):
            v = response_values(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_length)
            values[rows, :mb.response_length] = v.cpu() * mb.response_mask
    return values


def test_the_value_pass_and_the_critic_update_read_nothing_per_micro_batch(monkeypatch):
    import copy

    from test_update_syncs import synthetic_batch

    from posttrain.training import critic
    from posttrain.training.microbatch import micro_batches

    model = tiny_qwen2("value")
    b = synthetic_batch(n_prompts=8, n=4)  # 32 rows: 4 micro-batches of 8
    for _, mb in micro_batches(b, 8, True):  # the plan knows where the whole width holds padding
        assert mb.layout.padded_all == bool((mb.attention_mask == 0).any())
    with HostSyncs() as syncs:
        values = critic.compute_values(model, b, 8)
    assert syncs.count == 2, dict(syncs.by_op)  # the plan's read of the batch and its prompts' unique
    assert torch.equal(values, old_values(model, b, 8))
    b.values, b.returns = values, values + torch.randn(values.shape) * b.response_mask
    s = critic.CriticSettings(mini_batch_size=16, micro_batch_size=8, ppo_epochs=2)
    runs = []
    for planned in (True, False):
        if not planned:  # the mask as transformers builds it, reading it back
            monkeypatch.setattr(critic, "planned_mask", lambda model, mask, padded, cached: mask)
        m = copy.deepcopy(model)
        with HostSyncs() as syncs:
            metrics = critic.update_critic(m, torch.optim.SGD(m.parameters(), lr=1e-2), b, s)
        runs.append((m, metrics, syncs.count))
    (new, m_new, n_new), (old, m_old, n_old) = runs
    # the plan's 2, one read per optimizer step (4), the metrics' one read; transformers' mask read 2 a micro-batch
    assert (n_new, n_old) == (7, 7 + 2 * 8)
    assert any(not torch.equal(p, q) for p, q in zip(new.parameters(), model.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(new.parameters(), old.parameters())) and m_new == m_old


class CopiesBack(torch.overrides.TorchFunctionMode):
    """Counts `.cpu()` calls: copies to host memory, which HostSyncs leaves out (no operation on the CPU),
    each a wait for the device on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.Tensor.cpu
        return func(*args, **(kwargs or {}))


def test_the_teachers_top_k_pass_copies_back_once_with_the_same_results():
    from test_update_syncs import synthetic_batch

    from posttrain.training.logprobs import PassOptions, _response_log_p, compute_topk_log_probs
    from posttrain.training.microbatch import micro_batches

    model, k = tiny_qwen2("lm"), 5
    b = synthetic_batch(n_prompts=8, n=4)
    old = (torch.zeros(b.responses.shape), torch.zeros((*b.responses.shape, k)),
           torch.zeros((*b.responses.shape, k), dtype=torch.int32))
    with torch.no_grad():  # as it was: three copies back per micro-batch
        for rows, mb in micro_batches(b, 8, True):
            log_p = _response_log_p(model, mb, "cpu", 0.7, PassOptions())
            w = mb.response_length
            old[0][rows, :w] = log_p.gather(-1, mb.responses.unsqueeze(-1)).squeeze(-1).cpu()
            values, ids = log_p.topk(k, dim=-1)
            old[1][rows, :w], old[2][rows, :w] = values.cpu(), ids.to(torch.int32).cpu()
    with HostSyncs() as syncs, CopiesBack() as copies:
        new = compute_topk_log_probs(model, b, k, 8, temperature=0.7)
    assert syncs.count == 2 and copies.count == 3  # the plan's two reads; each output copied back once
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(new, old))


def old_ratio_stats(prefix, ratio, per_sequence, valid, has, lower, upper):
    """rollout_corr._ratio_stats as it was: boolean selections, each value read."""
    def log(x):
        return math.log(x) if x > 0 else -math.inf

    w = ratio[valid]
    out = {f"{prefix}_mean": float(w.mean())}
    if per_sequence is None:
        high, low = (w > upper).float().mean(), (w < lower).float().mean()
        out[f"{prefix}_max"], out[f"{prefix}_min"] = float(w.max()), float(w.min())
    else:
        s = per_sequence[has]
        high, low = (s > log(upper)).float().mean(), (s < log(lower)).float().mean()
        out[f"{prefix}_max"], out[f"{prefix}_min"] = math.exp(min(float(s.max()), 20.0)), math.exp(float(s.min()))
    out[f"{prefix}_ratio_fraction_high"], out[f"{prefix}_ratio_fraction_low"] = float(high), float(low)
    clamped = w.clamp(min=lower, max=upper)
    mean = clamped.mean()
    out[f"{prefix}_std"] = float((clamped.square().mean() - mean.square()).clamp(min=0).sqrt()) \
        if w.numel() > 1 else 0.0
    out[f"{prefix}_eff_sample_size"] = float(1.0 / (clamped / (mean + 1e-8)).square().mean())
    return out


def old_metrics(target, behaviour, mask, c):
    """correct's and mismatch_metrics' metrics as they were computed, for `c`'s settings used below (sequence
    IS weights batch-normalized, token rejection, one token and one sequence rule, a veto)."""
    from posttrain.algorithms.rollout_corr import _ratios

    valid, has = mask.bool(), mask.bool().any(-1)
    log_ratio = torch.where(valid, target - behaviour, 0.0)
    m = {}
    ratio, per_sequence = _ratios(log_ratio, valid, c.is_level)
    m.update(old_ratio_stats("rollout_is", ratio, per_sequence, valid, has, *c.is_bounds()))
    weights = torch.where(valid, ratio.clamp(max=c.is_threshold), 0.0)
    m["rollout_is_batch_norm_factor"] = float((weights.sum(-1)[has] / valid.sum(-1)[has]).mean())
    ratio, _ = _ratios(log_ratio, valid, c.rs_level)
    lower, upper = c.rs_bounds()
    m.update(old_ratio_stats("rollout_rs", ratio, None, valid, has, lower, upper))
    by_band = valid & ~((ratio >= lower) & (ratio <= upper))
    rejected = by_band.clone()
    x = log_ratio.clamp(-20, 20)

    def shares(prefix, r):
        return {f"{prefix}_masked_fraction": float(r[valid].float().mean()),
                f"{prefix}_seq_masked_fraction": float(r.any(-1)[has].float().mean())}

    m.update(shares("rollout_rs_token", by_band))
    token_k2, seq_mean_k3 = 0.5 * x.square(), (x.exp() - 1 - x).sum(-1) / valid.sum(-1).clamp(min=1)
    r = valid & ~(token_k2 <= c.rs_rules[0].upper)
    m.update(shares("rollout_rs_token_k2", r))
    m["rollout_rs_token_k2_mean"], m["rollout_rs_token_k2_max"] = float(token_k2[valid].mean()), \
        float(token_k2[valid].max())
    rejected |= r
    stat = seq_mean_k3.unsqueeze(-1).expand_as(x)
    r = valid & ~(stat <= c.rs_rules[1].upper)
    m.update(shares("rollout_rs_seq_mean_k3", r))
    m["rollout_rs_seq_mean_k3_mean"] = float(stat[valid].mean())
    m["rollout_rs_seq_mean_k3_max"], m["rollout_rs_seq_mean_k3_seq_mean"] = float(stat[:, 0][has].max()), \
        float(stat[:, 0][has].mean())
    rejected |= r
    m.update(shares("rollout_rs", rejected))
    catastrophic = valid & (log_ratio < math.log(c.token_veto_threshold))
    m["rollout_is_veto_fraction"] = float(catastrophic.any(-1)[has].float().mean())
    m["rollout_is_catastrophic_token_fraction"] = float(catastrophic[valid].float().mean())
    m = {f"rollout_corr/{k}": v for k, v in m.items()}
    d, p_diff = (behaviour - target)[valid], (behaviour.exp() - target.exp()).abs()[valid]
    lengths = mask.sum(-1).clamp(min=1)
    train_ppl, roll_ppl = -(target * mask).sum(-1)[has] / lengths[has], -(behaviour * mask).sum(-1)[has] / lengths[has]
    m.update({"training/rollout_probs_diff_mean": float(p_diff.mean()),
              "training/rollout_probs_diff_max": float(p_diff.max()),
              "training/rollout_probs_diff_std": float(p_diff.std()),
              "rollout_corr/logp_abs_diff_mean": float(d.abs().mean()),
              "rollout_corr/logp_abs_diff_max": float(d.abs().max()), "rollout_corr/kl": float(d.mean()),
              "rollout_corr/k3_kl": float(((-d).exp() - 1 + d).mean()),
              "rollout_corr/rollout_ppl": float(roll_ppl.exp().mean()),
              "rollout_corr/training_ppl": float(train_ppl.exp().mean()),
              "rollout_corr/log_ppl_diff": float((roll_ppl - train_ppl).mean())})
    return m


def test_rollout_corrections_metrics_stay_on_the_device_with_the_old_values():
    from posttrain.algorithms.rollout_corr import RolloutCorrection, correct, mismatch_metrics
    from posttrain.algorithms.rollout_rules import RejectRule

    g = torch.Generator().manual_seed(0)
    target = -torch.rand(6, 10, generator=g) * 3
    behaviour = target + torch.randn(6, 10, generator=g) * 0.4
    mask = (torch.rand(6, 10, generator=g) < 0.7).long()
    mask[2] = 0  # a row without a valid token counts nowhere
    c = RolloutCorrection(is_level="sequence", is_threshold=3.0, is_batch_normalize=True, rs_level="token",
                          rs_threshold=2.0, token_veto_threshold=0.5,
                          rs_rules=(RejectRule("token_k2", None, 0.1), RejectRule("seq_mean_k3", None, 0.05)))
    counts = (int(mask.sum()), int((mask.sum(-1) > 0).sum()))  # what the micro-batch's plan knows
    with HostSyncs() as syncs:
        w, kept, m = correct(target, behaviour, mask, c, counts, on_device=True)
        m.update(mismatch_metrics(target, behaviour, mask, counts, on_device=True))
    assert syncs.count == 0, dict(syncs.by_op)
    assert all(isinstance(v, torch.Tensor) or v == 0.0 for v in m.values())
    with HostSyncs() as syncs:  # the driver's way: floats, the counts and the metrics read once each
        _, kept_read, read = correct(target, behaviour, mask, c)
    assert syncs.count == 2 and torch.equal(kept_read, kept)
    old = old_metrics(target, behaviour, mask, c)
    values = {k: float(v) for k, v in m.items()}
    assert values.keys() == old.keys() and 0 < old["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert 0 < old["rollout_corr/rollout_is_veto_fraction"] < 1
    for key in old:
        if key.endswith(("rollout_is_max", "rollout_is_min")):  # exp on the device, was math.exp: 1 ulp at most
            assert values[key] == pytest.approx(old[key], rel=2 * 2 ** -52, abs=0), key
        else:  # the same elements in the same order: bitwise
            assert values[key] == old[key], key
    assert all(read[k] == values[k] for k in read)
    factor = old["rollout_corr/rollout_is_batch_norm_factor"]
    plain = torch.where(mask.bool(), torch.exp((torch.where(mask.bool(), target - behaviour, 0.0)).sum(-1,
                        keepdim=True).clamp(-20, 20)).clamp(max=3.0), 0.0)
    assert torch.equal(w, plain / torch.tensor(factor, dtype=torch.float32))


def test_a_bypass_mode_update_reads_nothing_per_micro_batch(monkeypatch):
    import copy

    from test_update_syncs import synthetic_batch

    from posttrain.algorithms.rollout_corr import RolloutCorrection
    from posttrain.training import actor
    from posttrain.training.logprobs import compute_log_probs

    model = tiny_qwen2("lm")
    b = synthetic_batch(n_prompts=8, n=4)  # 32 rows: 2 mini-batches of 2 micro-batches, 2 epochs
    lp, _ = compute_log_probs(model, b, 8)
    noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    b.old_log_probs = b.rollout_log_probs = lp + 0.3 * noise * b.response_mask  # the engine's, somewhat off
    c = RolloutCorrection(is_level="token", is_threshold=1.5, rs_level="token", rs_threshold=1.6)
    s = actor.UpdateSettings(mini_batch_size=16, micro_batch_size=8, ppo_epochs=2, loss_mode="gpg",
                             bypass_correction=c)
    runs = []
    for planned in (True, False):
        if not planned:  # as it was: no counts, each micro-batch's metrics read as floats
            def positional(f, n):  # the first n arguments: no counts, metrics read as floats
                return lambda *args, **kwargs: f(*args[:n])

            monkeypatch.setattr(actor, "correct", positional(actor.correct, 4))
            monkeypatch.setattr(actor, "mismatch_metrics", positional(actor.mismatch_metrics, 3))
        m = copy.deepcopy(model)
        with HostSyncs() as syncs:
            metrics = actor.update_policy(m, torch.optim.SGD(m.parameters(), lr=1e-2), b, s)
        runs.append((m, metrics, syncs.count))
    (new, m_new, n_new), (old, m_old, n_old) = runs
    assert n_new == 7 and n_old > 7 + 8 * 2, (n_new, n_old)  # the plan's 2, 4 steps, the metrics' 1
    assert 0 < m_new["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert any(not torch.equal(p, q) for p, q in zip(new.parameters(), model.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(new.parameters(), old.parameters())) and m_new == m_old


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (a GPU's own count of synchronizing operations)")
def test_on_a_gpu_the_passes_wait_at_most_once_per_micro_batch():
    """torch.cuda's sync debug mode warns at each operation that waits for the device: the value and top-k
    passes over 4 micro-batches wait once, to copy their results back (not yet run on a GPU)."""
    import warnings

    from test_update_syncs import synthetic_batch

    from posttrain.training.critic import compute_values
    from posttrain.training.logprobs import compute_topk_log_probs

    b = synthetic_batch(n_prompts=8, n=4)
    critic, lm = tiny_qwen2("value").cuda(), tiny_qwen2("lm").cuda()
    compute_values(critic, b, 8), compute_topk_log_probs(lm, b, 5, 8)  # warm-up: lazy initialisations
    counts = []
    for run in (lambda: compute_values(critic, b, 8), lambda: compute_topk_log_probs(lm, b, 5, 8)):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in seen))
    assert counts[0] <= 1 and counts[1] <= 3, counts  # each output's copy back
