"""Where a run's work happens: the device, Ray (whether, and connecting), the workers (one in this process or a
Ray group), the step profiler, and the FLOPs and device peaks MFU is measured with."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from posttrain.distributed.cluster import connect
from posttrain.distributed.group import WorkerGroup
from posttrain.driver.settings import rollout_workers
from posttrain.errors import ConfigError
from posttrain.metrics.flops import ModelFlops
from posttrain.runtime.profiling import ROLE_PHASES, StepProfiler, rank_selected, tool_settings, warn
from posttrain.text.redact import redact_url
from posttrain.rollout.vllm import check_vllm_available
from posttrain.worker.verbs import Worker
from posttrain.worker.spec import WorkerSpec


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def worker_device(name: str, distributed: bool) -> str:
    """The workers' device. On Ray, `auto` means cuda when the cluster has GPUs."""
    if not distributed:
        return pick_device(name).type
    if name != "auto":
        return name
    import ray

    return "cuda" if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def uses_ray(cfg) -> bool:
    """Workers on Ray when asked, when there is more than one, or when a
    cluster address is given (a job's driver: its devices are on the workers)."""
    tr = cfg.trainer
    if tr.debug:  # everything in this process (runtime/debugging.py)
        return False
    if tr.use_ray is not None:
        return tr.use_ray
    return tr.nnodes * tr.n_gpus_per_node > 1 or bool(tr.ray_address or os.environ.get("RAY_ADDRESS"))


def connect_cluster(cfg) -> None:
    tr = cfg.trainer
    world = tr.nnodes * tr.n_gpus_per_node
    rollout = rollout_workers(cfg) if cfg.async_training.enable else 0  # asynchronous training's, a CPU each
    where = connect(tr.ray_address, num_cpus=max(world * tr.cpus_per_worker + rollout, os.cpu_count() or 1))
    print(f"posttrain: {world} worker{'s' if world > 1 else ''} on {redact_url(where)}", file=sys.stderr)


def check_offload(spec: WorkerSpec, sharded: bool) -> None:
    """Parameter offload is FSDP2's: on a GPU it needs sharded workers (on the CPU there is nothing to move)."""
    asked = [k for k, on in (("actor.param_offload", spec.param_offload), ("ref.param_offload", spec.ref.param_offload),
                             ("critic.model.param_offload", spec.critic is not None and spec.critic.param_offload))
             if on]
    if asked and spec.device == "cuda" and not sharded:
        raise ConfigError(f"{', '.join(asked)} (verl's fsdp_config.param_offload) keeps FSDP2's sharded parameters "
                          "in CPU memory, but this run is one process, unsharded: run FSDP2 workers "
                          "(trainer.use_ray=true, or trainer.n_gpus_per_node > 1) or set it to false")


def make_actor(cfg, spec: WorkerSpec, run_dir: Path) -> tuple[Worker | WorkerGroup, list[dict]]:
    """One `Worker` in this process, or a `WorkerGroup` of Ray actors. -> (it, where each worker runs)."""
    tr = cfg.trainer
    check_offload(spec, sharded=uses_ray(cfg))
    if spec.rollout.name == "vllm":
        check_vllm_available(spec.device, spec.rollout.engine_kwargs)
        if spec.device == "cpu" and spec.rollout.free_cache_engine:
            print("posttrain: vLLM's CPU build has no sleep mode: its engine keeps its weights and KV cache between "
                  "generations (rollout.free_cache_engine has no effect on the CPU)", file=sys.stderr)
    if not uses_ray(cfg):
        worker = Worker(spec)
        info = [worker.setup()]
        say_rollout_workers(info)
        return worker, info
    hint = (f"The newest valid checkpoint in {run_dir / 'checkpoints'} is kept: run the same command again "
            "to resume from it (trainer.resume_mode=auto)")
    group = WorkerGroup(spec, tr.nnodes, tr.n_gpus_per_node, tr.cpus_per_worker, resume_hint=hint)
    for w in group.info:
        print(f"posttrain: worker {w['rank']}: pid {w['pid']} on {w['host']} ({w['device']})", file=sys.stderr)
    say_rollout_workers(group.info)
    return group, group.info


def say_rollout_workers(info: list[dict]) -> None:
    """Asynchronous training: where each rollout worker runs (worker 0 holds them)."""
    for i, (pid, host) in enumerate(info[0].get("rollout_workers", ())):
        print(f"posttrain: rollout worker {i}: pid {pid} on {host}", file=sys.stderr)


