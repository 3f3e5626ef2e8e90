"""The critic's passes, the teacher's top-k pass, rollout correction's metrics and explained variance wait for
the device at most once per micro-batch (HostSyncs counts on the CPU what would stall a GPU), with their
results checked against the code they replace, reimplemented here."""

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
