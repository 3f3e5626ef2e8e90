"""The fast paths change no result: each is checked against its switched-off twin.

Generation is compared exactly (same seed, same tokens) in float64, where a
batch of p prompts and one of p*n rows cannot round differently enough to
move a sampled token across a CDF boundary. The log-prob and training passes
change the order of float operations (a shared prompt's attention is split
in two calls, micro-batches are reordered), so they are compared to 1e-5.
"""

import copy
import math

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout.sampling import sample_next
from posttrain.training.actor import UpdateSettings, update_policy
from posttrain.training.logprobs import PassOptions, compute_log_probs

from helpers import run_overrides, write_prompts
from reference_passes import length_order, trim_padding

# different lengths, so prompts are left-padded and chunks differ
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24, 25, 26], [27]]
EOS = [3, 7, 9]  # common enough in a random 40-token model that rows end at different steps
OFF = dict(shared_prefill=False, remove_padding=False, early_stop=False)


@pytest.fixture
def model64(random_qwen2):
    return copy.deepcopy(random_qwen2).double()


def generate(model, params, seed=5, micro_batch_size=None, **flags):
    engine = HFRolloutEngine(model, EOS, pad_token_id=0, micro_batch_size=micro_batch_size, seed=seed,
                             progress=False, **flags)
    return engine.generate(PROMPTS, params)


def same_samples(a, b) -> None:
    """Equal responses, masks and prompts; a wider batch may only add padding."""
    width = a.response_ids.shape[1]
    assert b.response_ids.shape[1] >= width
    assert torch.equal(a.response_ids, b.response_ids[:, :width])
    assert torch.equal(a.response_mask, b.response_mask[:, :width])
    assert not b.response_mask[:, width:].any()
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)


def test_inverse_cdf_sampling_by_hand():
    # probabilities 0.1, 0.2, 0.7 (logits are their logs); CDF 0.1, 0.3, 1.0
    logits = torch.tensor([[0.1, 0.2, 0.7]]).log().expand(4, 3)
    params = SamplingParams(max_new_tokens=1)
    got = sample_next(logits, params, torch.tensor([0.0, 0.15, 0.3, 0.9999999]))
    assert got.tolist() == [0, 1, 2, 2]
    # a token filtered out (top_k=2 drops the 0.1 one) is never drawn, even at u = 0
    got = sample_next(logits, SamplingParams(max_new_tokens=1, top_k=2), torch.tensor([0.0, 0.1, 0.5, 0.99]))
    assert got.tolist() == [1, 1, 2, 2]


def test_inverse_cdf_sampling_matches_the_distribution():
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    g = torch.Generator().manual_seed(0)
    draws = sample_next(probs.log().expand(200_000, 4), SamplingParams(max_new_tokens=1),
                        torch.rand(200_000, generator=g))
    freq = torch.bincount(draws, minlength=4).double() / 200_000
    torch.testing.assert_close(freq, probs.double(), atol=4e-3, rtol=0)  # ~4 standard errors


