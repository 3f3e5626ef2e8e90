"""How a LoRA policy reaches its rollout engine (rollout.lora_sync): the adapters applied (the hf
engine samples from the policy; vLLM gets a LoRA request naming a peft directory) or the base with
them merged in (a plain copy on hf; full weights into vLLM). vLLM itself needs a GPU: here a stand-in
records what posttrain hands it, and what it would load is loaded with peft and compared."""

import sys
import types

import pytest
import torch

pytest.importorskip("peft")

from posttrain.config import load_config  # noqa: E402
from posttrain.models.lora import LoraSettings  # noqa: E402
from posttrain.rollout.vllm import vllm_lora_rank  # noqa: E402
from posttrain.training.actor import UpdateSettings  # noqa: E402
from posttrain.worker.verbs import Worker  # noqa: E402
from posttrain.worker.spec import RolloutSpec, WorkerSpec  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def moved_adapters(policy, seed=0):
    """Give the adapters' B matrices values (fresh ones are 0: base and policy would agree)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def spec(model_dir, sync, rollout="hf", **kw):
    return WorkerSpec(model_dir=str(model_dir), update=UpdateSettings(mini_batch_size=4, micro_batch_size=4),
                      rollout=RolloutSpec(name=rollout, **kw), lora=LoraSettings(rank=8, alpha=16, sync=sync))


def test_the_default_is_applied_adapters_on_hf_and_merged_weights_on_vllm():
    from posttrain.driver.settings import lora_settings

    hf = load_config(None, ["model.path=/m", "model.lora_rank=8"])
    assert lora_settings(hf).sync == "adapter"
    vllm = load_config(None, ["model.path=/m", "model.lora_rank=8", "rollout.name=vllm"])
    assert lora_settings(vllm).sync == "merged"
    chosen = load_config(None, ["model.path=/m", "model.lora_rank=8", "rollout.name=vllm", "rollout.lora_sync=adapter"])
    assert lora_settings(chosen).sync == "adapter"
    with pytest.raises(Exception, match="rollout.lora_sync=both is not one of: adapter, merged"):
        load_config(None, ["model.path=/m", "model.lora_rank=8", "rollout.lora_sync=both"])
    assert [vllm_lora_rank(r) for r in (1, 8, 12, 32, 200)] == [8, 8, 16, 32, 256]


def test_hf_merged_copy_samples_from_base_plus_adapters(tiny_model_dir):
    applied = Worker(spec(tiny_model_dir, "adapter"))
    applied.setup()
    assert applied.engine.model is applied.policy  # no second copy

    w = Worker(spec(tiny_model_dir, "merged"))
    w.setup()
    assert w.engine.model is not w.policy and not hasattr(w.engine.model, "peft_config")  # a plain model
    moved_adapters(w.policy)
    assert not torch.allclose(logits(w.engine.model), logits(w.policy), atol=1e-4)  # not synced yet
    w.sync_weights()
    assert torch.allclose(logits(w.engine.model), logits(w.policy), atol=1e-5)
    trained = {id(p) for group in w.optimizer.param_groups for p in group["params"]}
    assert not trained & {id(p) for p in w.engine.model.parameters()}  # no optimizer holds the copy


class StandInLLM:
    """What posttrain calls on vllm.LLM, recorded."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.weights = kwargs, [], {}
        self.llm_engine = types.SimpleNamespace(remove_lora=lambda i: self.calls.append(("remove_lora", i)))

    def collective_rpc(self, name, args=()):
        self.calls.append((name,))
        if name == "load_posttrain_weights":  # a bucket, as safetensors bytes (rollout.vllm.pack_bucket)
            from safetensors.torch import load

            self.weights.update(load(args[0]))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.calls.append(("generate", lora_request))
        raise StopIteration  # what it samples is vLLM's business


