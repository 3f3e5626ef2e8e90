"""Worker groups on Ray: splitting batches, FSDP2 equal to one process,
the loop on 2 workers, sharded checkpoints, a worker killed mid-run."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.driver.batch import RolloutBatch
from posttrain.driver.build import build_run
from posttrain.checkpoint import list_checkpoints
from posttrain.config import load_config
from posttrain.distributed.balance import balanced_partition, minibatch_shards
from posttrain.rollout.base import concat_rollouts, even_chunks
from posttrain.driver.loop import train
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.weights import hf_name
from posttrain.driver.settings import worker_spec
from posttrain.worker.verbs import Worker

from helpers import POSTTRAIN, read_metrics, resume_overrides, sft_overrides, write_prompts, write_sft
from listeners import non_loopback_listeners, process_tree


# ---------------------------------------------------------------- plumbing (no Ray)

def test_balanced_partition_equal_counts_and_close_sums():
    assert balanced_partition([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]  # sums 6 and 6 (not 7 and 5)
    assert balanced_partition([3, 3, 3, 3, 3, 3], 3) == [[0, 3], [1, 4], [2, 5]]
    assert balanced_partition([9, 1, 1, 1], 1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="evenly"):
        balanced_partition([1, 2, 3], 2)


def test_even_chunks_and_minibatch_shards():
    assert [list(r) for r in even_chunks(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in even_chunks(1, 3)] == [[0], [], []]
    # two mini-batches of 4 rows; each worker gets 2 rows of each, in mini-batch order
    shards = minibatch_shards([1, 8, 2, 7, 5, 5, 5, 5], mini_batch_size=4, parts=2)
    assert shards == [[0, 1, 4, 6], [2, 3, 5, 7]]  # lengths 1+8 | 2+7, then 5+5 | 5+5


def test_concat_rollouts_repads_prompts_left_and_responses_right():
    a = RolloutOutput(torch.tensor([[7, 8]]), torch.tensor([[1, 1]]), torch.tensor([[3]]), torch.tensor([[1]]))
    b = RolloutOutput(torch.tensor([[0, 5, 6, 7]]), torch.tensor([[0, 1, 1, 1]]), torch.tensor([[4, 4, 9]]),
                      torch.tensor([[1, 1, 1]]))
    out = concat_rollouts([a, b], pad_token_id=0)
    assert out.prompt_ids.tolist() == [[0, 0, 7, 8], [0, 5, 6, 7]]
    assert out.prompt_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert out.response_ids.tolist() == [[3, 0, 0], [4, 4, 9]]
    assert out.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert out.truncated is None  # the parts did not say
    a.truncated, b.truncated = torch.tensor([False]), torch.tensor([True])
    assert concat_rollouts([a, b], pad_token_id=0).truncated.tolist() == [False, True]


def test_hf_names_drop_wrapper_parts():
    assert hf_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("_orig_mod.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert hf_name("lm_head.weight") == "lm_head.weight"


def test_uneven_mini_batches_over_workers_are_refused():
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="divisible by the 3 workers"):
        load_config(None, ["trainer.n_gpus_per_node=3", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                           "data.train_batch_size=8", "actor.ppo_micro_batch_size=2"])


# ---------------------------------------------------------------- on a Ray cluster

@pytest.fixture
def data(tmp_path):
    """The shared `data` fixture's 8 prompts, validated on the 8 after them."""
    write_prompts(tmp_path, 8, val=8)
    return tmp_path


def small(model, data, run_dir, steps, *extra):
    """The checkpoint tests' run on the CPU, in micro-batches of 2."""
    return resume_overrides(model, data, run_dir, steps, "trainer.device=cpu", *extra, micro_batch=2)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    from posttrain.distributed.cluster import connect

    connect(ray_cluster["address"])
    return ray_cluster