def test_sampled_tokens_log_probs_come_from_the_same_log_softmax_and_never_land_past_the_mass():
    from posttrain.rollout.hf import next_tokens

    # the last token has no mass (logit -inf): a point rounded onto the total (u = 1) takes the last one with mass
    logits = torch.tensor([[0.1, 0.2, 0.7, 0.0]]).log().expand(3, 4)
    token, log_p = next_tokens(logits, SamplingParams(max_new_tokens=1), torch.tensor([0.0, 0.5, 1.0]), True)
    assert token.tolist() == [0, 2, 2]
    torch.testing.assert_close(log_p, torch.tensor([0.1, 0.7, 0.7]).log())
    # the log-probs are those at the sampling temperature before top-k: what the trainer's passes compute
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=4)
    token, log_p = next_tokens(logits, params, torch.rand(5, generator=torch.Generator().manual_seed(1)), True)
    assert torch.equal(token, sample_next(logits, params, torch.rand(5, generator=torch.Generator().manual_seed(1))))
    assert all(t in row.topk(4).indices for t, row in zip(token.tolist(), logits))
    torch.testing.assert_close(log_p, torch.log_softmax(logits / 0.7, -1).gather(-1, token[:, None]).squeeze(-1))
    greedy, log_p = next_tokens(logits, SamplingParams(max_new_tokens=1, temperature=0.0), None, True)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(log_p, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("bias", [False, True])
def test_the_sliced_output_layer_gives_the_plain_layers_logits(monkeypatch, bias):
    from posttrain.rollout import head

    monkeypatch.setattr(head, "VOCAB_SLICE", 3)  # 40 = 13 slices of 3 and one of 1
    layer = torch.nn.Linear(16, 40, bias=bias)
    hidden = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(head.sliced_linear(layer, hidden), layer(hidden), atol=1e-6, rtol=1e-6)


def test_the_sliced_output_layer_keeps_the_plain_product_where_a_gradient_or_autocast_is_on():
    from posttrain.rollout import head

    layer = torch.nn.Linear(16, 40 * head.VOCAB_SLICE)
    hidden = torch.randn(3, 16)
    out = head.sliced_linear(layer, hidden)  # the weight wants a gradient: the plain product, with its graph
    assert out.grad_fn is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert head.sliced_linear(layer, hidden).dtype == torch.bfloat16  # autocast's product, as the layer's


def test_log_prob_passes_with_the_sliced_output_layer_are_the_same(random_qwen2, monkeypatch):
    from posttrain.rollout import head

    b = make_batch(random_qwen2)
    mask = b.response_mask.bool()
    want, want_entropy = compute_log_probs(random_qwen2, b, 4, temperature=0.7, with_entropy=True)
    monkeypatch.setattr(head, "MIN_VOCAB", 1)
    monkeypatch.setattr(head, "VOCAB_SLICE", 7)
    calls = []
    real = head.sliced_linear
    monkeypatch.setattr(head, "sliced_linear", lambda *a: calls.append(1) or real(*a))
    got, entropy = compute_log_probs(random_qwen2, b, 4, temperature=0.7, with_entropy=True)
    assert calls
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[mask], want_entropy[mask], atol=1e-5, rtol=1e-5)


def test_generation_with_the_sliced_output_layer_is_the_same_and_leaves_the_model_as_it_was(model64, monkeypatch):
    from posttrain.rollout import head

    params = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, logprobs=True)
    monkeypatch.setattr(head, "MIN_VOCAB", 10**9)  # the plain layer
    plain = generate(model64, params)
    monkeypatch.setattr(head, "MIN_VOCAB", 1)
    monkeypatch.setattr(head, "VOCAB_SLICE", 7)
    names = list(model64.state_dict())
    calls = []
    real = head.sliced_linear
    monkeypatch.setattr(head, "sliced_linear", lambda *a: calls.append(1) or real(*a))
    sliced = generate(model64, params)
    assert calls  # the decoding steps went through it
    same_samples(plain, sliced)
    torch.testing.assert_close(plain.log_probs, sliced.log_probs, atol=1e-12, rtol=0)
    assert list(model64.state_dict()) == names and "forward" not in vars(model64.get_output_embeddings())


@pytest.mark.parametrize("micro_batch_size", [None, 6])
@pytest.mark.parametrize("flag", ["shared_prefill", "remove_padding", "early_stop"])
def test_each_generation_fast_path_gives_the_same_samples(model64, flag, micro_batch_size):
    params = SamplingParams(max_new_tokens=8, n=3, temperature=1.0, logprobs=True)
    on = generate(model64, params, micro_batch_size=micro_batch_size)
    off = generate(model64, params, micro_batch_size=micro_batch_size, **{flag: False})
    same_samples(on, off)
    torch.testing.assert_close(on.log_probs, off.log_probs[:, :on.log_probs.shape[1]], rtol=0, atol=1e-9)
    lengths = on.response_mask.sum(-1)
    assert lengths.min() < lengths.max() <= 8  # some rows ended early: skipping them was exercised


def test_all_generation_fast_paths_off_gives_the_same_samples(model64):
    params = SamplingParams(max_new_tokens=8, n=4, temperature=0.9, top_p=0.95)
    same_samples(generate(model64, params, micro_batch_size=8), generate(model64, params, micro_batch_size=8, **OFF))
    # and the same with EOS ignored (every row runs to the end)
    params = SamplingParams(max_new_tokens=5, n=4, ignore_eos=True)
    a, b = generate(model64, params), generate(model64, params, **OFF)
    same_samples(a, b)
    assert a.response_mask.all()


