"""FLOP counts and device peaks for MFU (model FLOPs utilisation).

MFU = the FLOPs the model needs for the work done / (seconds x the
device's peak FLOP/s x devices). Counted per token, from the model's
config.json (hidden size h, layers L, attention heads nh of size hd, nkv
key/value heads, MLP width I, vocabulary V):

    N    = L * (h*nh*hd + 2*h*nkv*hd + nh*hd*h      # q, k, v, o projections
                + 3*h*I)                            # gated MLP: gate, up, down
           + h*V                                    # the LM head (tied or not)
    forward of one token that attends to c keys:  2*N + 4*L*nh*hd*c
                                                    (QK^T and attention x V)

MoE configs (num_experts_per_tok k, moe_intermediate_size I_e, num_experts
E, optional shared_expert_intermediate_size I_s) count 3*h*(k*I_e + I_s) +
h*E per layer for the MLP: only the experts a token goes through.

- A training pass over a sequence of s real tokens: forward 2*N*s +
  4*L*nh*hd*s^2 (every token against every key, as attention kernels and
  verl/PaLM count it, causal mask not subtracted), backward twice the
  forward (once with frozen weights: LoRA). Activation recomputation (gradient checkpointing) is not useful
  work and is not counted.
- A rollout of r tokens after a prompt of p: the prompt's prefill (a
  forward over p tokens, p^2 attention pairs), then each of the r-1 tokens
  fed back attends to the cache: 2*N + 4*L*nh*hd*(p+j) for j = 1..r-1.
- Only real tokens count: padding, and steps a finished sequence waits
  for, are waste that lowers MFU, as they should.
- Embedding look-ups, norms, rotary, softmax and biases are not counted
  (well under 1% for real models).

Peaks (FLOP/s per device): `trainer.peak_flops` when set; on a GPU the dense
bf16 tensor-core peak from `GPU_PEAK_FLOPS` by device name (MFU is relative
to that even for float32 weights, as verl does); on a CPU a float32 matmul,
the best of the first CPU_PEAK_MEASUREMENTS runs' measurements, cached in the
posttrain cache directory (a faster step raises it: raise_cpu_peak).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.files.cache import cache_root

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data
# sheets; the first name that occurs in torch.cuda.get_device_name() wins, so
# longer names come before their prefixes.
GPU_PEAK_FLOPS: list[tuple[str, float]] = [
    ("GB200", 2.5e15), ("B200", 2.25e15), ("B100", 1.75e15),
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
    ("GH200", 989e12), ("H20", 148e12),
    ("A100", 312e12), ("A800", 312e12), ("A6000", 154.8e12), ("A40", 149.7e12), ("A30", 165e12),
    ("A10G", 70e12), ("A10", 125e12),
    ("L40S", 362e12), ("L40", 181e12), ("L20", 119.5e12), ("L4", 121e12),
    ("RTX 4090", 165.2e12), ("RTX 3090", 71e12), ("V100", 125e12), ("T4", 65e12),
    ("MI355X", 2.5e15), ("MI325X", 1.3e15), ("MI300X", 1.3e15), ("MI250X", 383e12),
]


@dataclass(frozen=True)
class ModelFlops:
    """Per-token FLOP constants of a decoder-only transformer."""

    matmul_params: int  # N above: weights a token multiplies through
    attn_width: int  # L * nh * hd: the attention FLOPs per key are 4x this
    head_params: int = 0  # h * vocab: the LM head's share of matmul_params
    # backward / forward: 2 (gradients of the activations and of the weights); 1 when the weights are frozen
    # (LoRA: only the activations' gradients; the adapters' own are not counted, a fraction of a percent)
    backward_factor: float = 2.0

    @classmethod
    def from_config(cls, c: dict) -> "ModelFlops":
        """From a Hugging Face config.json's fields (text_config for
        multimodal configs). KeyError names a field it needs and lacks."""
        c = c.get("text_config") or c
        h, layers, nh = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
        hd = c.get("head_dim") or h // nh
        nkv = c.get("num_key_value_heads") or nh
        attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
        if c.get("num_experts_per_tok"):
            mlp = 3 * h * (c["num_experts_per_tok"] * c["moe_intermediate_size"]
                           + (c.get("shared_expert_intermediate_size") or 0))
            mlp += h * (c.get("num_experts") or c.get("n_routed_experts") or 0)  # the router
        else:
            mlp = 3 * h * c["intermediate_size"]
        return cls(matmul_params=layers * (attn + mlp) + h * c["vocab_size"], attn_width=layers * nh * hd,
                   head_params=h * c["vocab_size"])

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelFlops":
        with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
            return cls.from_config(json.load(f))

    def forward(self, tokens: int, keys: int) -> float:
        """A forward pass of `tokens` tokens, each attending to `keys` keys on average."""
        return 2.0 * self.matmul_params * tokens + 4.0 * self.attn_width * tokens * keys

    def training(self, seq_lengths: torch.Tensor) -> float:
        """Forward + backward over sequences of these real lengths [B]."""
        s = seq_lengths.double()
        return (1.0 + self.backward_factor) * float((2.0 * self.matmul_params * s + 4.0 * self.attn_width * s * s).sum())

    def training_shared(self, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                        group: torch.Tensor) -> float:
        """Forward + backward as model.share_prompt runs them: each group's
        prompt once (lengths [B], group ids [B]), then each response with its
        last token left out (it predicts nothing scored), attending to its
        prompt and itself. (A group split between micro-batches runs its
        prompt once per part: not counted.)"""
        p, r = prompt_lengths.double(), (response_lengths.double() - 1).clamp(min=0)
        ids = group.tolist()
        pg = p[[ids.index(g) for g in dict.fromkeys(ids)]]  # one prompt per group
        prompts = 2.0 * self.matmul_params * pg + 4.0 * self.attn_width * pg * pg
        responses = 2.0 * self.matmul_params * r + 4.0 * self.attn_width * r * (p + r)
        return (1.0 + self.backward_factor) * float(prompts.sum() + responses.sum())

    def rollout(self, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, samples_per_prefill: int = 1
                ) -> float:
        """Prefill of each prompt [B] plus its response tokens [B] decoded with a
        KV cache; a prefill projects only its last position onto the vocabulary,
        and runs once for `samples_per_prefill` rows (a prompt's n samples when
        they share it: rollout.shared_prefill, vLLM)."""
        p, r = prompt_lengths.double(), response_lengths.double()
        fed = (r - 1).clamp(min=0)  # the last sampled token is never fed back
        prefill = (2.0 * (self.matmul_params - self.head_params) * p + 2.0 * self.head_params
                   + 4.0 * self.attn_width * p * p)
        # sum_{j=1..fed} (p + j) keys
        decode = 2.0 * self.matmul_params * fed + 4.0 * self.attn_width * (fed * p + fed * (fed + 1) / 2)
        return float((prefill / samples_per_prefill + decode).sum())


def mfu(flops: float, seconds: float, peak_flops: float | None, devices: int = 1) -> float | None:
    """Achieved / peak; None when there is no peak or no time."""
    if not peak_flops or seconds <= 0:
        return None
    return flops / (seconds * peak_flops * devices)


# ------------------------------------------------------------------ peaks

def gpu_peak_flops(device_name: str) -> float | None:
    for name, peak in GPU_PEAK_FLOPS:
        if name.lower() in device_name.lower():
            return peak
    return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_cpu_peak_flops(threads: int, dtype: torch.dtype = torch.float32, n: int = 1024, reps: int = 8) -> float:
    """The best of `reps` n x n matmuls with `threads` torch threads (FLOP/s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)  # leaves the global random state (and so the run) untouched
        a, b = torch.randn(n, n, dtype=dtype, generator=gen), torch.randn(n, n, dtype=dtype, generator=gen)
        a @ b  # warm-up: thread pool, caches
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2.0 * n ** 3 / best
    finally:
        torch.set_num_threads(before)