@pytest.mark.ray
@pytest.mark.parametrize("variant", ["plain", "ulysses", "tensor-parallel", "lora", "lora-merged"])
def test_two_workers_update_equals_one_process(cluster, tiny_model_dir, data, tmp_path, variant):
    """Same batch, same seed: log-probs, one PPO step (2 mini-batches x 2
    micro-batches, KL loss, entropy bonus) and a second step all match one
    process. With Ulysses both workers take the same rows, each half of every
    sequence's positions, for the actor, the reference and the critic; at TP=2 both take the same rows, each
    holding half of every layer and of the vocabulary (the critic's one-number head whole); with
    LoRA the sharded adapters train and the reference is the base (lora-merged: the rollout copies hold the
    base with the adapters merged in, gathered from the shards)."""
    from posttrain.distributed.group import WorkerGroup

    sequence_parallel = 2 if variant == "ulysses" else 1
    tensor_parallel = 2 if variant == "tensor-parallel" else 1
    extra = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"] if "lora" in variant else []
    extra += [f"actor.tensor_parallel_size={tensor_parallel}"]
    extra += ["rollout.lora_sync=merged"] if variant == "lora-merged" else []
    if variant == "tensor-parallel":  # 4 heads, 2 of keys and values (tiny_model_dir's 1 does not split)
        from posttrain.models.shipped import embedded_model

        tiny_model_dir = embedded_model()
    cfg = load_config(None, small(tiny_model_dir, data, tmp_path / "r", 2, "actor.entropy_coeff=0.01",
                                  "algorithm.use_kl_in_reward=False", "trainer.n_gpus_per_node=2",
                                  "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
                                  "critic.lr=1e-3",
                                  f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sequence_parallel}",
                                  *extra))
    spec = worker_spec(cfg, str(tiny_model_dir), None, "cpu", total_steps=2)
    local = Worker(spec)
    local.setup()
    group = WorkerGroup(spec, nnodes=1, per_node=2)
    try:
        assert [w["sequence_parallel"] for w in group.info] == [sequence_parallel] * 2
        assert [w["tensor_parallel"] for w in group.info] == [tensor_parallel] * 2
        prompts = [[5 + i, 6, 7 + i % 3] for i in range(8)]
        for step in range(2):
            out = local.generate(prompts, SamplingParams(max_new_tokens=5, n=4, temperature=1.0))
            batch = RolloutBatch.from_rollout(out, 4, ["arith"] * 8, ["0"] * 8, [{}] * 8, [""] * 32)
            ref_local = local.compute_log_probs(batch, "policy")
            ref_group = group.compute_log_probs(batch, "policy")
            assert torch.allclose(ref_local, ref_group, atol=1e-5)
            batch.old_log_probs = ref_local
            batch.ref_log_probs = local.compute_log_probs(batch, "ref")
            torch.manual_seed(step)
            batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
            m_local = local.train_step(batch)
            m_group = group.train_step(batch)
            assert m_group["actor/grad_norm"] == pytest.approx(m_local["actor/grad_norm"], rel=1e-4)
            # the critic: values, then one clipped value-loss update (2 mini-batches x 2 micro-batches)
            batch.values = local.compute_values(batch)
            # after a critic update at lr 1e-3 the workers' other summation orders show at 1e-4 (on an Intel CPU
            # under load MKL also picks its threads by the load: a run-to-run rounding of its own)
            assert torch.allclose(group.compute_values(batch), batch.values, atol=1e-4)
            batch.returns = torch.randn(batch.responses.shape) * batch.response_mask
            c_local, c_group = local.update_critic(batch), group.update_critic(batch)
            assert c_group["critic/grad_norm"] == pytest.approx(c_local["critic/grad_norm"], rel=1e-4)
            assert c_group["critic/vf_loss"] == pytest.approx(c_local["critic/vf_loss"], rel=1e-4)
            local.sync_weights()
            group.sync_weights()
            full = group.full_state_dict()
            own = dict(local.policy.state_dict())
            assert set(full) == set(own)
            moved = max((own[k] - full[k]).abs().max().item() for k in own)
            assert moved < 1e-5, f"step {step}: parameters differ by {moved}"
        batch.values = local.compute_values(batch)
        assert torch.allclose(group.compute_values(batch), batch.values, atol=1e-4)  # the critics moved alike
        # the workers' rollout copies were refreshed: greedy samples agree
        greedy = SamplingParams(max_new_tokens=5, n=1, temperature=0.0, do_sample=False)
        assert torch.equal(group.generate(prompts, greedy).response_ids, local.generate(prompts, greedy).response_ids)
    finally:
        group.shutdown()


