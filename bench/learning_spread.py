"""The learning tests' runs over several seeds: the spread their thresholds are set from.

Each learning test asserts a gain (validation score, score over steps, a fitted
loss) on a short run. A threshold is only as good as its margin over that gain's
spread across seeds and machines, so this runs the tests' own run functions
(imported from tests/, one definition of each run) for every seed and prints
each quantity's minimum, median and maximum beside the threshold its test uses.

    python bench/learning_spread.py                        # every run, trainer.seed 0..4, 2 threads
    python bench/learning_spread.py algorithms --seeds 0 1 2 3 4 5 6 7
    python bench/learning_spread.py default --threads 1    # another rounding (one thread)
    python bench/learning_spread.py --json spread.jsonl    # also each run's figures, a line each

The embedded model is the same bytes everywhere; what still differs between
machines is the CPU's rounding during RL. --threads 1 changes the order of the
matmuls' sums, which stands in for another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def run_default(seed, tmp):
    from test_end_to_end import default_run

    before, after, _, _ = default_run(tmp, f"trainer.seed={seed}")
    return {"val gain": after - before}


def run_loop(seed, tmp):
    from test_loop import short_run

    from posttrain.tiny.arith import ensure_tiny_model

    summary, steps, still = short_run(tmp, ensure_tiny_model(), f"trainer.seed={seed}")
    scores = [x["critic/score/mean"] for x in steps]
    return {"val gain": summary["val_after"] - summary["val_before"],
            "score rise (last 3 - first 3)": statistics.fmean(scores[-3:]) - statistics.fmean(scores[:3]),
            "params still": len(still)}


def run_algorithms(seed, tmp):
    from test_algorithms_learn import short_run

    from posttrain.config.presets import ALGORITHMS

    out = {}
    for name in ALGORITHMS:
        summary, steps = short_run(tmp, name, f"trainer.seed={seed}")
        out[f"{name} val gain"] = summary["val_after"] - summary["val_before"]
        if name == "ppo":
            ev = [x["critic/vf_explained_var"] for x in steps]
            vf = [x["critic/vf_loss"] for x in steps]
            out["ppo ev rise (last 4 - first 4)"] = statistics.fmean(ev[-4:]) - statistics.fmean(ev[:4])
            out["ppo vf_loss last 4 / first 4"] = statistics.fmean(vf[-4:]) / statistics.fmean(vf[:4])
    return out


def run_two_workers(seed, tmp):
    from test_distributed import two_worker_run

    before, after = two_worker_run(tmp / "run", f"trainer.seed={seed}")
    return {"val gain": after - before}


def run_critic_fit(seed, tmp):
    from conftest import untrained_spec
    from test_critic import critic_fit

    from posttrain.tiny.arith import build_tiny_model

    out = {}
    for build in (0, 1):  # the tests build their small model in the session: two builds of it
        model = tmp / f"untrained-{build}"
        build_tiny_model(model, seed=build, spec=untrained_spec(), progress=False)
        losses, error = critic_fit(model, seed)
        out[f"build {build}: last / first vf_loss"] = losses[-1] / losses[0]
        out[f"build {build}: max |value - return|"] = error
    return out


RUNS = {"default": run_default, "loop": run_loop, "algorithms": run_algorithms, "two_workers": run_two_workers,
        "critic_fit": run_critic_fit}


def run_name(name: str) -> str:
    if name not in RUNS:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(RUNS)})")
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # a type, not choices: argparse (3.11) checks an empty `*` list against choices and refuses it
    ap.add_argument("runs", nargs="*", type=run_name, default=[], metavar="RUN",
                    help=f"which runs (default all): {', '.join(RUNS)}")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--threads", type=int, default=2, help="torch threads, here and in the runs' subprocesses")
    ap.add_argument("--json", metavar="FILE", help="append each run's figures as a JSON line")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # posttrain subprocesses (default, two_workers)
    import torch

    from posttrain.runtime.quiet import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(args.threads)
    for which in args.runs or list(RUNS):
        table: dict[str, list[float]] = {}
        for seed in args.seeds:
            with tempfile.TemporaryDirectory(prefix=f"spread-{which}-") as tmp:
                figures = RUNS[which](seed, Path(tmp))
            print(f"{which} seed {seed}: " + ", ".join(f"{k} {v:+.3f}" for k, v in figures.items()), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"run": which, "seed": seed, "threads": args.threads, **figures}) + "\n")
            for k, v in figures.items():
                table.setdefault(k, []).append(v)
        print(f"\n{which} over seeds {args.seeds}, {args.threads} threads:")
        for k, vs in table.items():
            print(f"  {k:<34} min {min(vs):+.3f}  median {statistics.median(vs):+.3f}  max {max(vs):+.3f}")
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
