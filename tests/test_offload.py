"""verl's offload keys: FSDP2's CPU offload of parameters, the optimizer's
state on the CPU between updates, and the refusal where neither can happen."""

import subprocess
import sys

import pytest
import torch

from posttrain.driver.placement import check_offload
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.driver.settings import critic_spec, worker_spec
from posttrain.training.actor import move_optimizer_state

SHARDED_STEP = """
import copy, sys, tempfile, torch, torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM
from torch.distributed.fsdp import CPUOffloadPolicy
from posttrain.training.parallelize import parallelize
from posttrain.rollout.weights import named_full_weights
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rdzv", rank=0, world_size=1)
torch.manual_seed(0)
base = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
x = torch.randint(0, 40, (2, 8))
after = []
for offload, prefetch in ((False, False), (True, False), (False, True)):
    m = parallelize(copy.deepcopy(base), offload_params=offload, forward_prefetch=prefetch)
    policy = m._get_fsdp_state()._fsdp_param_group.offload_policy
    assert isinstance(policy, CPUOffloadPolicy) is offload, policy
    first, second = m.model.layers
    assert first._get_fsdp_state()._states_to_forward_prefetch == ([second._get_fsdp_state()] if prefetch else [])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(input_ids=x, labels=x).loss.backward()
    opt.step()
    after.append({k: v.clone() for k, v in named_full_weights(m)})
worst = max((after[0][k] - other[k]).abs().max().item() for k in after[0] for other in after[1:])
moved = max((after[0][k] - v).abs().max().item() for k, v in base.state_dict().items())
print(worst, moved)
"""


def test_fsdp2_param_offload_and_forward_prefetch_are_wired_and_change_no_update():
    """parallelize(offload_params=True) shards with CPUOffloadPolicy, and
    forward_prefetch makes each layer prefetch the next (one gloo rank here:
    the wiring; the memory and time they save need GPUs, tests/test_gpu.py)."""
    done = subprocess.run([sys.executable, "-c", SHARDED_STEP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    worst, moved = map(float, done.stdout.split())
    assert moved > 1e-3 and worst == 0.0


def test_verls_offload_keys_reach_every_model():
    c = load_config(None, ["model.path=/m", "algorithm.adv_estimator=gae",
                           "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                           "actor_rollout_ref.ref.fsdp_config.param_offload=True",
                           "critic.model.fsdp_config.param_offload=True", "critic.model.fsdp_config.optimizer_offload=True",
                           "critic.model.use_remove_padding=False"])
    spec = worker_spec(c, "/m", None, "cuda", total_steps=1)
    assert spec.param_offload and spec.optimizer_offload and spec.ref.param_offload
    assert spec.critic.param_offload and spec.critic.optimizer_offload
    assert spec.update.remove_padding and not critic_spec(c, "/m", 1).update.remove_padding  # the critic's own
    check_offload(spec, sharded=True)  # FSDP2 workers: offloaded
    with pytest.raises(ConfigError, match="actor.param_offload, ref.param_offload, critic.model.param_offload.*"
                                          "one process, unsharded: run FSDP2 workers"):
        check_offload(spec, sharded=False)
    spec.device = "cpu"
    check_offload(spec, sharded=False)  # on the CPU the parameters are in CPU memory already


def test_optimizer_state_moves_to_the_cpu_between_updates_and_back(monkeypatch, tiny_model_dir):
    from posttrain.worker import verbs as worker_module
    from posttrain.training.actor import UpdateSettings
    from posttrain.worker.verbs import Worker
    from posttrain.worker.spec import WorkerSpec

    calls = []
    monkeypatch.setattr(worker_module, "move_optimizer_state", lambda opt, to_cpu: calls.append(to_cpu))
    w = Worker(WorkerSpec(model_dir=str(tiny_model_dir), update=UpdateSettings(mini_batch_size=4, micro_batch_size=4),
                          optimizer_offload=True))
    w.setup()
    from test_gpu import rollout_batch  # noqa: the GPU tests' batch maker

    w.train_step(rollout_batch(w, n=1, tokens=3))
    assert calls == [False, True]  # to the parameters' device before the update, to the CPU after


def test_move_optimizer_state_keeps_values_and_adams_step_counter():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    move_optimizer_state(opt, to_cpu=True)
    move_optimizer_state(opt, to_cpu=False)
    assert all(torch.equal(before[k], v) for k, v in opt.state[p].items())
    assert opt.state[p]["step"].device.type == "cpu"
    opt.step()  # still steps


def test_verls_fsdp_and_vision_keys_reach_the_worker():
    c = load_config(None, ["model.path=/m", "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
                           "actor_rollout_ref.ref.fsdp_config.forward_prefetch=True",
                           "actor_rollout_ref.actor.freeze_vision_tower=True"])
    spec = worker_spec(c, "/m", None, "cpu", total_steps=1)
    assert spec.forward_prefetch and spec.ref.forward_prefetch and spec.freeze_vision_tower
    with pytest.warns(UserWarning, match="actor.use_orig_params: verl's settings"):
        load_config(None, ["model.path=/m", "actor_rollout_ref.actor.fsdp_config.use_orig_params=True"])


def test_freeze_vision_tower_stops_only_the_image_encoder(random_qwen2):
    """A vision-language model's encoder (Qwen-VL's `visual`, LLaVA's `vision_tower`)
    keeps its weights and gets no optimizer state; a text-only model has none to freeze."""
    import copy

    from posttrain.models.loader import freeze_vision_tower
    from posttrain.training.actor import make_optimizer

    model = copy.deepcopy(random_qwen2)
    assert freeze_vision_tower(model) == 0 and all(p.requires_grad for p in model.parameters())
    model.model.visual = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 32))
    total = sum(p.numel() for p in model.parameters())
    assert freeze_vision_tower(model) == 4 * 8 + 8 + 8 * 32 + 32
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [
        "model.visual.0.weight", "model.visual.0.bias", "model.visual.1.weight", "model.visual.1.bias"]
    opt = make_optimizer(model, 1e-3, 0.0, (0.9, 0.999))
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == total - 328