@pytest.mark.ray
def test_two_workers_on_a_vision_language_model_equal_one_process(cluster, tmp_path):
    """A tiny Qwen2.5-VL on 2 FSDP2 workers: prompts with images go to the workers' rollout copies, the rows'
    image tensors travel with their halves of the batch; log-probs, a PPO step, the critic and the synced
    weights match one process."""
    from test_vision_model import batch_of, prompts_of

    from posttrain.distributed.group import WorkerGroup
    from posttrain.models.processor import load_processor
    from posttrain.tiny.vision import build_vlm_dir

    model_dir = build_vlm_dir(tmp_path / "vlm", "qwen2_5_vl", seed=5)
    processor = load_processor(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
                             "data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size=2",
                             "rollout.n=2", "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
                             "critic.lr=1e-3", f"trainer.run_dir={tmp_path / 'r'}"])
    spec = worker_spec(cfg, str(model_dir), None, "cpu", total_steps=1)
    local = Worker(spec)
    local.setup()
    group = WorkerGroup(spec, nnodes=1, per_node=2)
    try:
        prompts = prompts_of("qwen2_5_vl", processor, text_only=(1,))
        out = local.generate(prompts, SamplingParams(max_new_tokens=4, n=2, temperature=1.0))
        batch = batch_of(prompts, out, 2, local.policy)
        ref_local = local.compute_log_probs(batch, "policy")
        assert torch.allclose(group.compute_log_probs(batch, "policy"), ref_local, atol=1e-5)
        batch.old_log_probs = batch.ref_log_probs = ref_local
        torch.manual_seed(0)
        batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
        assert group.train_step(batch)["actor/grad_norm"] == pytest.approx(
            local.train_step(batch)["actor/grad_norm"], rel=1e-4)
        batch.values = local.compute_values(batch)
        assert torch.allclose(group.compute_values(batch), batch.values, atol=1e-5)
        local.sync_weights()
        group.sync_weights()
        full, own = group.full_state_dict(), dict(local.policy.state_dict())
        assert set(full) == set(own) and max((own[k] - full[k]).abs().max().item() for k in own) < 1e-5
        greedy = SamplingParams(max_new_tokens=4, n=1, temperature=0.0, do_sample=False)
        assert torch.equal(group.generate(prompts, greedy).response_ids, local.generate(prompts, greedy).response_ids)
    finally:
        group.shutdown()


@pytest.mark.ray
def test_a_group_of_one_worker_shards_and_updates_as_one_process(cluster, tiny_model_dir, data, tmp_path):
    """trainer.use_ray=true on one device: the worker still joins a process group and shards with FSDP2
    (what makes actor.param_offload possible on one GPU), and its update is the one process's."""
    from posttrain.distributed.group import WorkerGroup

    cfg = load_config(None, small(tiny_model_dir, data, tmp_path / "r", 1, "trainer.use_ray=true"))
    spec = worker_spec(cfg, str(tiny_model_dir), None, "cpu", total_steps=1)
    local = Worker(spec)
    local.setup()
    group = WorkerGroup(spec, nnodes=1, per_node=1)
    try:
        assert [w["sharded"] for w in group.info] == [True] and local.sharded is False
        prompts = [[5 + i, 6, 7 + i % 3] for i in range(4)]
        out = local.generate(prompts, SamplingParams(max_new_tokens=5, n=2, temperature=1.0))
        batch = RolloutBatch.from_rollout(out, 2, ["arith"] * 4, ["0"] * 4, [{}] * 4, [""] * 8)
        batch.old_log_probs = local.compute_log_probs(batch, "policy")
        batch.ref_log_probs = local.compute_log_probs(batch, "ref") if local.ref is not None else None
        torch.manual_seed(0)
        batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
        m_local, m_group = local.train_step(batch), group.train_step(batch)
        assert m_group["actor/grad_norm"] == pytest.approx(m_local["actor/grad_norm"], rel=1e-4)
        full, own = group.full_state_dict(), dict(local.policy.state_dict())
        assert max((own[k] - full[k]).abs().max().item() for k in own) < 1e-5
    finally:
        group.shutdown()


def exported(ckpt: Path, out: Path) -> dict:
    from posttrain.checkpoint.export import export_checkpoint

    export_checkpoint(ckpt, out)
    return load_file(out / "model.safetensors")


