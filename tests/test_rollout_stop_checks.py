"""The hf engine's decoding without host syncs between its stop checks (rollout.stop_check_every).

Samples are compared bit for bit. One thing cannot be: with remove_padding, between two checks a row shares its
batch with rows that have ended, and a CPU matmul rounds a row's product by the batch's size (a linear layer of
[6, H] and [3, H] rows can differ in the last bit for the same row), so log-probs there are compared to float64
rounding, as switching remove_padding itself is (tests/test_fast_paths.py).
"""

import copy
import itertools

import pytest
import torch

from posttrain.rollout import hf
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout.masks import takes_sdpa_masks

from helpers import generate_with_update
from posttrain.runtime.syncs import HostSyncs

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24, 25, 26], [27]]
EOS = [3, 7, 9]  # rows of the random 40-token model end at different steps
HALF = list(range(1, 21))  # half the vocabulary: every row ends within a few tokens (decoding stops early)


@pytest.fixture
def model64(random_qwen2):
    return copy.deepcopy(random_qwen2).double()


def run(model, k, params, other_weights=None, eos=EOS, **flags):
    """generate() with stop_check_every=k and a weights hook that loads `other_weights` before the 4th forward
    (in-flight update) -> (output, hook calls, forwards)."""
    engine = HFRolloutEngine(model, eos, 0, seed=5, progress=False, stop_check_every=k, **flags)
    return generate_with_update(engine, PROMPTS, params, other_weights)


@pytest.mark.parametrize("remove_padding,shared_prefill", [(True, True), (False, True), (True, False)])
def test_every_stop_check_interval_gives_the_same_samples_log_probs_and_versions(model64, remove_padding,
                                                                                shared_prefill):
    other = {k: v + 0.05 * torch.randn_like(v) for k, v in model64.state_dict().items()}
    ended_early = stopped_early = 0
    for greedy, ignore_eos, eos in itertools.product((True, False), (False, True), (EOS, HALF)):
        params = SamplingParams(max_new_tokens=12, n=3, temperature=1.0, do_sample=not greedy, ignore_eos=ignore_eos,
                                logprobs=True)
        flags = dict(remove_padding=remove_padding, shared_prefill=shared_prefill, eos=eos)
        want, _, _ = run(model64, 1, params, other, **flags)
        for k in (3, 8):
            got, calls, forwards = run(model64, k, params, other, **flags)
            assert calls == forwards  # the hook ran before every forward
            for name in ("response_ids", "response_mask", "truncated", "weight_versions", "prompt_ids"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (name, k, greedy, ignore_eos)
            if remove_padding:
                torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-12)
            else:
                assert torch.equal(got.log_probs, want.log_probs)
        lengths = want.response_mask.sum(-1)
        ended_early += int(lengths.min() < lengths.max())
        stopped_early += int(want.response_ids.shape[1] < 12)
        assert (want.weight_versions == 7).any() and (want.weight_versions[want.response_mask == 0] == -1).all()
    assert ended_early and stopped_early  # rows left at different steps; a chunk stopped before the limit


def test_a_stop_check_interval_below_one_is_refused(random_qwen2):
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="stop_check_every"):
            HFRolloutEngine(random_qwen2, EOS, 0, stop_check_every=bad)


def test_the_prebuilt_decoding_mask_is_taken_only_by_sdpa_models_attending_to_every_key(random_qwen2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.attention import use_grouped_attention

    assert takes_sdpa_masks(random_qwen2)  # sdpa
    grouped = copy.deepcopy(random_qwen2)
    assert use_grouped_attention(grouped) and takes_sdpa_masks(grouped)
    eager = copy.deepcopy(random_qwen2)
    eager.set_attn_implementation("eager")  # additive float masks: its own builder
    assert not takes_sdpa_masks(eager)
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                           sliding_window=4, max_window_layers=1))
    assert not takes_sdpa_masks(sliding)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=0, bos_token_id=None, eos_token_id=1)).eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen2-grouped", "llama", "llama-grouped", "embedded",
                                    "embedded-grouped"])
