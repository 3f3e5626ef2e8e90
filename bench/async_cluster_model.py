"""What asynchronous training gives at cluster shape, modelled from measured phase times.

A step's phases were measured on one GPU (bench/README.md's GPU table: GRPO at Qwen2.5-0.5B's shape, 64 prompts x
8 samples, on one H200: generation 10.04 s, the reference's log-probs 2.24 s, the update 10.84 s). This model says
what a step would take on G GPUs:

  synchronous, colocated on T + R GPUs   gen(T + R) + train(T + R)            every GPU does both phases in turn
  asynchronous, T trainer + R rollout    max(gen(R), train(T) + sync) (k >= 1)  the phases overlap; the weights
                                                                               travel once per step (sync)

with train = ref + update scaling as 1/P (data parallel, compute-bound: the communication FSDP2 adds is left out,
which favours the synchronous run, whose update spans more GPUs), and generation between two bounds:

  throughput-bound   gen(P) = gen(1) / P               (each GPU samples 1/P of the sequences at the same speed)
  latency-bound      gen(P) = max(gen(1) / P, floor)   (a sequence's tokens come one after another: the slowest
                                                        sequence's length x the per-token latency, `--gen-floor`)

The weights' trip (`--sync-s`) defaults to 0.5B parameters in bf16 (1 GB) at 10 GB/s: 0.1 s.

    python bench/async_cluster_model.py                       # 8 trainer + 8 rollout GPUs against 16 colocated
    python bench/async_cluster_model.py --trainer 12 --rollout 4 --gen-floor 3.0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table  # noqa: E402

# bench/README.md, "GPU results", the 0.5B row (one H200, 2026-11-26)
GEN_S, REF_S, UPDATE_S = 10.04, 2.24, 10.84


def gen_time(gen1: float, gpus: int, floor: float) -> float:
    return max(gen1 / gpus, floor)


def step_times(gen1: float, train1: float, trainer: int, rollout: int, floor: float, sync_s: float) -> dict:
    """-> the synchronous colocated step on trainer + rollout GPUs, the asynchronous step on trainer | rollout GPUs
    (k >= 1: overlapped), and each side's idle share in the asynchronous one."""
    total = trainer + rollout
    sync = gen_time(gen1, total, floor) + train1 / total
    gen, train = gen_time(gen1, rollout, floor), train1 / trainer + sync_s
    step = max(gen, train)
    return {"sync": sync, "async": step, "speedup": sync / step, "trainer idle": 1 - train / step,
            "rollout idle": 1 - gen / step}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", type=int, default=8, help="the trainer's GPUs (asynchronous)")
    p.add_argument("--rollout", type=int, default=8, help="the rollout's GPUs (asynchronous)")
    p.add_argument("--gen", type=float, default=GEN_S, help="generation on one GPU, s")
    p.add_argument("--train", type=float, default=REF_S + UPDATE_S, help="the reference and the update on one GPU, s")
    p.add_argument("--gen-floor", type=float, nargs="+", default=[0.0, 1.0, 2.0, 5.0],
                   help="generation's latency floor, s (0: throughput-bound)")
    p.add_argument("--sync-s", type=float, default=0.1, help="the weights' trip to the rollout, s")
    args = p.parse_args(argv)
    rows = []
    total = args.trainer + args.rollout
    for floor in args.gen_floor:
        t = step_times(args.gen, args.train, args.trainer, args.rollout, floor, args.sync_s)
        best = min(range(1, total), key=lambda n: step_times(args.gen, args.train, n, total - n, floor,
                                                              args.sync_s)["async"])
        b = step_times(args.gen, args.train, best, total - best, floor, args.sync_s)
        rows.append([f"{floor:g}", f"{t['sync']:.3f}", f"{t['async']:.3f}", f"{t['speedup']:.2f}x",
                     f"{t['trainer idle']:.0%}", f"{t['rollout idle']:.0%}",
                     f"{best}+{total - best}: {b['async']:.3f} s, {b['speedup']:.2f}x"])
    print(f"gen {args.gen:g} s, ref + update {args.train:g} s on one GPU; synchronous on {total} GPUs colocated "
          f"against asynchronous on {args.trainer} trainer + {args.rollout} rollout GPUs (k >= 1)\n")
    print(markdown_table(["gen floor s", f"sync s ({total} colocated)", f"async s ({args.trainer}+{args.rollout})",
                          "sync/async", "trainer idle", "rollout idle", "best split of the same GPUs"], rows))


if __name__ == "__main__":
    main()
