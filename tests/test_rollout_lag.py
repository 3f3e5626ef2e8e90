"""A controlled rollout/training mismatch: rollout.stale_updates=k samples with the policy's weights of k updates
ago, rollout.dtype samples from a copy of the policy in another dtype (worker/, rollout/weights.py)."""

import sys
import types

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.driver.settings import worker_spec
from posttrain.training.actor import UpdateSettings
from posttrain.worker.verbs import Worker
from posttrain.worker.spec import RolloutSpec, WorkerSpec

PROMPTS = [[5 + i, 6, 7 + i % 3] for i in range(4)]


def overrides(model_dir, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", "data.train_batch_size=4", "data.max_response_length=4", "rollout.n=2",
            "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "actor.lr=1e-2",
            "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false", *extra]


def make_worker(model_dir, *extra: str) -> Worker:
    w = Worker(worker_spec(load_config(None, overrides(model_dir, *extra)), str(model_dir), None, "cpu", 4))
    w.setup()
    return w


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def train_round(w: Worker, seed: int) -> RolloutBatch:
    """Sample, one PPO update on random advantages, sync: one step of the loop."""
    out = w.generate(PROMPTS, SamplingParams(max_new_tokens=4, n=2, logprobs=True, ignore_eos=True))
    batch = RolloutBatch.from_rollout(out, 2, ["arith"] * 4, ["0"] * 4, [{}] * 4, [""] * 8)
    batch.old_log_probs = w.compute_log_probs(batch)
    torch.manual_seed(seed)
    batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
    w.train_step(batch)
    w.sync_weights()
    return batch


def test_stale_updates_k_samples_with_the_weights_of_k_updates_ago(trained_tiny_model_dir):
    w = make_worker(trained_tiny_model_dir, "rollout.stale_updates=2")
    trained = {id(p) for group in w.optimizer.param_groups for p in group["params"]}
    assert w.engine.model is not w.policy and not trained & {id(p) for p in w.engine.model.parameters()}
    versions = [weights(w.policy)]  # versions[i]: the policy after i updates
    assert same(weights(w.engine.model), versions[0])
    for step in range(1, 4):
        train_round(w, step)
        versions.append(weights(w.policy))
        assert not same(versions[step], versions[step - 1])  # the update moved the policy
        # before 2 updates: the starting weights; then those of 2 updates ago
        assert same(weights(w.engine.model), versions[max(step - 2, 0)]), step
    assert len(w.history.versions) == 3


def test_validation_samples_with_the_policy_s_weights_now_and_the_lag_resumes_after(trained_tiny_model_dir):
    """A stale engine is a training-time mismatch: validation scores the policy as it is, then the engine goes
    back to the weights of k updates ago."""
    w = make_worker(trained_tiny_model_dir, "rollout.stale_updates=2")
    versions = [weights(w.policy)]
    for step in (1, 2, 3):
        train_round(w, step)
        versions.append(weights(w.policy))
    assert same(weights(w.engine.model), versions[1])
    w.validation_weights(True)
    assert same(weights(w.engine.model), versions[3])
    w.validation_weights(False)
    assert same(weights(w.engine.model), versions[1])
    assert len(w.history.versions) == 3


def test_after_a_resume_a_lagging_engine_starts_from_the_resumed_weights(tmp_path, trained_tiny_model_dir):
    """The snapshots are not checkpointed: a resumed run's engine samples from the resumed weights until k new
    updates have happened."""
    w = make_worker(trained_tiny_model_dir, "rollout.stale_updates=2")
    for step in (1, 2):
        train_round(w, step)
    w.save_shards(str(tmp_path / "ckpt"))
    resumed = make_worker(trained_tiny_model_dir, "rollout.stale_updates=2")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert same(weights(resumed.policy), weights(w.policy)) and len(resumed.history.versions) == 1
    assert same(weights(resumed.engine.model), weights(w.policy))


def test_stale_updates_zero_samples_from_the_policy_itself(trained_tiny_model_dir):
    w = make_worker(trained_tiny_model_dir)
    assert w.history is None and w.engine.model is w.policy
    train_round(w, 1)
    assert w.engine.model is w.policy


def test_a_lagging_lora_engine_holds_the_merged_weights_of_k_updates_ago(trained_tiny_model_dir):
    pytest.importorskip("peft")
    from posttrain.models.lora import lora_scaling, merged_weights
    from posttrain.rollout.weights import named_full_weights

    w = make_worker(trained_tiny_model_dir, "model.lora_rank=4", "model.lora_alpha=8", "rollout.stale_updates=1")
    assert w.merged_rollout and not hasattr(w.engine.model, "peft_config")  # a plain model

    def merged():
        return {k: v.clone() for k, v in merged_weights(named_full_weights(w.policy), lora_scaling(w.policy))}

    versions = [merged()]
    for step in range(1, 3):
        train_round(w, step)
        versions.append(merged())
        assert not same(versions[step], versions[step - 1])
        assert same(weights(w.engine.model), versions[step - 1]), step


def test_an_engine_with_weights_of_its_own_starts_from_the_starting_adapters_not_the_base(
        tmp_path, trained_tiny_model_dir):
    """model.lora_adapter_path (or a resumed checkpoint's policy): the merged hf engine is a plain base model,
    so the starting weights are pushed into it at setup, not one step late."""
    pytest.importorskip("peft")
    from posttrain.models.lora import lora_scaling, merged_weights
    from posttrain.rollout.weights import named_full_weights

    lora = ("model.lora_rank=4", "model.lora_alpha=8", "rollout.lora_sync=merged")
    trained = make_worker(trained_tiny_model_dir, *lora)
    train_round(trained, 1)
    trained.policy.save_pretrained(str(tmp_path / "adapters"))
    w = make_worker(trained_tiny_model_dir, *lora, f"model.lora_adapter_path={tmp_path / 'adapters'}")
    start = {k: v.clone() for k, v in merged_weights(named_full_weights(w.policy), lora_scaling(w.policy))}
    assert not same(start, weights(make_worker(trained_tiny_model_dir).policy))  # the adapters change the weights
    assert same(weights(w.engine.model), start)


