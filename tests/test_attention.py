"""posttrain_sdpa (models/attention.py) computes SDPA's attention: against
torch's fused kernel on hand-made masks, forward and backward, and inside a
model, generation and the training passes included."""

import copy

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import attention
from posttrain.models.attention import grouped_attention, use_grouped_attention
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine


class Module(torch.nn.Module):
    is_causal = True


def reference(q, k, v, mask, causal=False):
    """torch's SDPA with each key/value head repeated for its query heads -> [B, Lq, H, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).transpose(1, 2)


def qkv(b, h, kvh, lq, lk, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
            for shape in ((b, h, lq, d), (b, kvh, lk, d), (b, kvh, lk, d))]


def left_padded_causal(lengths, lq, lk):
    """bool [B, 1, Lq, Lk]: queries are the last Lq of Lk positions, row i's
    first Lk - lengths[i] keys are padding."""
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    keys = torch.arange(lk)[None, :] >= (lk - torch.tensor(lengths))[:, None]  # [B, Lk]
    return (causal[None] & keys[:, None, :])[:, None]


@pytest.mark.parametrize("lq", [1, 3, 6])
def test_equals_sdpa_forward_and_backward_with_a_padding_mask(lq):
    q, k, v = qkv(3, 4, 2, lq, 6)
    mask = left_padded_causal([6, 4, 2], lq, 6)
    ours, none = grouped_attention(Module(), q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    assert none is None and ours.shape == (3, lq, 4, 8)
    want = reference(q, k, v, mask)
    # a left-padding query may have no key to attend (lq > 1): its output is never used, and differs
    real = mask.any(-1).transpose(1, 2)[..., None]  # [B, Lq, 1, 1]
    assert (lq == 1) == bool(real.all())
    torch.testing.assert_close(ours * real, want * real, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(want) * real
    got_grads = torch.autograd.grad(ours, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for got, w in zip(got_grads, want_grads):
        torch.testing.assert_close(got, w, atol=1e-12, rtol=1e-12)


def test_no_mask_is_causal_when_queries_are_many_and_full_when_one():
    q, k, v = qkv(2, 4, 1, 5, 5)
    ours, _ = grouped_attention(Module(), q, k, v, None)
    torch.testing.assert_close(ours, reference(q, k, v, None, causal=True), atol=1e-12, rtol=1e-12)
    q1 = q[:, :, -1:]
    ours, _ = grouped_attention(Module(), q1, k, v, None)
    torch.testing.assert_close(ours, reference(q1, k, v, None), atol=1e-12, rtol=1e-12)
    # not causal (an encoder's module): every key for every query
    module = Module()
    module.is_causal = False
    ours, _ = grouped_attention(module, q, k, v, None)
    torch.testing.assert_close(ours, reference(q, k, v, None), atol=1e-12, rtol=1e-12)


def test_an_additive_float_mask_is_added():
    q, k, v = qkv(2, 2, 2, 3, 4)
    bias = torch.tensor([[0.0, -1.0, 2.0, float("-inf")]] * 3, dtype=torch.float64)[None, None].expand(2, 1, 3, 4)
    ours, _ = grouped_attention(Module(), q, k, v, bias)
    torch.testing.assert_close(ours, reference(q, k, v, bias), atol=1e-12, rtol=1e-12)


def test_a_query_with_no_key_to_attend_stays_finite():
    q, k, v = qkv(1, 2, 1, 2, 3)
    mask = torch.tensor([[False, False, False], [True, True, False]])[None, None]
    ours, _ = grouped_attention(Module(), q, k, v, mask)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[:, 1], reference(q, k, v, mask)[:, 1], atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(ours.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_large_or_non_cpu_calls_go_to_transformers_sdpa(monkeypatch):
    from transformers.integrations import sdpa_attention

    calls = []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = qkv(1, 2, 1, 3, 3)
    grouped_attention(Module(), q, k, v, None)
    assert calls == []
    monkeypatch.setattr(attention, "MAX_SCORES", 1 * 2 * 3 * 3 - 1)
    ours, _ = grouped_attention(Module(), q, k, v, None)
    assert calls == [1]
    torch.testing.assert_close(ours, reference(q, k, v, None, causal=True), atol=1e-12, rtol=1e-12)


def pair(model):
    """The model on transformers' SDPA and a copy switched to posttrain_sdpa."""
    fast = copy.deepcopy(model)
    assert model.config._attn_implementation == "sdpa" and use_grouped_attention(fast)
    assert fast.config._attn_implementation == attention.NAME
    return model, fast


def test_a_model_gives_the_same_logits_and_gradients(random_qwen2):
    sdpa, fast = pair(random_qwen2.double())
    ids = torch.randint(2, 40, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    outs = [m(input_ids=ids, attention_mask=mask, position_ids=pos).logits for m in (sdpa, fast)]
    keep = mask.bool()
    torch.testing.assert_close(outs[1][keep], outs[0][keep], atol=1e-10, rtol=1e-10)
    grads = [torch.autograd.grad(o[keep].square().sum(), list(m.parameters())) for o, m in zip(outs, (sdpa, fast))]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-9)


def test_generation_samples_the_same_tokens(random_qwen2):
    sdpa, fast = pair(random_qwen2.double())
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    params = SamplingParams(max_new_tokens=10, n=3, logprobs=True)
    outs = [HFRolloutEngine(m, [3, 7], pad_token_id=0, seed=4, progress=False).generate(prompts, params)
            for m in (sdpa, fast)]
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.equal(outs[0].response_mask, outs[1].response_mask)


def test_models_on_other_attention_keep_it():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg)
    assert not use_grouped_attention(model) and model.config._attn_implementation == "eager"


def test_the_loader_switches_unless_told_not_to(tiny_model_dir):
    from posttrain.models import load_model

    assert load_model(tiny_model_dir).config._attn_implementation == attention.NAME
    assert load_model(tiny_model_dir, small_attention=False).config._attn_implementation == "sdpa"


def test_shared_prompt_log_probs_are_the_same(random_qwen2):
    from posttrain.driver.batch import RolloutBatch
    from posttrain.training.logprobs import PassOptions, compute_log_probs

    sdpa, fast = pair(random_qwen2.double())
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    out = HFRolloutEngine(sdpa, [3, 7], pad_token_id=0, seed=1, progress=False).generate(
        prompts, SamplingParams(max_new_tokens=8, n=3))
    batch = RolloutBatch.from_rollout(out, 3, ["a"] * 3, ["x"] * 3, [{}] * 3, [""] * 9)
    mask = batch.response_mask.bool()
    options = PassOptions(remove_padding=True, share_prompt=True)
    (a, ent_a), (b, ent_b) = (compute_log_probs(m, batch, 4, with_entropy=True, options=options) for m in (sdpa, fast))
    torch.testing.assert_close(b[mask], a[mask], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent_b[mask], ent_a[mask], atol=1e-10, rtol=1e-10)
