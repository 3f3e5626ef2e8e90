"""posttrain on a CUDA device: mixed precision, the HF engine, FSDP2 over NCCL,
exact resume and the performance metrics.

Tests that take a `device` run on the CPU too (the `cpu` case is part of the
default suite); the `cuda` cases and the CUDA-only tests are marked `gpu` and
skip where torch sees no CUDA device. `bash bench/gpu/run.sh` runs them all
on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.rollout.base import SamplingParams
from posttrain.training.actor import UpdateSettings
from posttrain.worker.verbs import Worker
from posttrain.worker.spec import WorkerSpec

from helpers import read_metrics

NO_CUDA = not torch.cuda.is_available()
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="no CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
PROMPTS = [[5 + i, 6, 7 + i % 3, 9] for i in range(8)]  # byte-level token ids of the tiny model's vocabulary
ROOT = Path(__file__).resolve().parents[1]

# bf16 against float32 on the same batch. bf16 keeps 8 bits of mantissa (relative error up to 2**-8 per
# rounding), so logits, and with them log-probs, move by about 1e-2; stated and checked:
LOGP_MEAN_ABS = 0.03  # mean |log p_bf16 - log p_fp32| over response tokens
LOGP_MAX_ABS = 0.3  # the largest single token's difference
GRAD_NORM_REL = 0.08  # relative difference of the update's gradient norm
UPDATE_COSINE = 0.9  # cosine similarity of the two updates (new - old weights, all parameters)


def spec(model_dir, device: str, mixed_precision: str | None = None, **kw) -> WorkerSpec:
    update = UpdateSettings(mini_batch_size=16, micro_batch_size=8, use_kl_loss=False)
    return WorkerSpec(model_dir=str(model_dir), update=update, device=device, lr=1e-4, seed=0,
                      mixed_precision=mixed_precision, **kw)


def rollout_batch(worker: Worker, n: int = 2, tokens: int = 6) -> RolloutBatch:
    out = worker.generate(PROMPTS, SamplingParams(max_new_tokens=tokens, n=n, temperature=1.0, ignore_eos=True))
    rows = len(PROMPTS)
    batch = RolloutBatch.from_rollout(out, n, ["arith"] * rows, ["0"] * rows, [{}] * rows, [""] * rows * n)
    torch.manual_seed(1)
    batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
    return batch


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_mixed_precision_step_matches_float32_within_the_stated_tolerance(trained_tiny_model_dir, device):
    """The same batch through a float32 worker and a bf16-autocast worker (float32
    weights and optimizer in both): log-probs, gradient norm and the update agree
    within the tolerances above, and differ at all (the bf16 path really ran)."""
    full, mixed = Worker(spec(trained_tiny_model_dir, device)), Worker(spec(trained_tiny_model_dir, device, "bfloat16"))
    full.setup(), mixed.setup()
    batch = rollout_batch(full)
    lp_full, lp_mixed = full.compute_log_probs(batch), mixed.compute_log_probs(batch)
    mask = batch.response_mask.bool()
    diff = (lp_full - lp_mixed).abs()[mask]
    assert 0 < diff.mean().item() < LOGP_MEAN_ABS, diff.mean().item()
    assert diff.max().item() < LOGP_MAX_ABS, diff.max().item()
    assert next(mixed.policy.parameters()).dtype == torch.float32  # master weights stay float32
    batch.old_log_probs = lp_full
    before = weights(full.policy)
    m_full, m_mixed = full.train_step(batch), mixed.train_step(batch)
    assert m_mixed["actor/grad_norm"] == pytest.approx(m_full["actor/grad_norm"], rel=GRAD_NORM_REL)
    d_full = torch.cat([(v - before[k]).flatten() for k, v in weights(full.policy).items()])
    d_mixed = torch.cat([(v - before[k]).flatten() for k, v in weights(mixed.policy).items()])
    assert d_full.norm() > 0
    assert torch.nn.functional.cosine_similarity(d_full, d_mixed, dim=0).item() > UPDATE_COSINE


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_a_vision_language_model_on_cuda_in_bf16_matches_the_cpu_in_float32(tmp_path):
    """A tiny Qwen2.5-VL: prompts with images sampled on the GPU (bf16 autocast), its log-probs of the CPU's
    samples within the bf16 bounds above, and a finite update step."""
    from test_vision_model import batch_of, prompts_of

    from posttrain.models.processor import load_processor
    from posttrain.tiny.vision import build_vlm_dir

    model_dir = build_vlm_dir(tmp_path / "vlm", "qwen2_5_vl", seed=5)
    processor = load_processor(model_dir)
    cpu, gpu = Worker(spec(model_dir, "cpu")), Worker(spec(model_dir, "cuda", mixed_precision="bfloat16"))
    cpu.setup(), gpu.setup()
    prompts = prompts_of("qwen2_5_vl", processor, text_only=(1,))
    params = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, ignore_eos=True)
    assert gpu.generate(prompts, params).response_ids.shape[0] == 6
    batch = batch_of(prompts, cpu.generate(prompts, params), 2, cpu.policy)
    mask = batch.response_mask.bool()
    diff = (cpu.compute_log_probs(batch, "policy") - gpu.compute_log_probs(batch, "policy").cpu()).abs()[mask]
    assert diff.mean() < LOGP_MEAN_ABS and diff.max() < LOGP_MAX_ABS
    batch.old_log_probs = batch.ref_log_probs = cpu.compute_log_probs(batch, "policy")
    batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
    assert torch.isfinite(torch.tensor(gpu.train_step(batch)["actor/grad_norm"]))


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_the_hf_engine_on_cuda_gives_the_cpu_engines_greedy_tokens(trained_tiny_model_dir):
    """float32 on both devices (no TF32): greedy decoding picks the same tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu, gpu = Worker(spec(trained_tiny_model_dir, "cpu")), Worker(spec(trained_tiny_model_dir, "cuda"))
    cpu.setup(), gpu.setup()
    greedy = SamplingParams(max_new_tokens=12, n=1, do_sample=False, temperature=0.0, logprobs=True)
    a, b = cpu.generate(PROMPTS, greedy), gpu.generate(PROMPTS, greedy)
    assert a.response_ids.tolist() == b.response_ids.cpu().tolist()
    assert torch.allclose(a.log_probs, b.log_probs.cpu(), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("autocast", [False, True])
def test_static_decoding_recorded_as_cuda_graphs_gives_the_same_bits_as_its_steps_run_eagerly(random_qwen2, autocast):
    """CUDA graphs replay the kernels they recorded: an engine recording its steps and one running the same steps
    (the same buckets and windows) eagerly through a stand-in sample the same bits, and keep doing so after the
    weights change in place (a graph reads them where they are). Under bf16 autocast too (recorded with autocast's
    weight cache off)."""
    from posttrain.rollout.hf import HFRolloutEngine

    class Eager:  # runs the step when replayed: what a graph records, without recording
        def __init__(self, step):
            self.step = step

        def replay(self):
            self.step()

    model = random_qwen2.cuda()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24, 25, 26]]
    params = SamplingParams(max_new_tokens=40, n=8, temperature=1.0, logprobs=True)
    engines = [HFRolloutEngine(model, [3, 7, 9], 0, seed=5, progress=False, stop_check_every=4,
                               static_decoding=True) for _ in range(2)]
    engines[1].static.graph_type = Eager
    for round_ in range(2):
        outs = []
        for engine in engines:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                outs.append(engine.generate(prompts, params))
        assert engines[0].static.failed is None and len(engines[0].static.recorded) >= 2
        assert torch.equal(outs[0].response_ids, outs[1].response_ids)
        assert torch.equal(outs[0].log_probs, outs[1].log_probs)
        with torch.no_grad():  # new weights, in place
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))