CPU_PEAK_MEASUREMENTS = 3  # run starts that measure the CPU's peak before the cached best is trusted


def cpu_peak_flops(threads: int, dtype: torch.dtype = torch.float32, cache_file: Path | None = None) -> float:
    """The CPU's peak FLOP/s per (CPU model, threads, dtype): the best of the first CPU_PEAK_MEASUREMENTS
    calls' measurements (one per run start), cached as JSON. A machine busy during one measurement gives a
    low peak, which inflates MFU (past 100%): a later, quieter measurement replaces it, and
    `raise_cpu_peak` records a step that went faster than the peak."""
    cache_file = cache_file or peaks_file()
    key = cpu_peak_key(threads, dtype)
    cached = _read_peaks(cache_file)
    best, count = _peak_entry(cached.get(key))
    if best > 0 and count >= CPU_PEAK_MEASUREMENTS:
        return best
    best = max(best, measure_cpu_peak_flops(threads, dtype))
    cached[key] = {"peak": best, "measurements": count + 1}
    _write_peaks(cache_file, cached)
    return best


def raise_cpu_peak(key: str, achieved: float, cache_file: Path | None = None) -> None:
    """A step computed `achieved` FLOP/s on the CPU of `key` (cpu_peak_key), more than its cached peak: that
    is the peak at least, and the next run starts by measuring again."""
    cache_file = cache_file or peaks_file()
    cached = _read_peaks(cache_file)
    best, _ = _peak_entry(cached.get(key))
    cached[key] = {"peak": max(best, achieved), "measurements": 0}
    _write_peaks(cache_file, cached)


def peaks_file() -> Path:
    """Where the measured CPU peaks are cached."""
    return cache_root() / "peak_flops.json"


def cpu_peak_key(threads: int, dtype: torch.dtype) -> str:
    return f"{cpu_name()}|threads={threads}|{str(dtype).removeprefix('torch.')}"


def _peak_entry(entry) -> tuple[float, int]:
    """A cache entry -> (its best peak, how many measurements it holds); an older cache's bare number
    counts as one measurement."""
    if isinstance(entry, (int, float)) and not isinstance(entry, bool) and entry > 0:
        return float(entry), 1
    if isinstance(entry, dict) and isinstance(entry.get("peak"), (int, float)) and entry["peak"] > 0:
        count = entry.get("measurements")
        return float(entry["peak"]), count if isinstance(count, int) and count >= 0 else 0
    return 0.0, 0


def _read_peaks(cache_file: Path) -> dict:
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is measured again, not an error
    return cached if isinstance(cached, dict) else {}


def _write_peaks(cache_file: Path, cached: dict) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, cache_file)
    except OSError as e:  # a read-only cache costs a measurement per run, nothing more
        print(f"posttrain: warning: could not cache the CPU's peak FLOP/s in {cache_file}: {e}", file=sys.stderr)


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[str, float | None]:
    """-> (the device's name, its peak FLOP/s per device, or None when unknown)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return name, gpu_peak_flops(name)
    return cpu_name(), cpu_peak_flops(torch.get_num_threads(), dtype)
