"""The worker's process: its environment and threads, the process group it joins, where it runs (host, pid,
a free port for a rendezvous) and the peak memory it used.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from posttrain.worker.spec import WorkerSpec


def prepare_process(spec: WorkerSpec) -> torch.device:
    """The spec's environment variables, quiet libraries, torch threads and, on the CPU, malloc's reuse of freed
    memory. -> the worker's device."""
    from posttrain.runtime.malloc import reuse_freed_memory
    from posttrain.runtime.quiet import quiet_libraries

    os.environ.update(spec.env)
    quiet_libraries()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cpu":
        reuse_freed_memory(spec.reuse_cpu_memory)
    return device


def init_process_group(spec: WorkerSpec, rank: int, world_size: int, init_method: str | None,
                       device: torch.device) -> None:
    import torch.distributed as dist

    # CUDA: NCCL for the GPU's tensors, gloo for the CPU's (FSDP2's CPU offload gathers and saves them)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)  # Ray gives each worker one GPU, visible as cuda:0
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=spec.collective_timeout_s))


def host() -> str:
    """This node's address on a Ray cluster, else its host name."""
    import socket

    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()
    except ImportError:
        return socket.gethostname()


def free_port() -> int:
    """A port free on this node now."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def peak_memory() -> dict[str, float]:
    """Peak memory of this process so far: resident set (CPU) and, on a GPU, the most device memory allocated /
    reserved by torch (GiB)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"perf/max_rss_gb": rss / (2 ** 30 if sys.platform == "darwin" else 2 ** 20)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2 ** 30
    return out


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def peak_flops(spec: WorkerSpec, device: torch.device) -> dict:
    """MFU's denominator, measured here (a CPU's peak depends on this process's threads): the device's name, its
    peak FLOP/s in the compute dtype and, on a CPU, the key its measurement is cached under."""
    from posttrain.metrics.flops import cpu_peak_key, device_peak_flops

    dtype = getattr(torch, spec.mixed_precision or spec.dtype)
    device_name, peak = device_peak_flops(device, dtype)
    return {"device_name": device_name, "peak_flops": peak,
            "peak_key": cpu_peak_key(torch.get_num_threads(), dtype) if device.type == "cpu" else None}
