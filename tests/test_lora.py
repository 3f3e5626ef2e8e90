"""LoRA (model.lora_rank > 0, peft): only the adapters train, the reference is
the base with the adapters off (no second copy), checkpoints hold the
adapters and resume exactly, merged weights equal peft's merge."""

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from posttrain.driver.build import build_run  # noqa: E402
from posttrain.config import load_config  # noqa: E402
from posttrain.driver.loop import train  # noqa: E402
from posttrain.models.lora import LoraSettings, add_adapters, base_only, lora_scaling, merged_weights  # noqa: E402
from posttrain.driver.settings import worker_spec  # noqa: E402
from posttrain.worker.verbs import Worker  # noqa: E402

from helpers import comparable, resume_overrides  # noqa: E402

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear"]


def test_verls_lora_keys_load_and_take_effect():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = load_config(None, ["model.path=/m", "actor_rollout_ref.model.lora_rank=32",
                               "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.model.target_modules=all-linear"])
    spec = worker_spec(c, "/m", None, "cpu", 1)
    assert spec.lora == LoraSettings(rank=32, alpha=32, target_modules="all-linear")
    nested = load_config(None, ["model.path=/m", "actor_rollout_ref.model.lora.rank=16",
                                "actor_rollout_ref.model.lora.alpha=8", "actor_rollout_ref.model.lora.dropout=0.05"])
    assert (nested.model.lora_rank, nested.model.lora_alpha, nested.model.lora_dropout) == (16, 8, 0.05)
    assert worker_spec(load_config(None, ["model.path=/m"]), "/m", None, "cpu", 1).lora is None
    with pytest.warns(UserWarning, match="model.lora_alpha: settings of LoRA .off: model.lora_rank=0"):
        load_config(None, ["model.path=/m", "actor_rollout_ref.model.lora_alpha=32"])


def test_only_adapters_train_and_the_reference_is_the_base(tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", *LORA, "actor.use_kl_loss=True", "actor.lr=1e-2",
                             "rollout.n=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                             "actor.ppo_micro_batch_size=4"])
    w = Worker(worker_spec(cfg, str(tiny_model_dir), None, "cpu", 4))
    w.setup()
    assert w.ref is None  # no second copy: the reference is the policy with its adapters off
    trainable = {n for n, p in w.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = sum(p.numel() for g in w.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for n, p in w.policy.named_parameters() if n in trainable)
    base = {n: p.detach().clone() for n, p in w.policy.named_parameters() if n not in trainable}
    from posttrain.driver.batch import RolloutBatch
    from posttrain.rollout.base import SamplingParams

    out = w.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=4, n=2, temperature=1.0))
    batch = RolloutBatch.from_rollout(out, 2, ["arith"] * 2, ["0"] * 2, [{}] * 2, [""] * 4)
    batch.ref_log_probs = w.compute_log_probs(batch, "ref")
    mask = batch.response_mask.bool()
    assert torch.allclose(w.compute_log_probs(batch, "policy")[mask], batch.ref_log_probs[mask])  # B = 0 at first
    batch.advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]) * batch.response_mask
    for _ in range(3):
        w.train_step(batch)
    moved = w.compute_log_probs(batch, "policy")
    assert (moved[mask] - batch.ref_log_probs[mask]).abs().max() > 1e-3  # the adapters learned
    assert torch.allclose(w.compute_log_probs(batch, "ref")[mask], batch.ref_log_probs[mask])  # the base did not
    assert all(torch.equal(p, base[n]) for n, p in w.policy.named_parameters() if n in base)


def test_merged_weights_equal_peft_merge(random_qwen2):
    model = add_adapters(copy.deepcopy(random_qwen2), LoraSettings(rank=4, alpha=8))
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_()  # non-zero adapters
    merged = dict(merged_weights(model.state_dict().items(), lora_scaling(model)))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    assert all(torch.allclose(merged[k], want[k], atol=1e-6) for k in want)
    with base_only(model):
        x = torch.tensor([[3, 4, 5]])
        assert torch.allclose(model(input_ids=x).logits, random_qwen2(input_ids=x).logits, atol=1e-6)


def test_checkpoint_holds_the_adapters_and_resume_is_exact(tmp_path, data, trained_tiny_model_dir):
    def run(run_dir, steps, save):
        return train(build_run(load_config(None, resume_overrides(trained_tiny_model_dir, data, run_dir, steps,
                                                                  f"trainer.save_freq={save}", *LORA))))

    run(tmp_path / "whole", 6, 6)
    run(tmp_path / "split", 3, 3)
    run(tmp_path / "split", 6, 6)
    ckpt = tmp_path / "whole" / "checkpoints" / "global_step_6" / "actor"
    assert not (ckpt / "model.safetensors").exists()
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    a = load_file(ckpt / "adapter_model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoints" / "global_step_6" / "actor" / "adapter_model.safetensors")
    assert a and all("lora_" in k for k in a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 1e-4  # the adapters trained
    whole, split = comparable(tmp_path / "whole"), comparable(tmp_path / "split")
    split[3] = {k: v for k, v in split[3].items() if not k.startswith("val/")}
    whole[3] = {k: v for k, v in whole[3].items() if not k.startswith("val/")}
    assert whole == split


def test_export_merged_and_as_an_adapter_reload_alike(tmp_path, data, trained_tiny_model_dir):
    """`posttrain export` of a LoRA checkpoint: a plain model directory with the
    adapters merged (transformers alone loads it) or, with --adapter, a peft
    directory; both give the policy's greedy text."""
    from peft import PeftModel

    from posttrain.checkpoint.export import export_checkpoint
    from posttrain.errors import CheckpointError
    from posttrain.models.loader import load_model

    run_dir = tmp_path / "run"
    train(build_run(load_config(None, resume_overrides(trained_tiny_model_dir, data, run_dir, 2, "trainer.save_freq=2",
                                                       "actor.lr=5e-2", *LORA))))
    ckpt = run_dir / "checkpoints" / "global_step_2"
    merged_dir = export_checkpoint(ckpt, tmp_path / "merged")
    adapter_dir = export_checkpoint(ckpt, tmp_path / "adapter", adapter=True)
    assert (merged_dir / "model.safetensors").is_file() and not (merged_dir / "adapter_config.json").exists()
    assert (adapter_dir / "adapter_model.safetensors").is_file() and not (adapter_dir / "model.safetensors").exists()
    merged = load_model(merged_dir)
    adapted = PeftModel.from_pretrained(load_model(trained_tiny_model_dir), str(adapter_dir))
    base = load_model(trained_tiny_model_dir)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.allclose(merged(input_ids=x).logits, adapted(input_ids=x).logits, atol=1e-5)
    assert not torch.allclose(merged(input_ids=x).logits, base(input_ids=x).logits, atol=1e-3)  # it learned
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(merged.generate(x, **greedy), adapted.generate(x, **greedy))
    with pytest.raises(CheckpointError, match="export it without --adapter"):
        train(build_run(load_config(None, resume_overrides(trained_tiny_model_dir, data, tmp_path / "full", 1,
                                                           "trainer.save_freq=1"))))
        export_checkpoint(tmp_path / "full" / "checkpoints" / "global_step_1", tmp_path / "x", adapter=True)