def test_early_stop_off_decodes_to_the_limit(model64):
    params = SamplingParams(max_new_tokens=30, n=2)
    eos = list(range(1, 21))  # half the vocabulary: every row ends within a few tokens
    on, off = (HFRolloutEngine(model64, eos, 0, seed=5, progress=False, early_stop=stop).generate(PROMPTS, params)
               for stop in (True, False))
    assert on.response_ids.shape[1] < 30 and off.response_ids.shape[1] == 30
    same_samples(on, off)


def make_batch(model, n=3, max_new=8, seed=1) -> RolloutBatch:
    """A real rollout: prompts of different lengths, responses ended by EOS at different steps."""
    params = SamplingParams(max_new_tokens=max_new, n=n)
    out = HFRolloutEngine(model, EOS, pad_token_id=0, seed=seed, progress=False).generate(PROMPTS, params)
    k = len(PROMPTS)
    return RolloutBatch.from_rollout(out, n, ["a"] * k, ["x"] * k, [{}] * k, [""] * (k * n))


def test_trim_padding_drops_only_all_padding_columns(random_qwen2):
    b = make_batch(random_qwen2)
    order = length_order(b)
    assert sorted(order.tolist()) == list(range(len(b)))
    group = b.group[order].tolist()
    assert all(group.count(g) == 3 and group.index(g) + 2 == len(group) - group[::-1].index(g) - 1
               for g in set(group))  # the samples of a prompt stay together
    mb = b.select(order[-6:])  # the two shortest prompts
    cut = trim_padding(mb)
    prompt_width = cut.input_ids.shape[1] - cut.response_length
    assert cut.attention_mask[:, 0].any() and cut.attention_mask[:, :prompt_width].sum() == \
        mb.attention_mask[:, :mb.input_ids.shape[1] - mb.response_length].sum()
    assert cut.response_mask[:, -1].any() and cut.response_mask.sum() == mb.response_mask.sum()
    assert cut.responses.shape == cut.response_mask.shape and cut.input_ids.shape == cut.position_ids.shape


@pytest.mark.parametrize("micro", [2, 3, 7, 64])
def test_log_probs_are_the_same_with_and_without_the_fast_paths(random_qwen2, micro):
    b = make_batch(random_qwen2)
    plain, ent_plain = compute_log_probs(random_qwen2, b, micro, temperature=0.7, with_entropy=True,
                                         options=PassOptions(remove_padding=False, share_prompt=False))
    mask = b.response_mask.bool()
    for options in (PassOptions(True, False), PassOptions(False, True), PassOptions(True, True)):
        fast, ent = compute_log_probs(random_qwen2, b, micro, temperature=0.7, with_entropy=True, options=options)
        torch.testing.assert_close(fast[mask], plain[mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[mask], ent_plain[mask], atol=1e-5, rtol=1e-5)


def update(model, batch, **settings):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    s = UpdateSettings(mini_batch_size=len(batch), micro_batch_size=4, use_kl_loss=True, kl_loss_coef=0.04,
                       grad_clip=1e9, **settings)
    metrics = update_policy(model, opt, batch, s)
    step = torch.cat([(p0 - p.detach()).flatten() for p0, p in zip(before, model.parameters())])
    return step, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_training_losses_and_gradients_are_the_same_with_and_without_the_fast_paths(random_qwen2, mode):
    b = make_batch(random_qwen2)
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 4, options=PassOptions(False, False))
    b.old_log_probs = b.old_log_probs + 0.05 * b.response_mask  # a little off-policy: clipping is exercised
    b.ref_log_probs = b.old_log_probs - 0.1 * b.response_mask
    b.advantages = torch.linspace(-1, 1, len(b))[:, None] * b.response_mask
    plain, m_plain = update(random_qwen2, b, loss_agg_mode=mode, remove_padding=False, share_prompt=False)
    assert plain.abs().sum() > 0
    for rp, sp in ((True, False), (False, True), (True, True)):
        fast, m = update(random_qwen2, b, loss_agg_mode=mode, remove_padding=rp, share_prompt=sp)
        torch.testing.assert_close(fast, plain, atol=1e-6, rtol=1e-4)
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac"):
            assert m[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-6), key


