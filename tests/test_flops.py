"""FLOP counts for MFU: a hand count of a small config, checked against
torch's own FLOP counter on a real Qwen2 forward, backward and rollout."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from posttrain.metrics import flops as F
from posttrain.metrics.flops import ModelFlops, mfu

# h=64, L=2, 4 heads of 16, 2 key/value heads, MLP 128, vocabulary 100
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 100}


def test_hand_count_of_a_small_config():
    f = ModelFlops.from_config(SMALL)
    # per layer: q 64*64 + k,v 2*64*(2*16) + o 64*64 + MLP 3*64*128 = 4096 + 4096 + 4096 + 24576 = 36864
    # N = 2 * 36864 + LM head 64*100 = 80128; attention width L*nh*hd = 2*4*16 = 128
    assert f.matmul_params == 80128 and f.attn_width == 128
    # a 10-token sequence: forward 2*80128*10 + 4*128*10*10 = 1,602,560 + 51,200; backward twice that
    assert f.forward(10, 10) == 1_653_760
    assert f.training(torch.tensor([10])) == 3 * 1_653_760
    # rollout of 3 tokens after a 5-token prompt: prefill 2N*5 + 4*128*25 less the LM head on the 4 positions
    # before the last (only the last predicts), then 2 tokens fed back with 6 and 7 keys
    prefill = 2 * 80128 * 5 - 2 * 6400 * 4 + 4 * 128 * 25
    expected = prefill + (2 * 80128 + 4 * 128 * 6) + (2 * 80128 + 4 * 128 * 7)
    assert f.rollout(torch.tensor([5]), torch.tensor([3])) == expected
    assert f.rollout(torch.tensor([5]), torch.tensor([0])) == prefill  # nothing generated


def test_head_dim_moe_and_multimodal_configs():
    f = ModelFlops.from_config({**SMALL, "head_dim": 8})  # q, o: 64*32; k, v: 64*16 each
    assert f.matmul_params == 2 * (2 * 64 * 32 + 2 * 64 * 16 + 3 * 64 * 128) + 6400 and f.attn_width == 2 * 4 * 8
    moe = {**SMALL, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_experts": 8,
           "shared_expert_intermediate_size": 16}
    # MLP per layer: 3*64*(2*32 + 16) experts a token visits + 64*8 router
    assert ModelFlops.from_config(moe).matmul_params == 2 * (3 * 4096 + 3 * 64 * 80 + 64 * 8) + 6400
    assert ModelFlops.from_config({"text_config": SMALL}) == ModelFlops.from_config(SMALL)
    with pytest.raises(KeyError, match="intermediate_size"):
        ModelFlops.from_config({k: v for k, v in SMALL.items() if k != "intermediate_size"})


def qwen2(attn):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SMALL, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation=attn,
                      eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg), cfg


def counted(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


# Eager attention: torch's counter sees its matmuls, not the CPU kernel behind scaled_dot_product_attention.
def test_forward_matches_torch_flop_counter():
    model, cfg = qwen2("eager")
    ids = torch.randint(2, 100, (3, 12))
    ours = ModelFlops.from_config(cfg.to_dict()).training(torch.tensor([12, 12, 12])) / 3
    with torch.no_grad():
        theirs = counted(lambda: model(input_ids=ids))
    assert abs(ours - theirs) / theirs < 0.01, (ours, theirs)


def test_forward_and_backward_match_torch_flop_counter():
    model, cfg = qwen2("eager")
    ids = torch.randint(2, 100, (2, 16))
    ours = ModelFlops.from_config(cfg.to_dict()).training(torch.tensor([16, 16]))
    # the backward's input-gradient of the first layer is counted by torch too (embeddings have no matmul)
    theirs = counted(lambda: model(input_ids=ids).logits.sum().backward())
    assert abs(ours - theirs) / theirs < 0.01, (ours, theirs)


def test_rollout_matches_torch_flop_counter_on_the_hf_engine():
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine

    model, cfg = qwen2("eager")
    engine = HFRolloutEngine(model.eval(), eos_token_ids=[1], pad_token_id=0, progress=False)
    params = SamplingParams(max_new_tokens=7, n=1, temperature=1.0, ignore_eos=True)
    with torch.no_grad():
        theirs = counted(lambda: engine.generate([[5, 6, 7, 8, 9]], params))
    ours = ModelFlops.from_config(cfg.to_dict()).rollout(torch.tensor([5]), torch.tensor([7]))
    assert abs(ours - theirs) / theirs < 0.01, (ours, theirs)


def test_mfu_and_missing_peaks():
    assert mfu(2e12, 2.0, 1e12, devices=2) == 0.5
    assert mfu(2e12, 2.0, None) is None and mfu(2e12, 0.0, 1e12) is None


def test_gpu_peaks_by_name():
    assert F.gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert F.gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert F.gpu_peak_flops("NVIDIA H200") == 989e12
    assert F.gpu_peak_flops("NVIDIA A10G") == 70e12 and F.gpu_peak_flops("NVIDIA A10") == 125e12
    assert F.gpu_peak_flops("NVIDIA L40S") == 362e12 and F.gpu_peak_flops("NVIDIA L4") == 121e12
    assert F.gpu_peak_flops("Some Future Accelerator") is None


def test_cpu_peak_is_the_best_of_the_first_measurements_then_cached(tmp_path, monkeypatch):
    """One run start measures once; the first CPU_PEAK_MEASUREMENTS keep the best (a busy machine's low
    measurement is replaced by a quieter one), later starts read the cache."""
    measured = iter([0.5e11, 1.5e11, 1.4e11, 9e11])  # the first while the machine was busy
    calls = []

    def fake_measure(threads, dtype):
        calls.append(threads)
        return next(measured)

    monkeypatch.setattr(F, "measure_cpu_peak_flops", fake_measure)
    cache = tmp_path / "peak_flops.json"
    assert F.CPU_PEAK_MEASUREMENTS == 3
    assert [F.cpu_peak_flops(2, cache_file=cache) for _ in range(4)] == [0.5e11, 1.5e11, 1.5e11, 1.5e11]
    assert calls == [2, 2, 2]  # the fourth start trusts the cache
    assert json.loads(cache.read_text()) == {F.cpu_peak_key(2, torch.float32): {"peak": 1.5e11, "measurements": 3}}


def test_cpu_peak_cache_per_thread_count_old_entries_and_damage(tmp_path, monkeypatch):
    calls = []

    def fake_measure(threads, dtype):
        calls.append(threads)
        return 1.5e11

    monkeypatch.setattr(F, "measure_cpu_peak_flops", fake_measure)
    cache = tmp_path / "peak_flops.json"
    assert F.cpu_peak_flops(1, cache_file=cache) == 1.5e11 and calls == [1]
    cached = json.loads(cache.read_text())
    cached[F.cpu_peak_key(2, torch.float32)] = 0.6e11  # an older posttrain's entry: one measurement, a bare number
    cache.write_text(json.dumps(cached))
    assert F.cpu_peak_flops(2, cache_file=cache) == 1.5e11 and calls == [1, 2]  # measured again, the best kept
    assert len(json.loads(cache.read_text())) == 2
    cache.write_text("{not json")  # a damaged cache is measured again, not an error
    assert F.cpu_peak_flops(2, cache_file=cache) == 1.5e11 and calls == [1, 2, 2]


def test_a_step_faster_than_the_measured_peak_raises_it_and_asks_for_a_new_measurement(tmp_path, monkeypatch,
                                                                                      capsys):
    """A peak measured on a busy machine (0.5e11) against a step that computed 0.8e11 FLOP/s per device: MFU
    1.6 is impossible, so the step's rate becomes the peak (MFU 1 for it), cached, and the next run start
    measures again (keeping the best)."""
    from posttrain.metrics.logger import raise_measured_peak

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    key = F.cpu_peak_key(2, torch.float32)
    cache = tmp_path / "peak_flops.json"
    cache.write_text(json.dumps({key: {"peak": 0.5e11, "measurements": 3}}))
    assert raise_measured_peak({"perf/mfu/actor": 0.9, "perf/mfu/rollout": 0.4}, 0.5e11, [key]) is None
    assert raise_measured_peak({"perf/mfu/actor": 1.6, "perf/mfu/rollout": 0.4}, 0.5e11, [key]) == pytest.approx(0.8e11)
    assert "more than the CPU's measured peak" in capsys.readouterr().err
    assert json.loads(cache.read_text()) == {key: {"peak": pytest.approx(0.8e11), "measurements": 0}}
    monkeypatch.setattr(F, "measure_cpu_peak_flops", lambda threads, dtype: 1.5e11)
    assert F.cpu_peak_flops(2) == 1.5e11


def test_the_cpu_peak_is_the_fastest_matmul_of_known_flops(monkeypatch):
    """With a clock that says how long each timed matmul took: 2 n^3 FLOPs over the fastest of `reps`, with
    `threads` torch threads during the measurement and the caller's count after it, the global random
    state untouched."""
    import time as real_time
    from types import SimpleNamespace

    durations = iter([0.5, 0.25, 0.4, 0.3])  # seconds of the 4 timed matmuls: the fastest is the second
    now, threads_seen = [0.0], []

    def clock():  # called before and after each timed matmul
        threads_seen.append(torch.get_num_threads())
        if len(threads_seen) % 2 == 0:
            now[0] += next(durations)
        return now[0]

    monkeypatch.setattr(F, "time", SimpleNamespace(perf_counter=clock, time=real_time.time))
    before, rng = torch.get_num_threads(), torch.get_rng_state()
    want = 1 if before != 1 else 2
    assert F.measure_cpu_peak_flops(threads=want, n=64, reps=4) == 2 * 64 ** 3 / 0.25
    assert threads_seen == [want] * 8 and torch.get_num_threads() == before
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_real_cpu_measurement_agrees_with_its_own_wall_time():
    """A real measurement on a machine that may be busy: nothing about its speed is asserted, only what
    must hold however loaded it is. Its reps matmuls of 2 n^3 FLOPs each ran inside the call's wall time,
    so the fastest took at most wall / reps: the peak is at least reps x 2 n^3 / wall (a FLOP count or a
    time unit off by a factor fails this). Above: on x86 one float32 thread retires at most 2 AVX-512 FMAs
    of 16 lanes per cycle (64 FLOPs), at no more than 6 GHz."""
    import platform
    import time

    n, reps = 256, 8
    start = time.perf_counter()
    peak = F.measure_cpu_peak_flops(threads=1, n=n, reps=reps)
    wall = time.perf_counter() - start
    assert peak >= reps * 2 * n ** 3 / wall
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert peak <= 64 * 6e9
    else:  # Apple's matrix units run float32 matmuls far faster than a core's vector units
        assert peak < 1e13


def test_frozen_weights_count_one_backward_pass():
    """LoRA: the base's weight gradients are not computed, so a training pass is
    forward + one backward (the activations' gradients), 2/3 of a full one."""
    import dataclasses

    from posttrain.metrics.flops import ModelFlops

    full = ModelFlops(matmul_params=1000, attn_width=10)
    lora = dataclasses.replace(full, backward_factor=1.0)
    s = torch.tensor([4, 6])
    # forward: 2*1000*(4+6) + 4*10*(16+36) = 20000 + 2080 = 22080; x3 full, x2 frozen
    assert full.training(s) == 3 * 22080 and lora.training(s) == 2 * 22080
    g = torch.tensor([0, 0])
    assert lora.training_shared(torch.tensor([3, 3]), torch.tensor([2, 4]), g) == pytest.approx(
        2 / 3 * full.training_shared(torch.tensor([3, 3]), torch.tensor([2, 4]), g))


def test_only_a_measured_cpu_peak_is_raised_by_a_faster_step():
    from posttrain.driver.placement import measured_peaks

    cpu = [{"peak_key": "cpu|threads=2|float32"}, {"peak_key": "cpu|threads=2|float32"}]
    assert measured_peaks(None, cpu) == ["cpu|threads=2|float32"]
    assert measured_peaks(2e11, cpu) == []  # trainer.peak_flops: the user's number stands
    assert measured_peaks(None, [{"peak_key": None}, *cpu]) == []  # a GPU's peak comes from its table
