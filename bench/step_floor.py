"""Each phase of an RL step against its floor: the time its FLOPs would take at this machine's measured matmul
peak, beside the time it takes.

The work is bench/trl_grpo.py's (16 prompts x 8 samples, exactly 16 response tokens, a k3 KL loss to the
reference, one update over the whole batch, float32; common.posttrain_overrides), trained `--steps` steps in this
process on `--model`: the bench's 3M-parameter Qwen2 (default) or a directory (SmolLM2: `posttrain fetch-model`).
For each phase, the median over the steps after the first of:

- FLOPs: posttrain's own count, the one its MFU uses (flops.ModelFlops, real tokens only): generation
  (perf/flops/rollout), the update (perf/flops/actor: forward and backward), the reference pass (the update's
  forward share, flops / (1 + backward factor): the same tokens, no backward);
- floor: FLOPs / the peak (flops.cpu_peak_flops: the best of its measurements of a 1024^3 float32 matmul at
  this thread count, cached per CPU);
- measured: the phase's timing_s/...; "% of floor" = floor / measured.

The step's rest (reward, advantages, metrics, Python between phases) is the step minus its phases. A second run of
the same work on a micro model (hidden 32, 1 layer: FLOPs negligible) gives the per-step framework overhead,
what no kernel speed-up can remove.

    .venv/bin/python bench/step_floor.py [--model DIR] [--steps 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import common

PHASES = (("gen", "generation", "perf/flops/rollout"), ("ref", "reference pass", None),
          ("update_actor", "update", "perf/flops/actor"))
MICRO_SPEC = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)


def run_steps(model_dir: Path, data_file: Path, steps: int, prompts: int, n: int, length: int) -> list[dict]:
    """`steps` steps of the work; -> each step's metrics (the first, warm-up, left out)."""
    import json

    from posttrain.driver.build import build_run
    from posttrain.config import load_config
    from posttrain.driver.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        train(build_run(load_config(None, common.posttrain_overrides(model_dir, data_file, run_dir, prompts, n,
                                                                     length, steps))))
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [m for m in lines if "timing_s/step" in m]
    return measured[1:] or measured


def floor_table(steps_m: list[dict], peak: float, backward_factor: float) -> tuple[list[list], float, float]:
    """-> (rows: phase, GFLOPs, floor s, measured s, % of floor; the step's floor; the step's measured)."""
    def med(key):
        return statistics.median(m.get(key, 0.0) for m in steps_m)

    rows, floor_total = [], 0.0
    for phase, name, flops_key in PHASES:
        if f"timing_s/{phase}" not in steps_m[0]:
            continue
        flops = med(flops_key) if flops_key else med("perf/flops/actor") / (1.0 + backward_factor)
        floor, took = flops / peak, med(f"timing_s/{phase}")
        floor_total += floor
        rows.append([name, f"{flops / 1e9:.1f}", f"{floor:.3f}", f"{took:.3f}", f"{100 * floor / took:.0f}%"])
    step = med("timing_s/step")
    rest = step - sum(med(f"timing_s/{p}") for p, _, _ in PHASES)
    rows.append(["rest of the step", "-", "-", f"{rest:.3f}", "-"])
    rows.append(["step", "-", f"{floor_total:.3f}", f"{step:.3f}", f"{100 * floor_total / step:.0f}%"])
    return rows, floor_total, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: the bench's 3M-parameter Qwen2)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-length", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from posttrain.metrics.flops import ModelFlops, cpu_peak_flops

    peak = cpu_peak_flops(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(args.model) if args.model else common.make_model(tmp / "model")
        data = common.write_prompts(common.make_prompts(args.prompts * (args.steps + 1)), tmp / "train.parquet")
        work = (args.prompts, args.n, args.response_length)
        steps_m = run_steps(model, data, args.steps, *work)
        micro = common.make_model(tmp / "micro", spec=MICRO_SPEC)
        micro_m = run_steps(micro, data, args.steps, *work)
        backward_factor = ModelFlops.from_model_dir(model).backward_factor
    rows, floor, step = floor_table(steps_m, peak, backward_factor)
    overhead = statistics.median(m["timing_s/step"] for m in micro_m)
    print(f"# {model.name if args.model else 'bench model (3M)'}: {args.prompts} prompts x {args.n} samples x "
          f"{args.response_length} tokens, {args.threads} threads, peak {peak / 1e9:.1f} GFLOP/s; {common.versions()}")
    print(common.markdown_table(["phase", "GFLOPs", "floor s", "measured s", "% of floor"], rows))
    print(f"\nframework overhead (the same step on a micro model, hidden 32, 1 layer): {overhead:.3f} s/step "
          f"({100 * overhead / step:.0f}% of this step); the step at its floor plus that overhead: "
          f"{floor + overhead:.3f} s ({step / (floor + overhead):.2f}x faster than now)")


if __name__ == "__main__":
    main()