def test_a_bfloat16_rollout_samples_from_a_bf16_copy_of_the_float32_policy(trained_tiny_model_dir):
    w = make_worker(trained_tiny_model_dir, "rollout.dtype=bf16", "rollout.calculate_log_probs=true")
    assert w.rollout_dtype == "bfloat16" and w.history is None
    assert {p.dtype for p in w.engine.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in w.policy.parameters()} == {torch.float32}
    train_round(w, 1)
    policy = weights(w.policy)
    assert same(weights(w.engine.model), {k: v.to(torch.bfloat16) for k, v in policy.items()})
    batch = train_round(w, 2)  # sampled by the bf16 copy of the weights after the first update
    rollout, mask = batch.rollout_log_probs, batch.response_mask.bool()
    assert rollout.dtype == torch.float32 and rollout[mask].isfinite().all()
    # the policy's float32 log-probs of the same tokens, before the second update: near, but not equal
    gap = (rollout - batch.old_log_probs)[mask].abs()
    assert 0 < gap.mean() < 0.05 and gap.max() < 0.5, (gap.mean(), gap.max())


def test_an_engine_in_a_dtype_of_its_own_is_not_autocast(trained_tiny_model_dir):
    """Training autocasts to bf16 (actor.mixed_precision.param_dtype); a float32 rollout computes in float32."""
    w = make_worker(trained_tiny_model_dir, "actor.mixed_precision.param_dtype=bfloat16", "rollout.dtype=float32")
    assert w.rollout_dtype == "float32" and w.engine.model is not w.policy
    seen = []
    w.engine.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    w.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert seen and set(seen) == {torch.float32}
    # a rollout.dtype equal to the compute dtype changes nothing: the policy's own module, autocast
    same_dtype = make_worker(trained_tiny_model_dir, "actor.mixed_precision.param_dtype=bfloat16",
                             "rollout.dtype=bfloat16")
    assert same_dtype.rollout_dtype is None and same_dtype.engine.model is same_dtype.policy


class StandInLLM:
    """vllm.LLM as far as loading weights goes: its arguments and the weights posttrain hands it, recorded."""

    def __init__(self, **kwargs):
        self.kwargs, self.weights = kwargs, {}

    def collective_rpc(self, name, args=()):
        if name == "load_posttrain_weights":  # a bucket, as safetensors bytes (rollout.vllm.pack_bucket)
            from safetensors.torch import load

            self.weights.update(load(args[0]))

    def reset_prefix_cache(self):
        pass


def test_a_lagging_vllm_engine_loads_the_oldest_snapshot_in_its_dtype(monkeypatch, trained_tiny_model_dir):
    """vLLM needs a GPU: a stand-in records what it is given (as in test_lora_sync)."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=StandInLLM))
    w = Worker(WorkerSpec(model_dir=str(trained_tiny_model_dir), update=UpdateSettings(mini_batch_size=4, micro_batch_size=4),
                          rollout=RolloutSpec(name="vllm", engine_kwargs={"load_format": "dummy"}, dtype="bfloat16",
                                              weights_from_policy=True, free_cache_engine=False, stale_updates=2)))
    w.setup()
    llm = w.engine.llm
    assert llm.kwargs["dtype"] == "bfloat16"
    versions = [weights(w.policy)]
    assert same(llm.weights, {k: v.to(torch.bfloat16) for k, v in versions[0].items()})  # pushed at start
    for step in range(1, 4):
        with torch.no_grad():
            for p in w.policy.parameters():
                p.add_(0.01 * step)
        versions.append(weights(w.policy))
        llm.weights.clear()
        w.sync_weights()
        assert same(llm.weights, {k: v.to(torch.bfloat16) for k, v in versions[max(step - 2, 0)].items()}), step


def test_vllm_takes_rollout_dtype_as_its_engine_dtype_and_merged_lora_weights_when_lagging(trained_tiny_model_dir):
    def spec(*extra):
        return worker_spec(load_config(None, overrides(trained_tiny_model_dir, "rollout.name=vllm", *extra)),
                           str(trained_tiny_model_dir), None, "cpu", 4)

    assert Worker(spec("rollout.dtype=bf16")).engine_dtype == "bfloat16"
    assert Worker(spec()).engine_dtype == "float32"
    assert spec("rollout.stale_updates=4").rollout.stale_updates == 4
    lora = ("model.lora_rank=4", "rollout.lora_sync=adapter")
    assert not Worker(spec(*lora)).merged_rollout
    assert Worker(spec(*lora[:1], "rollout.stale_updates=1")).merged_rollout


@pytest.mark.parametrize("extra, message", [
    (["rollout.dtype=int8"], r"rollout.dtype=int8 is not a dtype the rollout engine takes: set bfloat16"),
    (["rollout.stale_updates=-1"], r"rollout.stale_updates must be an integer >= 0 .*got -1"),
    (["model.lora_rank=4", "rollout.lora_sync=adapter", "rollout.stale_updates=2"],
     r"rollout.lora_sync=adapter with rollout.stale_updates: .* set rollout.lora_sync=merged or leave it null"),
])
def test_bad_rollout_lag_settings_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.path=/m", *extra])


def test_verl_dtype_spellings_are_spelled_out():
    assert load_config(None, ["model.path=/m", "actor_rollout_ref.rollout.dtype=bf16"]).rollout.dtype == "bfloat16"