def make_profiler(cfg, run_dir: Path, device: str, distributed: bool) -> StepProfiler:
    """The run's profiling.StepProfiler (profiler.*). It profiles the loop's process, counted as rank 0: in one
    process the only worker; on Ray workers the driver (the loop's phases as it dispatches and waits for them),
    not the workers' passes. The roles whose enable and ranks pick rank 0 name the phases captured (discrete
    when all of theirs are); none: nothing is profiled (torch_memory snapshots every listed step either way)."""
    p = cfg.profiler
    if p.tool is None or (p.steps is None and p.tool != "torch_memory"):
        return StepProfiler()
    read, _ = tool_settings(p.tool, {r: getattr(p, r).tool_config for r in ROLE_PHASES})
    roles = [r for r in ROLE_PHASES if getattr(p, r).enable and rank_selected(0, getattr(p, r).all_ranks,
                                                                               getattr(p, r).ranks)]
    if not roles and p.tool != "torch_memory":
        why = ", ".join(f"profiler.{r}.ranks={getattr(p, r).ranks}" for r in ROLE_PHASES if getattr(p, r).enable)
        warn(f"profiler.tool={p.tool}: nothing is profiled: posttrain profiles the loop's process, rank 0, which "
             f"no enabled role picks ({why or 'none is enabled'}); set e.g. profiler.actor.enable=true (verl's "
             "actor_rollout_ref.actor.profiler.enable=True) with ranks [] or [0], or all_ranks=true")
        return StepProfiler()
    if distributed:
        warn("profiler: the workers' passes run in Ray actors, which are not profiled yet: this profiles the driver "
             "(the loop's phases as it dispatches and waits for them)")
    settings = [read.get(r) or (read.get("actor", {}) if r == "rollout" else {}) for r in roles]
    tm = p.torch_memory
    return StepProfiler(
        p.tool, p.steps, p.save_path or run_dir / "profile", continuous=p.continuous_steps,
        discrete=bool(settings) and all(s.get("discrete", p.discrete) for s in settings),
        phases=[ph for r in roles for ph in ROLE_PHASES[r]],
        contents={c for s in settings for c in s.get("contents") or ()},
        memory_max_entries=tm.trace_alloc_max_entries, memory_context=tm.context, memory_stacks=tm.stacks,
        cuda=device == "cuda" and torch.cuda.is_available())  # a Ray driver may see no GPU


def flop_model(model_dir: str, frozen_base: bool = False) -> ModelFlops | None:
    """The policy's FLOPs per token (flops.ModelFlops), or None with a
    warning when its config.json lacks a field the count needs. frozen_base
    (LoRA): no weight gradients to count in the backward pass."""
    try:
        flops = ModelFlops.from_model_dir(model_dir)
    except (KeyError, TypeError, ValueError, OSError) as e:
        print(f"posttrain: warning: no perf/mfu metrics: cannot count the FLOPs of the model in {model_dir} from its "
              f"config.json ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return dataclasses.replace(flops, backward_factor=1.0) if frozen_base else flops


def peak_flops_of(configured: float | None, workers: list[dict]) -> float | None:
    """Peak FLOP/s per device: trainer.peak_flops, else the slowest worker's
    own (known GPU or measured CPU); None, with a warning, when unknown."""
    if configured:
        return float(configured)
    peaks = [w.get("peak_flops") for w in workers]
    if any(p is None for p in peaks):
        names = sorted({w.get("device_name", "?") for w, p in zip(workers, peaks) if p is None})
        print(f"posttrain: warning: no perf/mfu metrics: the peak FLOP/s of {', '.join(names)} is not known; set "
              "trainer.peak_flops to one device's dense peak (FLOP/s, e.g. 989e12 for an H100's bf16)",
              file=sys.stderr)
        return None
    return min(peaks)


def measured_peaks(configured: float | None, workers: list[dict]) -> list[str]:
    """The CPU peaks (flops.cpu_peak_key) the run's MFU is measured against, which a step that beats them
    raises (metrics.raise_measured_peak); none when trainer.peak_flops is set or a device is no CPU."""
    keys = [w.get("peak_key") for w in workers]
    return [] if configured or not all(keys) else sorted(set(keys))