@pytest.mark.ray
def test_sharded_checkpoints_resume_exactly_with_two_workers(cluster, tiny_model_dir, data, tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    two = ("trainer.n_gpus_per_node=2", f"trainer.ray_address={cluster['address']}", "trainer.save_freq=2",
           "algorithm.adv_estimator=gae", "critic.lr=1e-3")  # PPO: the critic's shards resume too
    train(build_run(load_config(None, small(tiny_model_dir, data, straight, 4, *two))))
    train(build_run(load_config(None, small(tiny_model_dir, data, halves, 2, *two))))
    summary = train(build_run(load_config(None, small(tiny_model_dir, data, halves, 4, *two))))
    assert summary["start_step"] == 2 and summary["steps"] == 4
    ckpt = halves / "checkpoints" / "global_step_4"
    assert (ckpt / "actor_dcp" / ".metadata").exists() and (ckpt / "rng" / "rank_1.pt").exists()
    assert (ckpt / "critic_dcp" / ".metadata").exists()
    a = exported(straight / "checkpoints" / "global_step_4", tmp_path / "a")
    b = exported(ckpt, tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def scores(run_dir):
        return [(x["step"], x.get("critic/score/mean"), x.get("actor/pg_loss"), x.get("critic/vf_loss"))
                for x in read_metrics(run_dir) if "actor/pg_loss" in x]

    assert scores(straight) == scores(halves)


@pytest.mark.ray
def test_nemo_rls_grpo_file_at_tensor_parallel_2_runs_two_steps(cluster, tmp_path):
    """NeMo-RL's grpo_math_1B.yaml (as stored from its repository) with policy.dtensor_cfg.tensor_parallel_size=2,
    sequence_parallel=true and two workers, as its TP recipes set them: the embedded model split over both (its
    norms and residual stream by positions too), two GRPO steps on arith rows."""
    import json

    from posttrain.data.preprocess import arith
    from posttrain.models.shipped import embedded_model

    examples = json.loads((Path(__file__).parent / "data" / "nemo_rl" / "examples_7ea279a.json").read_text())
    path = tmp_path / "grpo_math_1B.yaml"
    path.write_text(json.dumps(examples["configs"]["grpo_math_1B.yaml"]))  # JSON is YAML
    train_file, test_file = arith.run(tmp_path / "data", num_train=16, num_test=4)
    cfg = load_config(str(path), [
        "policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.sequence_parallel=true",
        "cluster.gpus_per_node=2", f"trainer.ray_address={cluster['address']}", "trainer.device=cpu", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2",
        "grpo.max_num_steps=2", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=4", "policy.max_total_sequence_length=64", "policy.generation.backend=hf",
        "policy.precision=float32", "grpo.val_period=2", "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path / 'logs'}", f"model.path={embedded_model()}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.val_before_train=false", "data.system_prompt_file=null", f"data.train_files=[{train_file}]",
        f"data.val_files=[{test_file}]", "data.max_response_length=4", "reward.num_workers=0",
        "data.prompt_file=null"])
    assert (cfg.actor.tensor_parallel_size, cfg.actor.sequence_parallel, cfg.trainer.n_gpus_per_node) == (2, True, 2)
    spec = worker_spec(cfg, str(embedded_model()), None, "cpu", 2)  # what each worker splits its models by
    assert (spec.tensor_parallel, spec.tensor_sequence_parallel, spec.tensor_parallel_plan) == (2, True, None)
    assert train(build_run(cfg))["steps"] == 2
    steps = [m for m in read_metrics(tmp_path / "run") if "actor/pg_loss" in m]
    assert len(steps) == 2 and all(m["actor/grad_norm"] > 0 for m in steps)


@pytest.mark.ray
def test_a_tp_2_run_killed_resumes_exactly_at_tp_2_and_loads_at_tp_1(cluster, data, tmp_path):
    """PPO (a critic too) on two workers at TP=2, the embedded model, 4 steps saved every 2. The same run as a
    `posttrain train` process killed (SIGKILL) once its step-2 checkpoint is written, then run again at TP=2,
    resumes there and gives the straight run's steps 3-4 and its weights bit for bit; the step-2 checkpoint
    resumed at TP=1 (two FSDP2 workers: torch.distributed.checkpoint reshards the TP=2 shards), or at TP=2 with
    sequence parallelism, loads and trains on to weights within float rounding of the straight run's (other
    reduction orders)."""
    import shutil

    from posttrain.models.shipped import embedded_model

    model = embedded_model()  # 4 heads, 2 of keys and values: TP=2 splits them
    two = ("trainer.n_gpus_per_node=2", f"trainer.ray_address={cluster['address']}", "trainer.save_freq=2",
           "algorithm.adv_estimator=gae", "critic.lr=1e-3")
    straight = tmp_path / "straight"
    train(build_run(load_config(None, small(model, data, straight, 4, *two, "actor.tensor_parallel_size=2"))))
    ckpt = straight / "checkpoints" / "global_step_4"
    want = exported(ckpt, tmp_path / "want")

    def resumed(name: str, tp: int, copy: bool = True, *more: str) -> Path:
        run_dir = tmp_path / name
        if copy:
            shutil.copytree(straight / "checkpoints" / "global_step_2", run_dir / "checkpoints" / "global_step_2")
        summary = train(build_run(load_config(None, small(model, data, run_dir, 4, *two,
                                                           f"actor.tensor_parallel_size={tp}", *more))))
        assert summary["start_step"] == 2 and summary["steps"] == 4
        return run_dir

    killed = tmp_path / "tp2"
    proc = subprocess.Popen([POSTTRAIN, "train", *small(model, data, killed, 4, *two, "actor.tensor_parallel_size=2")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    manifest = killed / "checkpoints" / "global_step_2" / "manifest.json"
    deadline = time.time() + 300
    while not manifest.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert manifest.exists() and not (killed / "checkpoints" / "global_step_4").exists(), err[-3000:]
    same = resumed("tp2", 2, copy=False)
    got = exported(same / "checkpoints" / "global_step_4", tmp_path / "got")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    steps = [m for m in read_metrics(straight) if m.get("step", 0) > 2 and "actor/pg_loss" in m]
    assert [m["actor/pg_loss"] for m in read_metrics(same) if m.get("step", 0) > 2 and "actor/pg_loss" in m] == \
        [m["actor/pg_loss"] for m in steps]
    assert [m["step"] for m in read_metrics(same) if "actor/pg_loss" in m] == [1, 2, 3, 4]  # the kill lost none
    other = exported(resumed("tp1", 1) / "checkpoints" / "global_step_4", tmp_path / "other")
    assert max((want[k] - other[k]).abs().max().item() for k in want) < 1e-3
    # with sequence parallelism turned on at resume (the same weights; other sums' order)
    split = exported(resumed("tp2-sp", 2, True, "actor.sequence_parallel=true") / "checkpoints" / "global_step_4",
                     tmp_path / "split")
    assert max((want[k] - split[k]).abs().max().item() for k in want) < 1e-4


@pytest.mark.ray
@pytest.mark.parametrize("variant", ["plain", "ulysses", "tensor-parallel"])
def test_sft_on_two_workers_equals_one_process(cluster, tiny_model_dir, tmp_path, variant):
    """posttrain sft on two FSDP2 workers (each an equal share of every batch, micro-batches of 2, a validation
    set of 3 rows: one worker gets a filler row; with Ulysses both take every row, each half of its positions;
    at TP=2 both take every row, each half of every layer and of the vocabulary): the same losses and weights
    as one process."""
    from posttrain.driver.build_sft import build_sft_run
    from posttrain.driver.sft import train_sft

    lr = ()
    if variant == "tensor-parallel":  # 4 heads, 2 of keys and values (tiny_model_dir's 1 does not split)
        from posttrain.models.shipped import embedded_model

        tiny_model_dir, lr = embedded_model(), ("optim.lr=3e-4",)  # trained already: 3e-3 undoes it
    train_rows = write_sft(tmp_path / "train.parquet", [(a, b) for a in range(10, 18) for b in (20, 31)])
    val_rows = write_sft(tmp_path / "val.parquet", [(40, 2), (51, 7), (63, 9)])
    two = ("trainer.n_gpus_per_node=2", f"trainer.ray_address={cluster['address']}", "trainer.save_freq=3",
           f"actor.ulysses_sequence_parallel_size={2 if variant == 'ulysses' else 1}",
           f"actor.tensor_parallel_size={2 if variant == 'tensor-parallel' else 1}", *lr)
    one = train_sft(build_sft_run(load_config(None, sft_overrides(
        tiny_model_dir, train_rows, val_rows, tmp_path / "one", 3, "trainer.save_freq=3", *lr), command="sft")))
    both = train_sft(build_sft_run(load_config(None, sft_overrides(
        tiny_model_dir, train_rows, val_rows, tmp_path / "two", 3, *two), command="sft")))
    assert both["val_before"] == pytest.approx(one["val_before"], rel=1e-5)
    assert both["val_after"] == pytest.approx(one["val_after"], rel=1e-4) and both["val_after"] < both["val_before"]

    def losses(run_dir):
        return [x["train/loss"] for x in read_metrics(run_dir) if "train/loss" in x]

    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert (tmp_path / "two" / "checkpoints" / "global_step_3" / "actor_dcp" / ".metadata").exists()
    a = load_file(tmp_path / "one" / "checkpoints" / "global_step_3" / "actor" / "model.safetensors")
    b = exported(tmp_path / "two" / "checkpoints" / "global_step_3", tmp_path / "b")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


LOSSES = {"k1-pg": ["loss_mode=k1", "use_policy_gradient=true"],
          # the teacher split over both workers (its own TP size), each with rows of its own: their rows gathered
          "kl_topk-teacher-tp": ["loss_mode=kl_topk", "topk=8", "zero_outside_topk=true"],
          "kl_topk-ulysses": ["loss_mode=kl_topk", "topk=8", "zero_outside_topk=true"],  # each half the positions
          "kl_topk-tp": ["loss_mode=kl_topk", "topk=8", "zero_outside_topk=true"]}  # each half of every layer


@pytest.mark.ray
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_teacher_on_two_workers_scores_and_teaches_as_in_one_process(cluster, tiny_model_dir, data, tmp_path,
                                                                      trained_tiny_model_dir, loss):
    """On-policy distillation with FSDP2 workers: the teacher sharded as the reference is; its log-probs (and with
    a top-k loss its 8 likeliest tokens) and a distillation update (the reverse KL's policy gradient, or NeMo-RL's
    mixed top-k KL; 2 mini-batches x 2 micro-batches) equal one process's. At TP=2 (the embedded model taught by
    its number-guessing variant: heads that split) the teacher's top-k comes from each worker's half of the
    vocabulary, and the student's log-probs at those ids too. With a teacher TP size of its own (2) over an unsplit
    student on two workers, each worker's rows are gathered for the teacher and each keeps its own."""
    from posttrain.distributed.group import WorkerGroup
    from posttrain.models.shipped import embedded_model, games_model

    tp = 2 if loss == "kl_topk-tp" else 1
    if loss.endswith("-tp"):
        tiny_model_dir, trained_tiny_model_dir = embedded_model(), games_model()
    cfg = load_config(None, small(tiny_model_dir, data, tmp_path / "r", 2, "trainer.n_gpus_per_node=2",
                                  f"actor.tensor_parallel_size={tp}",
                                  "algorithm.use_kl_in_reward=False", "actor.use_kl_loss=False",
                                  "distillation.enabled=true",
                                  f"distillation.teacher_models.t.model_path={trained_tiny_model_dir}",
                                  *(f"distillation.distillation_loss.{k}" for k in LOSSES[loss]),
                                  f"actor.ulysses_sequence_parallel_size={2 if 'ulysses' in loss else 1}",
                                  *(["distillation.tensor_parallel_size=2"] if "teacher-tp" in loss else [])))
    spec = worker_spec(cfg, str(tiny_model_dir), None, "cpu", total_steps=2)
    local = Worker(spec)
    local.setup()
    group = WorkerGroup(spec, nnodes=1, per_node=2)
    try:
        prompts = [[5 + i, 6, 7 + i % 3] for i in range(8)]
        out = local.generate(prompts, SamplingParams(max_new_tokens=5, n=4, temperature=1.0))
        batch = RolloutBatch.from_rollout(out, 4, ["arith"] * 8, ["0"] * 8, [{}] * 8, [""] * 32)
        batch.old_log_probs = local.compute_log_probs(batch, "policy")
        batch.teacher_log_probs = local.compute_log_probs(batch, "teacher")
        # on the responses' tokens (past a row's end a trimmed micro-batch leaves 0s, and micro-batches group rows
        # by the workers' shares)
        real = batch.response_mask.bool()
        assert torch.allclose(group.compute_log_probs(batch, "teacher")[real], batch.teacher_log_probs[real], atol=1e-5)
        # 5 rows (a teacher's share of a step's rows) over 2 workers: made up with a copy, dropped again
        rows = [0, 3, 8, 9, 30]
        five = batch.select(rows)
        assert torch.allclose(group.compute_log_probs(five, "teacher")[real[rows]], batch.teacher_log_probs[rows][
            real[rows]], atol=1e-5)
        if loss.startswith("kl_topk"):
            sampled, batch.teacher_topk_log_probs, batch.teacher_topk_ids = local.compute_teacher_topk(batch, 8)
            got = group.compute_teacher_topk(batch, 8)
            assert torch.allclose(sampled[real], batch.teacher_log_probs[real], atol=1e-5)
            assert torch.allclose(got[0][real], sampled[real], atol=1e-5)
            assert torch.allclose(got[1][real], batch.teacher_topk_log_probs[real], atol=1e-5)
            assert torch.equal(got[2][real], batch.teacher_topk_ids[real])
        assert not torch.allclose(batch.teacher_log_probs, batch.old_log_probs, atol=1e-2)  # another model
        batch.advantages = torch.zeros(batch.responses.shape)  # the reward plays no part (use_task_rewards=false)
        m_local, m_group = local.train_step(batch), group.train_step(batch)
        assert m_group["actor/grad_norm"] == pytest.approx(m_local["actor/grad_norm"], rel=1e-4)
        assert m_group["distillation/reverse_kl"] == pytest.approx(m_local["distillation/reverse_kl"], rel=1e-4)
        assert m_group["distillation/loss"] == pytest.approx(m_local["distillation/loss"], rel=1e-4)
        full, own = group.full_state_dict(), dict(local.policy.state_dict())
        assert max((own[k] - full[k]).abs().max().item() for k in own) < 1e-5
    finally:
        group.shutdown()


@pytest.mark.ray
def test_multi_turn_tool_use_on_two_workers_resumes_exactly(cluster, tmp_path):
    """Conversations with calculator calls (the tool-using tiny model on products rows) trained by 2 FSDP2
    workers: 2 + 2 steps resumed from the sharded checkpoint equal 4 straight steps (weights, scores,
    losses and tool counts), and the tool messages were in the batches."""
    from posttrain.data.preprocess import products
    from posttrain.models.shipped import tools_model

    products.run(tmp_path / "data", num_train=8, num_test=4, system=False)
    data = tmp_path / "data"
    (data / "val.parquet").write_bytes((data / "test.parquet").read_bytes())
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    two = ("trainer.n_gpus_per_node=2", f"trainer.ray_address={cluster['address']}", "trainer.save_freq=2",
           "data.max_response_length=160", "rollout.n=2", "rollout.temperature=0.7", "actor.lr=1e-4",
           "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]")
    model = tools_model()
    train(build_run(load_config(None, small(model, data, straight, 4, *two))))
    train(build_run(load_config(None, small(model, data, halves, 2, *two))))
    summary = train(build_run(load_config(None, small(model, data, halves, 4, *two))))
    assert summary["start_step"] == 2 and summary["steps"] == 4
    a = exported(straight / "checkpoints" / "global_step_4", tmp_path / "a")
    b = exported(halves / "checkpoints" / "global_step_4", tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def steps(run_dir):
        return [(x["step"], x["critic/score/mean"], x["actor/pg_loss"], x["multi_turn/tool_calls/mean"],
                 x["multi_turn/tool_tokens/mean"], x["reward/tool_correct/mean"])
                for x in read_metrics(run_dir) if "actor/pg_loss" in x]

    assert steps(straight) == steps(halves) and len(steps(straight)) == 4
    assert all(tool_tokens > 0 for *_, tool_tokens, _ in steps(straight))


@pytest.mark.ray
def test_export_of_shards_matches_the_one_process_export(cluster, tiny_model_dir, data, tmp_path):
    """The same weights saved by 2 workers (sharded) and by one process
    export to the same Hugging Face directory."""
    from posttrain.checkpoint import CheckpointWriter, static_model_files
    from posttrain.distributed.group import WorkerGroup

    cfg = load_config(None, small(tiny_model_dir, data, tmp_path / "r", 1, "trainer.n_gpus_per_node=2"))
    spec = worker_spec(cfg, str(tiny_model_dir), None, "cpu", total_steps=1)
    group = WorkerGroup(spec, nnodes=1, per_node=2)
    local = Worker(spec)
    local.setup()
    try:
        prompts = [[5 + i, 6, 7] for i in range(4)]
        out = local.generate(prompts, SamplingParams(max_new_tokens=5, n=4))
        batch = RolloutBatch.from_rollout(out, 4, ["arith"] * 4, ["0"] * 4, [{}] * 4, [""] * 16)
        batch.old_log_probs = batch.ref_log_probs = local.compute_log_probs(batch)
        batch.advantages = torch.linspace(-1, 1, 16)[:, None] * batch.response_mask
        group.train_step(batch)
        files = static_model_files(tiny_model_dir, local.tokenizer)
        sharded = CheckpointWriter(tmp_path / "sharded", files, "", async_save=False)
        sharded.save(group.snapshot(1, sharded, {}, {}))
        local.policy.load_state_dict(group.full_state_dict())
        single = CheckpointWriter(tmp_path / "single", files, "", async_save=False)
        single.save(local.snapshot(1, single, {}, {}))
    finally:
        group.shutdown()
    a = exported(tmp_path / "sharded" / "checkpoints" / "global_step_1", tmp_path / "a")
    b = exported(tmp_path / "single" / "checkpoints" / "global_step_1", tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.ray
def test_a_killed_worker_stops_the_driver_with_its_name_and_the_run_resumes(cluster, tiny_model_dir, data, tmp_path):
    run_dir = tmp_path / "run"
    args = [POSTTRAIN, "train", *small(tiny_model_dir, data, run_dir, 40, "trainer.n_gpus_per_node=2",
                                       f"trainer.ray_address={cluster['address']}", "trainer.save_freq=2",
                                       "trainer.async_save=False")]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "global_step_2" / "manifest.json").exists():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        pid = worker_pids(cluster)[-1]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None)
    last = next(line for line in err.splitlines() if line.startswith("posttrain: error:"))
    assert "worker " in last and f"pid {pid}" in last and "died" in last and "resume" in last, err[-2000:]
    newest = max(info.step for info in list_checkpoints(run_dir) if info.valid)
    again = [a for a in args if not a.startswith("trainer.total_training_steps=")]
    resumed = subprocess.run([*again, f"trainer.total_training_steps={newest + 2}"], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'global_step_{newest}'}" in resumed.stderr
    assert "done:" in resumed.stdout


def worker_pids(cluster) -> list[int]:
    """pids of the live posttrain workers on the cluster (Ray's state API)."""
    from ray.util.state import list_actors

    actors = list_actors(address=cluster["address"], filters=[("state", "=", "ALIVE")], detail=True)
    return [a.pid for a in actors if a.class_name == "Worker"]


@pytest.mark.ray
def test_a_collective_past_its_timeout_is_reported_as_such(cluster, tiny_model_dir, data, tmp_path):
    """Worker 0 gathers the weights while worker 1 never joins: the gather
    fails after trainer.collective_timeout_s and the error says so."""
    from posttrain.distributed.group import WorkerFailed, WorkerGroup

    cfg = load_config(None, small(tiny_model_dir, data, tmp_path / "r", 1, "trainer.n_gpus_per_node=2",
                                  "trainer.collective_timeout_s=3"))
    group = WorkerGroup(worker_spec(cfg, str(tiny_model_dir), None, "cpu", total_steps=1), nnodes=1, per_node=2)
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker 0 .*a collective did not finish within trainer.collective_timeout_s"):
        group._call([0], "full_state_dict", [()])
    assert time.monotonic() - start < 60


def two_worker_run(run_dir: Path, *extra: str) -> tuple[float, float]:
    """The embedded default on 2 CPU workers, 40 steps. -> (validation before, after)."""
    proc = subprocess.run(
        [POSTTRAIN, "train", "trainer.n_gpus_per_node=2", "trainer.device=cpu", "trainer.total_training_steps=40",
         "trainer.test_freq=40", "data.val_max_samples=256", f"trainer.run_dir={run_dir}", *extra],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(run_dir)
    return lines[0]["val/score/mean"], lines[-1]["val/score/mean"]


@pytest.mark.slow
@pytest.mark.ray
def test_two_workers_learn_the_default_task(cluster, tmp_path, trained_tiny_model_dir):
    """The embedded default on 2 CPU workers (FSDP2 over gloo): validation rises by >= 0.15 in 40 steps.

    Spread of the gain (bench/learning_spread.py two_workers, trainer.seed 0-4, 2 threads): 0.242..0.301.
    The threshold sits 0.09 under the lowest, more than the whole spread (0.06)."""
    run_dir = tmp_path / "run"
    before, after = two_worker_run(run_dir, f"trainer.ray_address={cluster['address']}")
    assert after - before >= 0.15, (before, after)
    assert (run_dir / "checkpoints" / "global_step_40" / "actor_dcp" / ".metadata").exists()


@pytest.mark.ray
def test_without_an_address_a_private_local_cluster_is_started(tiny_model_dir, data, tmp_path):
    """No trainer.ray_address, no RAY_ADDRESS: the run starts its own cluster
    on loopback (never attaching to another one), nothing it starts listens
    beyond loopback while it runs, and the cluster stops at the end."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        child = subprocess.Popen([POSTTRAIN, "train", *small(tiny_model_dir, data, tmp_path / "run", 1,
                                                             "trainer.n_gpus_per_node=2")],
                                 stdout=out, stderr=err, text=True, env=env)
        exposed, seen, deadline = set(), set(), time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            tree = process_tree(child.pid)
            seen |= tree
            exposed.update(non_loopback_listeners(tree))
            time.sleep(0.5)
        child.kill() if child.poll() is None else None
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(child.args, child.wait(), out.read(), err.read())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(seen) > 5 and exposed == set()  # the check saw Ray's processes (GCS, raylet, workers)
    assert "started a local Ray cluster" in proc.stderr and "worker 1: pid" in proc.stderr
    assert "done: validation score" in proc.stdout


def test_a_local_cluster_that_does_not_start_is_a_clear_error(monkeypatch):
    """Ray's own startup timeout (seen on a machine starved of CPU) becomes one line naming the fix,
    and what Ray did start is shut down."""
    from posttrain.distributed import cluster
    from posttrain.errors import PosttrainError

    calls = []

    class StuckRay:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            calls.append("init")
            raise Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")

        def shutdown(self):
            calls.append("shutdown")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "import_ray", lambda: StuckRay())
    with pytest.raises(PosttrainError, match=r"could not start a local Ray cluster \(The current node timed out "
                                             r"during startup\.[^)]*\);.*trainer\.n_gpus_per_node=1"):
        cluster.connect(None, num_cpus=2)
    assert calls == ["init", "shutdown"]