@pytest.fixture
def stand_in_vllm(monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    vllm = types.ModuleType("vllm")
    vllm.LLM = StandInLLM
    vllm.SamplingParams = lambda **kw: kw
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    for name, module in {"vllm": vllm, "vllm.inputs": inputs, "vllm.lora": lora, "vllm.lora.request": request}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_vllm_gets_the_adapters_as_a_lora_request_that_peft_loads_as_the_policy(stand_in_vllm, tiny_model_dir):
    from pathlib import Path

    from peft import PeftModel

    from posttrain.models import load_model
    from posttrain.rollout.base import SamplingParams

    w = Worker(spec(tiny_model_dir, "adapter", rollout="vllm", engine_kwargs={"load_format": "dummy"},
                    weights_from_policy=True, free_cache_engine=False))
    w.setup()
    llm = w.engine.llm
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_lora_rank"], llm.kwargs["max_loras"]) == (True, 8, 1)
    assert not any(c[0] == "load_posttrain_weights" for c in llm.calls)  # the base stays as vLLM loaded it
    first = w.engine.lora_request
    assert first.lora_int_id == 1 and Path(first.lora_path, "adapter_config.json").is_file()

    moved_adapters(w.policy, seed=1)
    w.sync_weights()
    second = w.engine.lora_request
    assert second.lora_int_id == 2 and ("remove_lora", 1) in llm.calls and not Path(first.lora_path).exists()
    with pytest.raises(StopIteration):
        w.engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, n=1))
    assert llm.calls[-1] == ("generate", second)  # every request applies the newest adapters
    served = PeftModel.from_pretrained(load_model(tiny_model_dir), second.lora_path)  # what vLLM would load
    assert torch.allclose(logits(served), logits(w.policy), atol=1e-5)
    w.engine.shutdown()
    assert not Path(second.lora_path).exists()


def test_vllm_merged_gets_the_bases_names_with_the_adapters_merged_in(stand_in_vllm, tiny_model_dir):
    w = Worker(spec(tiny_model_dir, "merged", rollout="vllm", engine_kwargs={"load_format": "dummy"},
                    weights_from_policy=True, free_cache_engine=False))
    w.setup()
    llm = w.engine.llm
    assert "enable_lora" not in llm.kwargs  # vLLM serves a plain model
    moved_adapters(w.policy, seed=2)
    llm.weights.clear()
    w.sync_weights()
    merged = {k: v.clone() for k, v in w.policy.merge_and_unload().state_dict().items()}  # peft's own merge
    assert set(llm.weights) == set(merged) and not any("lora" in k for k in llm.weights)
    for name, tensor in merged.items():
        assert torch.allclose(llm.weights[name], tensor, atol=1e-6), name


def test_a_sharded_lora_checkpoint_exports_merged_and_as_an_adapter(tmp_path, tiny_model_dir):
    """A sharded (FSDP2) LoRA run's checkpoint holds the whole adapted model's shards: export builds the
    run's base with its adapters in one process, fills it from them, and writes either form."""
    import json

    import torch.distributed.checkpoint as dcp
    import yaml
    from peft import PeftModel

    from posttrain.checkpoint.export import gather_adapters
    from posttrain.models import load_model
    from posttrain.models.lora import add_adapters

    trained = add_adapters(load_model(tiny_model_dir), LoraSettings(rank=4, alpha=8))
    moved_adapters(trained, seed=3)
    ckpt = tmp_path / "global_step_2"
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(ckpt / "actor_dcp"), no_dist=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump({"model": {"lora_rank": 4, "lora_alpha": 8}}))
    (ckpt / "trainer_state.json").write_text(json.dumps({"model_dir": str(tiny_model_dir)}))
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    merged_dir.mkdir(), adapter_dir.mkdir()
    gather_adapters(ckpt, merged_dir, merge=True)
    gather_adapters(ckpt, adapter_dir, merge=False)
    assert (adapter_dir / "adapter_config.json").is_file() and not (adapter_dir / "model.safetensors").exists()
    from safetensors.torch import load_file

    base = load_model(tiny_model_dir)
    merged = base.__class__(base.config)
    merged.load_state_dict(load_file(merged_dir / "model.safetensors"), strict=False)
    merged.tie_weights()
    adapted = PeftModel.from_pretrained(load_model(tiny_model_dir), str(adapter_dir))
    want = logits(trained)
    assert torch.allclose(logits(merged.eval()), want, atol=1e-5)
    assert torch.allclose(logits(adapted), want, atol=1e-5)
    assert not torch.allclose(logits(base), want, atol=1e-4)