def test_on_policy_update_without_old_log_probs_equals_one_with_them(random_qwen2):
    """ppo_epochs=1 and one mini-batch: the update's own forward, detached,
    gives the same loss and gradient as a separate no-grad pass."""
    b = make_batch(random_qwen2)
    b.advantages = torch.linspace(-1, 1, len(b))[:, None] * b.response_mask
    b.ref_log_probs = compute_log_probs(random_qwen2, b, 4)[0] - 0.1 * b.response_mask
    reused, m_reused = update(random_qwen2, b)
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 8)
    separate, m_separate = update(random_qwen2, b)
    assert reused.abs().sum() > 0
    torch.testing.assert_close(reused, separate, atol=1e-7, rtol=1e-5)
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m_reused[key] == pytest.approx(m_separate[key], rel=1e-5, abs=1e-7), key
    assert m_reused["actor/ppo_kl"] == 0.0 and m_reused["actor/pg_clipfrac"] == 0.0


def one_step_run(tmp_path, model_dir, name, *overrides):
    from posttrain.driver.build import build_run
    from posttrain.config import load_config

    write_prompts(tmp_path, 4)
    cfg = load_config(None, run_overrides(
        model_dir, tmp_path, tmp_path / name, "data.train_batch_size=4", "data.max_response_length=4",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=3", "rollout.n=3", "actor.use_kl_loss=true",
        "reward.num_workers=0", "trainer.total_training_steps=1", *overrides))
    run = build_run(cfg)
    passes = []
    compute = run.actor.compute_log_probs
    run.actor.compute_log_probs = lambda batch, which="policy": passes.append(which) or compute(batch, which)
    return run, passes


@pytest.mark.parametrize("overrides, separate_pass", [
    ((), False),
    (("actor.reuse_on_policy_log_probs=false",), True),
    (("actor.ppo_epochs=2",), True),
    (("actor.ppo_mini_batch_size=2",), True),  # two mini-batches: the second is off-policy
    (("algorithm.use_kl_in_reward=true",), True),  # the reward's KL needs them before the update
])
def test_the_old_log_prob_pass_runs_only_when_the_update_is_off_policy(tmp_path, tiny_model_dir, overrides,
                                                                       separate_pass):
    from posttrain.driver.loop import rl_step

    run, passes = one_step_run(tmp_path, tiny_model_dir, "run", *overrides)
    _, indices = run.sampler.next_batch()
    m, batch = rl_step(run, [run.train_data[i] for i in indices])
    run.rewards.close()
    assert run.on_policy_update is not separate_pass
    assert ("policy" in passes) is separate_pass and "ref" in passes
    assert ("timing_s/old_log_prob" in m) is separate_pass
    assert (batch.old_log_probs is None) is not separate_pass


def test_a_step_reusing_its_log_probs_equals_one_with_a_separate_pass(tmp_path, tiny_model_dir):
    """Same seed, same samples: the step's losses and the weights it leaves are those of the separate pass."""
    from posttrain.driver.loop import rl_step

    results = []
    for name, flag in (("reused", "true"), ("separate", "false")):
        run, _ = one_step_run(tmp_path, tiny_model_dir, name, f"actor.reuse_on_policy_log_probs={flag}",
                              "actor.lr=1e-3", "actor.entropy_coeff=0.01")  # a gradient even if all scores tie
        _, indices = run.sampler.next_batch()
        m, batch = rl_step(run, [run.train_data[i] for i in indices])
        run.rewards.close()
        results.append((m, batch, [p.detach().clone() for p in run.actor.policy.parameters()]))
    (m1, b1, w1), (m2, b2, w2) = results
    assert torch.equal(b1.responses, b2.responses) and m1["actor/grad_norm"] > 0
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(w1, w2):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.filterwarnings("error::FutureWarning")  # how transformers says an argument's name goes away
def test_the_kv_cache_goes_by_the_name_the_installed_transformers_takes(random_qwen2):
    """transformers renamed a model's `past_key_values` (argument and output) to `cache`, and the old
    name goes in 5.40: decoding and the shared-prompt log-prob pass use the installed version's name,
    so neither warns (nor, past 5.40, decodes without its cache)."""
    import inspect

    from transformers import Qwen2ForCausalLM

    from posttrain.rollout.kv import CACHE

    assert CACHE in inspect.signature(Qwen2ForCausalLM.forward).parameters
    batch = make_batch(random_qwen2)  # a prefill, then decoding steps that pass the cache back in
    options = PassOptions(remove_padding=False, share_prompt=True)  # the prompt's cache, reused by its samples
    compute_log_probs(random_qwen2, batch, 64, temperature=1.0, options=options)


