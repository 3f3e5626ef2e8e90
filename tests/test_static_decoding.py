"""The hf engine's static-shape decoding step (rollout.static_decoding, rollout/static.py) against the eager loop.

Eager (the CPU's way), the static step reads only the key columns written so far: the eager loop's arithmetic,
so samples, log-probs and weight versions are compared bit for bit. Recorded (CUDA graphs), a step attends over
the columns written rounded up to a window (unwritten ones masked) and runs in a bucket of fixed size beside ended rows: the
CPU runs that arithmetic eagerly through a stand-in for torch.cuda.CUDAGraph that records the step as a function
(`Recorder`), in float64, where a sum over more (masked, zero) terms or a batch of another size rounds a
log-prob's last bits at most: the tokens are compared exactly, log-probs to 1e-12.
"""

import copy
import itertools

import pytest
import torch

from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout import static
from posttrain.rollout.static import bucket_for, buckets
from posttrain.runtime.syncs import HostSyncs

from helpers import generate_with_update

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24, 25, 26], [27]]
EOS = [3, 7, 9]
HALF = list(range(1, 21))  # half the vocabulary: every row ends within a few tokens


class Recorder:
    """Stands in for a CUDA graph: `replay` runs the recorded step (recording runs nothing, as CUDA's)."""

    made = []

    def __init__(self, step):
        self.step, self.replays = step, 0
        Recorder.made.append(self)

    def replay(self):
        self.replays += 1
        self.step()


@pytest.fixture
def model64(random_qwen2):
    return copy.deepcopy(random_qwen2).double()


def run(model, params, static=None, other_weights=None, eos=EOS, k=1, **flags):
    """generate() (static: None, the eager loop; "eager"; "recorded") with a weights hook that loads
    `other_weights` before the 4th forward (an in-flight update)."""
    engine = HFRolloutEngine(model, eos, 0, seed=5, progress=False, stop_check_every=k,
                             static_decoding=static is not None, **flags)
    if static == "recorded":
        engine.static.graph_type = Recorder
    elif static == "eager":
        engine.static.graphs = False
    return generate_with_update(engine, PROMPTS, params, other_weights)[0]


def test_buckets_halve_down_to_eight_and_take_the_smallest_that_holds():
    assert buckets(40) == [40, 32, 16, 8] and buckets(64) == [64, 32, 16, 8] and buckets(5) == [5]
    assert [bucket_for(s, buckets(40)) for s in (40, 33, 32, 17, 9, 8, 1)] == [40, 40, 32, 32, 16, 8, 8]


@pytest.mark.parametrize("remove_padding,shared_prefill,micro", [(True, True, None), (False, True, None),
                                                                 (True, False, 6), (True, True, 9)])
def test_the_static_step_gives_the_eager_loops_samples(model64, remove_padding, shared_prefill, micro, monkeypatch):
    """Eager: bit for bit. Recorded (windows of 8 columns: several per call): the same tokens and versions,
    log-probs to float64 rounding."""
    monkeypatch.setattr(static, "COLUMNS", 8)
    other = {k: v + 0.05 * torch.randn_like(v) for k, v in model64.state_dict().items()}
    stopped_early = 0
    for greedy, ignore_eos, eos, k in itertools.product((True, False), (False, True), (EOS, HALF), (1, 3)):
        params = SamplingParams(max_new_tokens=12, n=3, temperature=1.0, do_sample=not greedy, ignore_eos=ignore_eos,
                                logprobs=True)
        flags = dict(remove_padding=remove_padding, shared_prefill=shared_prefill, micro_batch_size=micro, eos=eos,
                     k=k)
        want = run(model64, params, None, other, **flags)
        for mode in ("eager", "recorded"):
            got = run(model64, params, mode, other, **flags)
            for name in ("response_ids", "response_mask", "truncated", "weight_versions", "prompt_ids"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (name, mode, greedy, ignore_eos, k)
            if mode == "eager":
                assert torch.equal(got.log_probs, want.log_probs)
            else:
                torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-12)
        stopped_early += int(want.response_ids.shape[1] < 12)
        assert (want.weight_versions == 7).any()
    assert stopped_early


def test_a_recorded_step_is_recorded_once_per_bucket_and_sampling_and_replayed_after(model64):
    """32 sequences (4 prompts x 8) ending between 1 and 24 tokens: the batch shrinks from 32 rows to 16, then 8,
    each recorded once (after one eager warm-up step); a second call with the same shapes replays them."""
    Recorder.made.clear()
    engine = HFRolloutEngine(model64, EOS, 0, seed=3, progress=False, stop_check_every=2, static_decoding=True)
    engine.static.graph_type = Recorder
    params = SamplingParams(max_new_tokens=24, n=8, temperature=1.0, logprobs=True)
    first = engine.generate(PROMPTS[:4], params)
    assert [b for (_, b, _) in engine.static.recorded] == [32, 16, 8]
    assert all(r.replays >= 1 for r in Recorder.made) and len(Recorder.made) == 3
    replays = sum(r.replays for r in Recorder.made)
    assert replays + 3 == 23  # every step after the prefill's token: replayed, or one warm-up per bucket
    again = engine.generate(PROMPTS[:4], params)  # other uniforms: other samples, the same shapes
    # kept, and no warm-up: every step of the second call replays
    assert len(Recorder.made) == 3 and sum(r.replays for r in Recorder.made) - replays == again.response_ids.shape[1] - 1
    engine.generate(PROMPTS[:4], SamplingParams(max_new_tokens=24, n=8, temperature=0.7, logprobs=True))
    assert len(Recorder.made) > 3  # another temperature: another step
    assert first.response_mask.sum(-1).min() < 8