# ------------------------------------------------------------------ FSDP2 over NCCL (gloo on the CPU)

def _update_process(rank: int, world: int, init: str | None, model_dir: str, device: str, batch_file: str, out: str,
                    offload: bool = False) -> None:
    """One process, deterministic algorithms on: the Worker's own sharded setup (process group,
    FSDP2, optimizer; `init` given, any world size) or a plain unsharded Worker (`init` None);
    then one update of its share of the batch."""
    torch.use_deterministic_algorithms(True)  # CUDA's atomics (scatter-add, ...) otherwise vary run to run
    try:
        import torch.distributed as dist

        from posttrain.distributed.balance import minibatch_shards
        from posttrain.distributed.group import tensors_only
        from posttrain.training.actor import loss_units

        torch.backends.cuda.matmul.allow_tf32 = False
        batch = torch.load(batch_file, weights_only=False)
        w = Worker(spec(model_dir, device, param_offload=offload), rank=rank, world_size=world, sharded=init is not None)
        w.setup(init_method=init)
        if init is None:
            metrics = w.train_step(batch)
        else:
            lengths = batch.attention_mask.sum(-1).tolist()
            shards = minibatch_shards(lengths, w.spec.update.mini_batch_size, world)
            totals = [loss_units(m.response_mask, "token-mean") for m in batch.split(w.spec.update.mini_batch_size)]
            metrics = w.train_step(tensors_only(batch.select(shards[rank])), totals)
        full = w.full_state_dict()
        backend = dist.get_backend() if dist.is_initialized() else None
        if rank == 0:
            torch.save({"metrics": metrics, "weights": full, "backend": backend,
                        "fsdp": type(w.policy).__name__.startswith("FSDP")}, out)
        w.shutdown()
    except Exception as e:  # the parent reads why
        Path(f"{out}.rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
        raise


def spawned_update(model_dir, batch, world: int, tmp: Path, device: str = "cuda", offload: bool = False,
                   sharded: bool = True) -> dict:
    """One update in `world` fresh processes (sharded) or one (unsharded), deterministic."""
    import torch.multiprocessing as mp

    name = f"{'sharded' if sharded else 'plain'}{world}"
    torch.save(batch, tmp / "batch.pt")
    out = tmp / f"{name}.pt"
    init = f"file://{tmp}/rdzv-{name}" if sharded else None
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's deterministic mode; the children inherit it
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_update_process, args=(r, world, init, str(model_dir), device, str(tmp / "batch.pt"),
                                                       str(out), offload)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    errors = [f.read_text() for f in sorted(tmp.glob(f"{out.name}.rank*.err"))]
    if errors or not out.exists():
        raise RuntimeError("; ".join(errors) or f"exit codes {[p.exitcode for p in procs]}")
    return torch.load(out, weights_only=False)


def assert_same_update(sharded: dict, single: dict) -> None:
    """Deterministic on both sides; FSDP2 reduces gradients in another order than one
    process sums them, so the two agree to float32 rounding, not bit for bit."""
    assert sharded["metrics"]["actor/grad_norm"] == pytest.approx(single["metrics"]["actor/grad_norm"], rel=1e-4)
    a, b = sharded["weights"], single["weights"]
    assert set(a) == set(b)
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < 1e-5, worst


def update_batch(model_dir, device: str = "cuda") -> RolloutBatch:
    w = Worker(spec(model_dir, device))
    w.setup()
    batch = rollout_batch(w)
    batch.old_log_probs = w.compute_log_probs(batch).cpu()
    return batch


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_fsdp2_over_nccl_in_two_processes_on_one_gpu_matches_one_process(trained_tiny_model_dir, tmp_path):
    """Two ranks share the one GPU. NCCL may refuse two ranks on one device
    ("Duplicate GPU"); then this skips saying so, and the world-size-1 test
    below is what ran."""
    batch = update_batch(trained_tiny_model_dir)
    try:
        sharded = spawned_update(trained_tiny_model_dir, batch, 2, tmp_path)
    except RuntimeError as e:
        if "duplicate gpu" in str(e).lower() or "invalid usage" in str(e).lower():
            pytest.skip(f"NCCL refuses two ranks on one GPU: {str(e)[:300]}")
        raise
    assert "nccl" in sharded["backend"] and sharded["fsdp"]
    assert_same_update(sharded, spawned_update(trained_tiny_model_dir, batch, 1, tmp_path, sharded=False))


@pytest.mark.parametrize("device, offload", [
    ("cpu", False),  # gloo
    pytest.param("cuda", False, marks=needs_cuda),
    pytest.param("cuda", True, marks=needs_cuda),  # FSDP2's CPUOffloadPolicy (actor.param_offload)
])
def test_the_workers_own_sharded_setup_at_world_size_1_matches_an_unsharded_worker(trained_tiny_model_dir, tmp_path,
                                                                                    device, offload):
    """What a WorkerGroup of one runs (trainer.use_ray=true on one GPU): the Worker joins a
    process group of one and shards its models with FSDP2 itself; one update equals an
    unsharded Worker's."""
    batch = update_batch(trained_tiny_model_dir, device)
    sharded = spawned_update(trained_tiny_model_dir, batch, 1, tmp_path, device, offload)
    assert ("nccl" if device == "cuda" else "gloo") in sharded["backend"] and sharded["fsdp"]
    assert_same_update(sharded, spawned_update(trained_tiny_model_dir, batch, 1, tmp_path, device, sharded=False))


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_the_tensor_parallel_path_at_tp_1_on_one_gpu_equals_one_process():
    """training/tensor_parallel.py's plans on a mesh of one GPU (NCCL, float32, TF32 off): one update through the
    vocabulary-parallel log-probs equals the plain update on the same GPU. Several GPUs (TP=2 and up) have not run:
    tests/test_tensor_parallel.py runs them on the CPU."""
    from test_tensor_parallel import one_process_update
    from tp_ranks import spawn, update_rank

    torch.backends.cuda.matmul.allow_tf32 = False
    want, weights = one_process_update(device="cuda")
    [(metrics, got, _, _)], = spawn(update_rank, 1, 1, [("tiny", {})], "cuda", backend="nccl")
    assert metrics["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-4)
    worst = max((got[k] - weights[k]).abs().max().item() for k in weights)
    assert worst < 1e-5, worst


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_optimizer_offload_on_cuda_keeps_the_state_on_the_cpu_and_the_same_updates(trained_tiny_model_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = update_batch(trained_tiny_model_dir)
    plain, offloaded = Worker(spec(trained_tiny_model_dir, "cuda")), Worker(
        spec(trained_tiny_model_dir, "cuda", optimizer_offload=True))
    plain.setup(), offloaded.setup()
    for _ in range(2):
        plain.train_step(batch), offloaded.train_step(batch)
        states = [v for st in offloaded.optimizer.state.values() for k, v in st.items() if k != "step"]
        assert states and all(v.device.type == "cpu" for v in states)
    a, b = weights(plain.policy), weights(offloaded.policy)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ runs on CUDA

RUNNER = """
import os, sys, torch
if os.environ.get("DETERMINISTIC") == "1":
    torch.use_deterministic_algorithms(True)  # CUDA's atomics otherwise make two runs differ
from posttrain.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def cuda_run(tmp: Path, run_dir: Path, steps: int, save_freq: int, deterministic: bool = False) -> None:
    from posttrain.driver.build_data import embedded_data_files

    train, _ = embedded_data_files()
    args = [f"data.train_files={train}", "data.val_files=null", "data.train_batch_size=8", "rollout.n=4",
            "data.max_response_length=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=16",
            "actor.use_kl_loss=True", "trainer.device=cuda", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.logger=[]", f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}",
            f"trainer.run_dir={run_dir}"]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1",
               DETERMINISTIC="1" if deterministic else "0")
    done = subprocess.run([sys.executable, "-c", RUNNER, *args], env=env, capture_output=True, text=True, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_a_cuda_run_stopped_and_resumed_equals_the_whole_run(tmp_path):
    """Deterministic algorithms on: 4 steps at once, and 2 + resume to 4, give the
    same metrics and weights (model, optimizer, LR schedule and the CUDA random
    state all come back)."""
    from safetensors.torch import load_file

    cuda_run(tmp_path, tmp_path / "whole", 4, 4, deterministic=True)
    cuda_run(tmp_path, tmp_path / "split", 2, 2, deterministic=True)
    cuda_run(tmp_path, tmp_path / "split", 4, 4, deterministic=True)
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}  # noqa: E731
    whole = [keep(m) for m in read_metrics(tmp_path / "whole")]
    split = [keep(m) for m in read_metrics(tmp_path / "split")]
    assert [m.get("critic/score/mean") for m in whole] == [m.get("critic/score/mean") for m in split]
    assert whole == split
    a = load_file(tmp_path / "whole/checkpoints/global_step_4/actor/model.safetensors")
    b = load_file(tmp_path / "split/checkpoints/global_step_4/actor/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device")
def test_a_cuda_run_reports_device_memory_and_mfu_against_the_gpus_peak(tmp_path):
    from posttrain.metrics.flops import gpu_peak_flops

    cuda_run(tmp_path, tmp_path / "run", 2, -1)
    steps = [m for m in read_metrics(tmp_path / "run") if "timing_s/step" in m]
    assert steps and all(m["perf/max_memory_allocated_gb"] > 0 for m in steps)
    name = torch.cuda.get_device_name(0)
    if gpu_peak_flops(name) is None:
        pytest.fail(f"no bf16 peak known for {name!r}: add it to posttrain.metrics.flops.GPU_PEAK_FLOPS")
    for m in steps:
        assert 0 < m["perf/mfu/actor"] < 1 and 0 < m["perf/mfu/rollout"] < 1, m