def test_reserved_cache_layer_writes_in_place_and_grows_when_full():
    from posttrain.rollout.kv import ReservedLayer

    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    layer = ReservedLayer(keys, values, room=1, repeats=2)  # rows 0, 0, 1, 1
    assert torch.equal(layer.keys, keys.repeat_interleave(2, dim=0))
    steps = [(torch.randn(4, 1, 1, 4), torch.randn(4, 1, 1, 4)) for _ in range(3)]  # the 2nd and 3rd outgrow it
    for k, v in steps:
        got_k, got_v = layer.update(k, v)
    want_k = torch.cat([keys.repeat_interleave(2, dim=0)] + [k for k, _ in steps], dim=2)
    want_v = torch.cat([values.repeat_interleave(2, dim=0)] + [v for _, v in steps], dim=2)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and layer.get_seq_length() == 6
    layer.batch_select_indices(torch.tensor([3, 0]))
    assert torch.equal(layer.keys, want_k[[3, 0]]) and torch.equal(layer.values, want_v[[3, 0]])
    layer.crop(-2)  # back to 4 positions; the next token goes after them
    k, v = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
    got_k, got_v = layer.update(k, v)
    assert torch.equal(got_k, torch.cat([want_k[[3, 0], :, :4], k], dim=2)) and layer.get_seq_length() == 5
    assert torch.equal(got_v, torch.cat([want_v[[3, 0], :, :4], v], dim=2))