def test_the_prebuilt_decoding_mask_gives_the_2d_masks_samples_bit_for_bit(random_qwen2, family, monkeypatch):
    """float32, chunks with and without padded rows, padded rows leaving the batch: the same bits as the 2-D mask.
    (Where no running row is padded the step passes no mask, as transformers then does: SDPA given an all-True mask
    instead rounds differently, which the embedded model on plain SDPA shows.)"""
    from posttrain.models.attention import use_grouped_attention

    if family.startswith("embedded"):
        _, model, prompts = embedded_setup(small_attention=family.endswith("grouped"))
        prompts, eos = prompts[:6], [258, 53]
    else:
        model = random_qwen2 if family.startswith("qwen2") else tiny_llama()
        if family.endswith("grouped"):
            assert use_grouped_attention(model)
        prompts, eos = [*PROMPTS, [5, 6, 7, 8, 9, 10, 11]], EOS  # micro_batch_size=6: 2 prompts a chunk, one unpadded
    params = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, logprobs=True)
    outs = []
    for four_d in (True, False):
        monkeypatch.setattr(hf, "takes_sdpa_masks", lambda m, four_d=four_d: four_d)
        for mb in (None, 6):
            outs.append(HFRolloutEngine(model, eos, 0, seed=5, micro_batch_size=mb, progress=False).generate(
                prompts, params))
    for a, b in zip(outs[:2], outs[2:]):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)


def embedded_setup(small_attention: bool):
    from posttrain.models import load_model, load_tokenizer
    from posttrain.models.shipped import embedded_model

    path = embedded_model()
    tok, model = load_tokenizer(path), load_model(path, small_attention=small_attention)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{10 + i * 5}+{20 + 3 * i}="}],
                                       add_generation_prompt=True, tokenize=True) for i in range(16)]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    prompts[3], prompts[9] = prompts[3][2:], prompts[9][4:]  # prompts of other lengths: padded rows
    return tok, model, prompts


def syncs_per_step(model, prompts, eos, k, **params):
    """Host syncs over a whole generate() call, per decoding step run (each forward decodes one token)."""
    engine = HFRolloutEngine(model, eos, 0, seed=1, progress=False, stop_check_every=k)
    forwards = []
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with HostSyncs() as syncs:
            out = engine.generate(prompts, SamplingParams(n=4, **params))
    finally:
        handle.remove()
    return syncs.count / len(forwards), syncs.count, out


@pytest.mark.parametrize("small_attention", [True, False])
def test_decoding_makes_at_most_a_quarter_host_sync_per_token_when_checking_every_8(small_attention):
    """The embedded model, 16 prompts x n=4, 48 tokens. Before: 2.98 syncs per token with EOS off (a stop check's
    two reads, transformers' look at the 2-D mask). EOS on: '5' ends a response, so rows end at many steps."""
    tok, model, prompts = embedded_setup(small_attention)
    five = tok.convert_tokens_to_ids("5")
    off, _, _ = syncs_per_step(model, prompts, [five], 8, max_new_tokens=48, ignore_eos=True)
    on, _, out = syncs_per_step(model, prompts, [five], 8, max_new_tokens=48)
    assert off <= 0.25 and on <= 0.25, (off, on)
    lengths = out.response_mask.sum(-1)
    assert lengths.min() < 8 and lengths.min() < lengths.max()  # rows left the batch at checks
    every, _, _ = syncs_per_step(model, prompts, [five], 1, max_new_tokens=48)
    assert every >= 0.9  # checking after every token: one read each (the count sees them)
    # the decoding forwards read nothing back: a 48-token call makes the syncs of its prefill alone
    _, prefill_only, _ = syncs_per_step(model, prompts, [five], 1, max_new_tokens=1, ignore_eos=True)
    _, whole, _ = syncs_per_step(model, prompts, [five], 1, max_new_tokens=48, ignore_eos=True)
    assert whole == prefill_only


def test_rollout_stop_check_every_is_validated_and_reaches_the_engine(random_qwen2):
    from types import SimpleNamespace

    from posttrain.config.schema import Config
    from posttrain.config.validate_rollout import unused_engine_settings, validate_rollout
    from posttrain.driver.settings import rollout_spec
    from posttrain.errors import ConfigError
    from posttrain.worker.engines import make_engine

    def engine_of(cfg):
        spec = SimpleNamespace(rollout=rollout_spec(cfg), seed=0)
        return make_engine(spec, random_qwen2, EOS, 0, rank=0, progress=False)

    cfg = Config()
    validate_rollout(cfg)
    assert cfg.rollout.stop_check_every is None and engine_of(cfg).stop_check_every == 1  # null on the CPU: 1
    cfg.rollout.stop_check_every = 4
    validate_rollout(cfg)
    assert engine_of(cfg).stop_check_every == 4
    assert "rollout.stop_check_every" not in unused_engine_settings(cfg.rollout)
    cfg.rollout.name = "vllm"
    assert "rollout.stop_check_every" in unused_engine_settings(cfg.rollout)
    for bad in (0, 2.5, True):
        cfg = Config()
        cfg.rollout.stop_check_every = bad
        with pytest.raises(ConfigError, match="rollout.stop_check_every must be an integer >= 1") as e:
            validate_rollout(cfg)
        assert "\n" not in str(e.value)
