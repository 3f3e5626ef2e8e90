import torch

from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout.sampling import filter_logits

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def greedy_reference(model, prompt, max_new, eos):
    """Unbatched, unpadded, no cache: the plainest possible greedy decode."""
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    return out


def test_batched_cached_greedy_matches_plain_decode(random_qwen2):
    engine = HFRolloutEngine(random_qwen2, eos_token_ids=[1], pad_token_id=0, progress=False)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, do_sample=False))
    assert out.prompt_ids.shape == (3, 5)
    assert out.prompt_mask.tolist()[1] == [0, 0, 0, 1, 1]
    for i, prompt in enumerate(PROMPTS):
        expected = greedy_reference(random_qwen2, prompt, 6, eos=1)
        got = out.response_ids[i][out.response_mask[i].bool()].tolist()
        assert got == expected


def test_n_samples_are_prompt_major_and_chunking_does_not_change_greedy(random_qwen2):
    params = SamplingParams(max_new_tokens=4, n=2, do_sample=False)
    whole = HFRolloutEngine(random_qwen2, [1], 0, progress=False).generate(PROMPTS, params)
    chunked = HFRolloutEngine(random_qwen2, [1], 0, micro_batch_size=2, progress=False).generate(PROMPTS, params)
    assert whole.response_ids.shape[0] == 6
    assert torch.equal(whole.response_ids[0], whole.response_ids[1])  # same prompt, greedy
    assert torch.equal(whole.prompt_ids[2], whole.prompt_ids[3])
    width = min(whole.response_ids.shape[1], chunked.response_ids.shape[1])
    assert torch.equal(whole.response_ids[:, :width] * whole.response_mask[:, :width],
                       chunked.response_ids[:, :width] * chunked.response_mask[:, :width])


def test_stops_at_eos_and_pads_after_it(random_qwen2):
    params = SamplingParams(max_new_tokens=5, do_sample=False)
    free = HFRolloutEngine(random_qwen2, [39], pad_token_id=0, progress=False).generate(PROMPTS, params)
    # Declare each prompt's first greedy token an EOS: every response is then just that token.
    first = free.response_ids[:, 0].tolist()
    engine = HFRolloutEngine(random_qwen2, first, pad_token_id=0, progress=False)
    out = engine.generate(PROMPTS, params)
    assert out.response_ids.shape[1] == 1  # stopped early: nothing left to generate
    assert out.response_ids[:, 0].tolist() == first
    # EOS only for the first prompt's token: that row is padded while the others go on.
    one = HFRolloutEngine(random_qwen2, [first[0]], pad_token_id=0, progress=False).generate(PROMPTS, params)
    if first[0] not in first[1:]:
        assert one.response_mask[0].tolist() == [1, 0, 0, 0, 0]
        assert one.response_ids[0, 1:].tolist() == [0, 0, 0, 0]
    ignoring = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, do_sample=False, ignore_eos=True))
    assert ignoring.response_ids.shape[1] == 5
    assert ignoring.response_mask.sum().item() == 15


def test_truncated_marks_the_responses_that_ran_out_of_tokens(random_qwen2):
    params = SamplingParams(max_new_tokens=5, do_sample=False)
    free = HFRolloutEngine(random_qwen2, [39], pad_token_id=0, progress=False).generate(PROMPTS, params)
    first = free.response_ids[:, 0].tolist()
    # EOS = the first prompt's first greedy token: that response ends at once, the others (unless they meet it)
    # run to the limit
    out = HFRolloutEngine(random_qwen2, [first[0]], pad_token_id=0, progress=False).generate(PROMPTS, params)
    ended = [bool((out.response_ids[i][out.response_mask[i].bool()] == first[0]).any()) for i in range(3)]
    assert out.truncated.tolist() == [not e for e in ended] and ended[0]
    assert all(out.response_mask[i].sum() == 5 for i in range(3) if not ended[i])
    # an EOS on the very last allowed token is an ending, not a cut; chunked and whole agree
    every = HFRolloutEngine(random_qwen2, first, pad_token_id=0, micro_batch_size=1, progress=False)
    assert every.generate(PROMPTS, SamplingParams(max_new_tokens=1, do_sample=False)).truncated.tolist() == [False] * 3
    # ignore_eos: nothing ends, every response is cut at the limit
    ignoring = every.generate(PROMPTS, SamplingParams(max_new_tokens=3, n=2, ignore_eos=True))
    assert ignoring.truncated.tolist() == [True] * 6


def test_sampling_is_reproducible_by_seed_and_varies_across_samples(random_qwen2):
    params = SamplingParams(max_new_tokens=5, n=8, temperature=1.0)
    a = HFRolloutEngine(random_qwen2, [1], 0, seed=3, progress=False).generate(PROMPTS, params)
    b = HFRolloutEngine(random_qwen2, [1], 0, seed=3, progress=False).generate(PROMPTS, params)
    assert torch.equal(a.response_ids, b.response_ids)
    assert len({tuple(r.tolist()) for r in a.response_ids[:8]}) > 1


def test_top_k_one_is_greedy(random_qwen2):
    engine = HFRolloutEngine(random_qwen2, [1], 0, progress=False)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, do_sample=False))
    topk1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, top_k=1, temperature=1.0))
    assert torch.equal(greedy.response_ids, topk1.response_ids)


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    inf = float("-inf")
    assert filter_logits(logits, top_k=2, top_p=1.0).isinf().tolist() == [[False, False, True, True]]
    # top_p=0.7: 0.5 alone is below 0.7, so 0.3 joins; the mass before 0.15 is 0.8 > 0.7 -> dropped
    kept = filter_logits(logits, top_k=-1, top_p=0.7)
    assert kept.isinf().tolist() == [[False, False, True, True]]
    assert filter_logits(logits, top_k=-1, top_p=0.01)[0, 0] != inf  # the top token always survives


def test_sampling_log_probs_match_a_full_forward(random_qwen2):
    """The cached decode's log-probs equal those of one forward pass over prompt + response."""
    from posttrain.driver.batch import RolloutBatch
    from posttrain.training.logprobs import compute_log_probs

    params = SamplingParams(max_new_tokens=5, n=3, temperature=0.7, logprobs=True)
    out = HFRolloutEngine(random_qwen2, [1], 0, seed=1, progress=False).generate(PROMPTS, params)
    assert out.log_probs.shape == out.response_ids.shape
    assert (out.log_probs[out.response_mask == 0] == 0).all()
    batch = RolloutBatch.from_rollout(out, 3, ["a"] * 3, ["x"] * 3, [{}] * 3, [""] * 9)
    full, _ = compute_log_probs(random_qwen2, batch, micro_batch_size=9, temperature=0.7)
    mask = out.response_mask.bool()
    torch.testing.assert_close(out.log_probs[mask], full[mask], atol=1e-4, rtol=1e-4)
    assert HFRolloutEngine(random_qwen2, [1], 0, progress=False).generate(
        PROMPTS, SamplingParams(max_new_tokens=2)).log_probs is None