def test_verls_mixed_precision_and_model_dtype_reach_the_worker():
    c = load_config(None, ["model.path=/m", "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
                           "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16",
                           "+actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32"])
    assert (c.actor.mixed_precision.param_dtype, c.actor.mixed_precision.reduce_dtype) == ("bfloat16", "bfloat16")
    spec = worker_spec(c, "/m", None, "cpu", total_steps=1)
    assert (spec.mixed_precision, spec.reduce_dtype) == ("bfloat16", "bfloat16")  # asked for: bf16 even on a CPU
    default = load_config(None, ["model.path=/m"])
    assert worker_spec(default, "/m", None, "cuda", 1).mixed_precision == "bfloat16"  # GPUs: bf16 over fp32
    assert worker_spec(default, "/m", None, "cpu", 1).mixed_precision is None
    c = load_config(None, ["model.path=/m", "+actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16"])
    assert c.model.dtype == "bfloat16" and worker_spec(c, "/m", None, "cuda", 1).mixed_precision is None
    with pytest.warns(UserWarning, match="actor.mixed_precision.buffer_dtype=bfloat16: verl's settings"):
        load_config(None, ["model.path=/m", "actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=bf16"])
    with pytest.raises(ConfigError, match="actor.mixed_precision.param_dtype=int8 is not one of: float32"):
        load_config(None, ["model.path=/m", "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=int8"])


def test_an_offloaded_fsdp2_model_computes_on_its_meshs_device(monkeypatch):
    """FSDP2's CPU offload leaves the parameters on the CPU while the passes run on
    the mesh's GPU: the batch must go there, not where the parameters are (the real
    thing runs in tests/test_gpu.py's world-size-1 offload case)."""
    from posttrain.training.logprobs import compute_device

    class Mesh:
        device_type = "cuda"

    model = torch.nn.Linear(2, 2)
    assert compute_device(model) == torch.device("cpu")  # a plain module: where its parameters are
    model.weight.device_mesh = Mesh()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert compute_device(model) == torch.device("cuda", 3)
    Mesh.device_type = "cpu"  # gloo: computes where its parameters are
    assert compute_device(model) == torch.device("cpu")
