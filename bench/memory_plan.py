"""Memory per GPU of an actor update, by layout: FSDP2 alone, FSDP2 x tensor parallelism, with Ulysses, with
parameter offload. Computed from a model's sizes, not measured: what each layout keeps on one GPU, beside the
FSDP2-alone figure (the peer) as a ratio.

    python bench/memory_plan.py                                    # Qwen2.5-7B, 32B, 72B on 8 x 80 GB, 8k tokens a micro-batch
    python bench/memory_plan.py --models qwen2.5-32b --tokens 32768 --gpus 16

What one GPU holds during the update (bytes; N parameters, G GPUs, T the tensor-parallel size, U Ulysses):
- states: fp32 parameters, fp32 gradients and AdamW's two fp32 moments, 16 N / G, sharded over every GPU whatever
  the layout (FSDP2 shards over the data-parallel groups, TP within them); with offload, none on the GPU;
- gathered: FSDP2's bf16 copy of the layers in flight (this one and the next, prefetched), 2 x 2 x layer / T;
- activations: with activation checkpointing, each layer's input (tokens x hidden x 2 bytes) kept for the backward
  (U splits the tokens; TP without sequence parallelism does not), plus one layer's recomputed inside (q, k, v,
  the attention output, gate, up and their product: tokens x (hidden + 2 kv + hidden + 3 intermediate) x 2 bytes)
  divided by T and by U;
- logits: the micro-batch's [tokens, vocabulary] in fp32 and the log-softmax beside it, 8 bytes each, / T / U.
A layout needs T to divide the attention heads, the key/value heads and the intermediate size (else "-").
Not counted: the reference model (2 N / G more with FSDP2, none with LoRA), the rollout engine's weights and KV
cache (vLLM's gpu_memory_utilization), the allocator's fragmentation.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        attention = self.hidden * self.hidden * 2 + self.hidden * kv * 2 + self.hidden + 2 * kv  # q, o, k, v, biases
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


# the models' config.json sizes (Hugging Face Qwen/Qwen2.5-*-Instruct)
MODELS = {
    "qwen2.5-7b": Sizes(3584, 28, 28, 4, 18944, 152064),
    "qwen2.5-32b": Sizes(5120, 64, 40, 8, 27648, 152064),
    "qwen2.5-72b": Sizes(8192, 80, 64, 8, 29568, 152064),
}
GiB = 2 ** 30


def per_gpu(m: Sizes, gpus: int, tokens: int, tp: int = 1, ulysses: int = 1, offload: bool = False) -> dict | None:
    """GiB on one GPU, by part, of a layout; None where it does not divide."""
    if any(x % tp for x in (m.heads, m.kv_heads, m.intermediate)) or gpus % (tp * ulysses) or m.heads % ulysses:
        return None
    states = 0 if offload else 16 * m.params() / gpus
    gathered = 2 * 2 * m.layer_params() / tp
    inner = tokens * (2 * m.hidden + 2 * m.kv_heads * m.head_dim + 3 * m.intermediate) * 2
    activations = m.layers * tokens * m.hidden * 2 / ulysses + inner / tp / ulysses
    logits = tokens * m.vocab * 8 / tp / ulysses
    parts = {"states": states, "gathered": gathered, "activations": activations, "logits": logits}
    return {k: v / GiB for k, v in parts.items()} | {"total": sum(parts.values()) / GiB}


LAYOUTS = [("FSDP2", 1, 1, False), ("FSDP2 + offload", 1, 1, True), ("FSDP2 x TP2", 2, 1, False),
           ("FSDP2 x TP4", 4, 1, False), ("FSDP2 x TP8", 8, 1, False), ("FSDP2 + Ulysses 4", 1, 4, False)]


def table(models: list[str], gpus: int, tokens: int, memory: float) -> str:
    rows = []
    for name in models:
        m = MODELS[name]
        peer = per_gpu(m, gpus, tokens)["total"]
        for label, tp, ulysses, offload in LAYOUTS:
            got = per_gpu(m, gpus, tokens, tp, ulysses, offload)
            if got is None:
                rows.append([name, f"{m.params() / 1e9:.1f}B", label, "-", "-", "-", "-", "-", "-", "does not divide"])
                continue
            fits = "fits" if got["total"] <= memory * 0.9 else "over"
            rows.append([name, f"{m.params() / 1e9:.1f}B", label, *(f"{got[k]:.1f}" for k in
                         ("states", "gathered", "activations", "logits", "total")), f"{got['total'] / peer:.2f}",
                         fits])
    return markdown_table(["model", "params", "layout", "states", "gathered", "activations", "logits", "GiB / GPU",
                           "vs FSDP2", f"in {memory:.0f} GB (90%)"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens in one micro-batch (prompt + response)")
    p.add_argument("--memory", type=float, default=80.0, help="GB of one GPU")
    args = p.parse_args(argv)
    models = args.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {', '.join(MODELS)}")
    print(f"{args.gpus} GPUs of {args.memory:.0f} GB, {args.tokens} tokens a micro-batch, activation checkpointing on")
    print(table(models, args.gpus, args.tokens, args.memory))


if __name__ == "__main__":
    main()