def test_static_decoding_makes_at_most_an_eighth_of_a_host_sync_per_token(model64):
    """Checking every 8 tokens: one read per check, none in the steps between (nor in a recorded one)."""
    params = SamplingParams(max_new_tokens=48, n=4, temperature=1.0, logprobs=True)
    for static, eos in itertools.product(("eager", "recorded"), (EOS, [39])):
        engine = HFRolloutEngine(model64, eos, 0, seed=1, progress=False, stop_check_every=8, static_decoding=True)
        if static == "recorded":
            engine.static.graph_type = Recorder
        else:
            engine.static.graphs = False
        steps = []
        handle = model64.register_forward_pre_hook(lambda *a: steps.append(1))
        try:
            with HostSyncs() as syncs:
                engine.generate(PROMPTS[:4], params)
        finally:
            handle.remove()
        prefill = 1
        assert syncs.count / (len(steps) - prefill) <= 0.25, (static, eos, syncs.count, len(steps))


def test_static_decoding_is_refused_for_a_model_that_does_not_take_4d_masks(random_qwen2):
    eager = copy.deepcopy(random_qwen2)
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="rollout.static_decoding=false"):
        HFRolloutEngine(eager, EOS, 0, static_decoding=True)


@pytest.mark.parametrize("grouped", [False, True])
def test_under_bf16_autocast_keys_and_values_kept_in_bf16_give_the_same_samples(random_qwen2, grouped):
    """The eager loop keeps RoPE's float32 keys and autocast casts them to bf16 in every attention; the static
    buffers hold them in bf16 from the start: the attention reads the same numbers."""
    from posttrain.models.attention import use_grouped_attention

    model = copy.deepcopy(random_qwen2)
    if grouped:
        assert use_grouped_attention(model)
    params = SamplingParams(max_new_tokens=12, n=3, temperature=1.0, logprobs=True)
    outs = []
    for static in (None, "eager"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(run(model, params, static, k=3))
        if static:
            engine = HFRolloutEngine(model, EOS, 0, static_decoding=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
            assert engine.static.k[0].dtype == torch.bfloat16
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.equal(outs[0].log_probs, outs[1].log_probs)


def test_rollout_static_decoding_is_validated_and_reaches_the_engine(random_qwen2):
    from types import SimpleNamespace

    from posttrain.config.schema import Config
    from posttrain.config.validate_rollout import unused_engine_settings, validate_rollout
    from posttrain.driver.settings import rollout_spec
    from posttrain.errors import ConfigError
    from posttrain.worker.engines import make_engine

    def engine_of(cfg):
        validate_rollout(cfg)
        spec = SimpleNamespace(rollout=rollout_spec(cfg), seed=0)
        return make_engine(spec, random_qwen2, EOS, 0, rank=0, progress=False)

    cfg = Config()
    assert cfg.rollout.static_decoding is None and engine_of(cfg).static is None  # null on the CPU: off
    cfg.rollout.static_decoding = True
    engine = engine_of(cfg)
    assert engine.static is not None and engine.static.graphs
    cfg.rollout.enforce_eager = True
    assert not engine_of(cfg).static.graphs
    assert not {"rollout.static_decoding", "rollout.enforce_eager"} & set(unused_engine_settings(cfg.rollout))
    cfg.rollout.name = "vllm"
    assert "rollout.static_decoding" in unused_engine_settings(cfg.rollout)
    cfg = Config()
    cfg.rollout.static_decoding = "yes"
    with pytest.raises(ConfigError, match="rollout.static_decoding must be true, false or null"):
        validate_rollout(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_in_place_gives_the_plain_formulas_tokens_and_log_probs(dtype):
    """next_tokens scales and sums in place (fewer [rows, vocabulary] copies): the same bits as written plainly."""
    from posttrain.rollout.sampling import filter_logits, next_tokens

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(64, 1000, generator=g)).to(dtype)
    u = torch.rand(64, generator=g)
    for top_k, top_p in ((-1, 1.0), (50, 1.0), (-1, 0.9)):
        params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=top_k, top_p=top_p)
        before = logits.clone()
        tok, lp = next_tokens(logits, params, u, True)
        assert torch.equal(logits, before)  # the caller's logits untouched
        scaled = logits.float() / 0.7
        log_p = torch.log_softmax(scaled, -1)
        kept = filter_logits(scaled, top_k, top_p)
        cdf = (log_p.exp() if kept is scaled else torch.softmax(kept, -1)).cumsum(-1)
        total = cdf[:, -1:]
        point = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        want = torch.searchsorted(cdf, point, right=True).squeeze(-1)
        assert torch.equal(tok, want) and torch.equal(lp, log_p.gather(-1, want[:, None]).squeeze(-1))