# verl's memory switches: the same log-probs, entropy, loss and gradient, from fewer or smaller temporaries
MEMORY_OPTIONS = {"fused": dict(fused_kernels=True), "entropy chunks": dict(entropy_chunking=True),
                  "entropy checkpoint": dict(entropy_checkpointing=True),
                  "all": dict(fused_kernels=True, entropy_chunking=True, entropy_checkpointing=True)}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 tokens (3 x the 40-token vocabulary): every pass is cut into many."""
    from posttrain.training import fused, logprobs

    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 3 * 40)
    monkeypatch.setattr(logprobs, "ENTROPY_CHUNK", 3)


@pytest.mark.parametrize("name", list(MEMORY_OPTIONS))
def test_log_probs_and_entropy_are_the_same_with_the_memory_switches(random_qwen2, small_chunks, name):
    b = make_batch(random_qwen2)
    mask = b.response_mask.bool()
    ref, ent_ref = compute_log_probs(random_qwen2, b, 4, temperature=0.7, with_entropy=True,
                                     options=PassOptions(False, False))
    flags = {k.replace("fused_kernels", "fused"): v for k, v in MEMORY_OPTIONS[name].items()}
    for rp, sp in ((False, False), (True, True)):  # the shared prompt's two calls use the fused head too
        got, ent = compute_log_probs(random_qwen2, b, 4, temperature=0.7, with_entropy=True,
                                     options=PassOptions(rp, sp, **flags))
        torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[mask], ent_ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MEMORY_OPTIONS))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_training_is_the_same_with_the_memory_switches(random_qwen2, small_chunks, name, mode):
    b = make_batch(random_qwen2)
    b.old_log_probs, _ = compute_log_probs(random_qwen2, b, 4, options=PassOptions(False, False))
    b.old_log_probs = b.old_log_probs + 0.05 * b.response_mask
    b.ref_log_probs = b.old_log_probs - 0.1 * b.response_mask
    b.advantages = torch.linspace(-1, 1, len(b))[:, None] * b.response_mask
    # an entropy bonus: its gradient must flow through the chunked / checkpointed / fused entropy as well
    plain, m_plain = update(random_qwen2, b, loss_agg_mode=mode, entropy_coeff=0.3)
    fast, m = update(random_qwen2, b, loss_agg_mode=mode, entropy_coeff=0.3, **MEMORY_OPTIONS[name])
    assert plain.abs().sum() > 0
    torch.testing.assert_close(fast, plain, atol=1e-6, rtol=1e-4)
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-6), key


def test_log_prob_and_entropy_from_one_log_softmax_by_hand_and_against_the_two_passes(monkeypatch):
    from posttrain.algorithms.losses import entropy_from_logits
    from posttrain.training import logprobs
    from posttrain.training.logprobs import log_prob_and_entropy, token_log_probs

    # p = [0.5, 0.25, 0.25] (logits shifted by 3: only differences count): entropy 1.5 ln 2, log p(token 1) = ln 1/4
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]])) + 3.0
    log_prob, entropy = log_prob_and_entropy(logits, torch.tensor([[1]]))
    assert log_prob.item() == pytest.approx(math.log(0.25), abs=1e-6)
    assert entropy.item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    monkeypatch.setattr(logprobs, "ENTROPY_ROWS", 4)  # 15 positions: pieces of 4, 4, 4 and 3
    logits = (torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0)) * 4).requires_grad_()
    tokens = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(1))
    log_prob, entropy = log_prob_and_entropy(logits, tokens)
    torch.testing.assert_close(log_prob, token_log_probs(logits, tokens), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, entropy_from_logits(logits).detach(), atol=1e-5, rtol=0)
    assert log_prob.requires_grad and not entropy.requires_grad  # the entropy is a metric here: no graph
    (grad,) = torch.autograd.grad(log_prob.sum(), logits)
    (want,) = torch.autograd.grad(token_log_probs(logits, tokens).sum(), logits)
    torch.testing.assert_close(grad, want)


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements any operation's output had."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_the_fused_pass_never_holds_the_whole_logits(monkeypatch):
    """model.use_fused_kernels: no tensor as large as [N, R, V] is made, forward or backward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.training import fused
    from posttrain.training.logprobs import forward_responses
    torch.manual_seed(0)
    vocab = 4096  # the logits dominate: 8 rows x 12 response tokens x 4096 = 393k, the hidden states 8 x 22 x 16
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    n, p, r = 8, 10, 12
    ids = torch.randint(2, vocab, (n, p + r))
    mask, pos = torch.ones_like(ids), torch.arange(p + r).expand(n, -1)
    whole, chunk = n * r * vocab, 16 * vocab  # 16 of the 96 tokens per chunk
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", chunk)
    sizes = {}
    for name, targets in (("plain", None), ("fused", ids[:, p:])):
        with LargestTensor() as seen:
            out = forward_responses(model, ids, mask, pos, r, targets=targets)
            out.float().sum().backward()
        sizes[name] = seen.most
    assert sizes["plain"] >= whole
    assert sizes["fused"] <= chunk < whole / 5, sizes  # the embedding matrix (vocab x 16) is as large as a chunk


@pytest.mark.slow
def test_torch_compile_gives_the_same_log_probs_entropy_and_update(random_qwen2):
    """actor.use_torch_compile / ref.use_torch_compile: the log-prob and entropy functions
    compiled (about 20 s of compiling on a CPU), the results those of the eager ones."""
    from posttrain.training.logprobs import compiled, token_log_probs

    b = make_batch(random_qwen2)
    mask = b.response_mask.bool()
    eager, ent_eager = compute_log_probs(random_qwen2, b, 4, temperature=0.7, with_entropy=True)
    got, ent = compute_log_probs(random_qwen2, b, 4, temperature=0.7, with_entropy=True,
                                 options=PassOptions(compile=True))
    assert compiled(token_log_probs) is not token_log_probs  # a compiled function ran, once per process
    torch.testing.assert_close(got[mask], eager[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[mask], ent_eager[mask], atol=1e-5, rtol=1e-5)
    b.advantages = torch.linspace(-1, 1, len(b))[:, None] * b.response_mask
    b.ref_log_probs = eager - 0.1 * b.response_mask
    plain, _ = update(random_qwen2, b, entropy_coeff=0.3)
    fast, _ = update(random_qwen2, b, entropy_coeff=0.3, torch_compile=True)
    torch.testing.assert_close(fast, plain, atol=1e-6, rtol=1e-4)
