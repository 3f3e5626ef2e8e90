"""Learning with a real rollout/training mismatch, with and without rollout correction.

Two mismatches, each made on purpose and measured every step:

- precision: the engine samples from a bfloat16 copy of the float32 policy (`rollout.dtype=bfloat16`);
- staleness: the engine samples with the policy's weights of k updates ago (`rollout.stale_updates=k`).

Each (mismatch, correction, seed) is one `posttrain train` subprocess: the embedded default run
(`--model tiny`: the tiny model learning sums, 100 steps) or the SmolLM2 example
(`--model smollm2`: examples/smollm2_addition.yaml, 8 steps, ~8 minutes a run here). The engine's
log-probs are always returned (`rollout.calculate_log_probs=true`) so the uncorrected runs log the
same mismatch metrics.

    python bench/rollout_mismatch.py                                     # tiny: every mismatch x correction, seeds 0 1 2
    python bench/rollout_mismatch.py --mismatch stale2 --correction none,tis --model smollm2
    python bench/rollout_mismatch.py --json runs.jsonl                   # also each run's figures, a line each

Corrections (algorithm.rollout_correction.*, docs/rollout-correction.md):
  none     nothing (the mismatch metrics only)
  tis      token-level truncated IS, weights pi_old / pi_rollout capped at 2 (verl's decoupled_token_is)
  icepop   token IS in [0.5, 2], tokens outside it rejected (NeMo-RL's / OpenRLHF's icepop)
  seqmask  sequences whose geometric-mean ratio leaves [0.999, 1.002] rejected, raw token IS on the rest
           (NeMo-RL's seq-mask-tis with its reference bounds)
  bypass   no old-log-prob pass: the engine's log-probs are the old ones, PPO-clip against them

Figures per row (mean over seeds, min..max beside): the held-out score before and after
(`val/score/mean`), its gain, and over the steps the mean of rollout_corr/k3_kl (the gap's KL, trainer
vs engine), training/rollout_probs_diff_max, the IS weights' mean and the share of tokens rejected.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import log, markdown_table  # noqa: E402

RC = "algorithm.rollout_correction."
MISMATCHES = {
    "none": [],
    "bf16": ["rollout.dtype=bfloat16"],
    "stale1": ["rollout.stale_updates=1"],
    "stale2": ["rollout.stale_updates=2"],
    "stale4": ["rollout.stale_updates=4"],
}
CORRECTIONS = {
    "none": [],
    "tis": [f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=2.0"],
    "icepop": [f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=2.0", f"{RC}rollout_rs=token",
               f"{RC}rollout_rs_threshold=2.0", f"{RC}rollout_rs_threshold_lower=0.5"],
    "seqmask": [f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=null", f"{RC}rollout_rs=geometric",
                f"{RC}rollout_rs_threshold=1.002", f"{RC}rollout_rs_threshold_lower=0.999"],
    "bypass": [f"{RC}bypass_mode=true"],
}
# the step metrics averaged over a run's steps
GAP = {"k3 KL": "rollout_corr/k3_kl", "max Δp": "training/rollout_probs_diff_max",
       "IS mean": "rollout_corr/rollout_is_mean", "rejected": "rollout_corr/rollout_rs_masked_fraction"}


def posttrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "posttrain", *args]


def model_args(model: str, workdir: Path) -> list[str]:
    """The run's config and its data and model: the embedded default, or the SmolLM2 example."""
    if model == "tiny":
        return []
    data = workdir / "data" / "add15"
    if not (data / "train.parquet").exists():
        subprocess.run(posttrain("preprocess", "arith", "--output-dir", str(data), "--min-value", "1",
                                 "--max-value", "15", "--style", "question"), check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    out = subprocess.run(posttrain("fetch-model"), check=True, cwd=ROOT, capture_output=True, text=True)
    model_dir = out.stdout.strip().splitlines()[-1]
    return ["examples/smollm2_addition.yaml", f"model.path={model_dir}",
            f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}"]


def run_one(base: list[str], mismatch: str, correction: str, seed: int, run_dir: Path, steps: int | None) -> dict:
    cmd = posttrain("train", *base, "rollout.calculate_log_probs=true", *MISMATCHES[mismatch],
                    *CORRECTIONS[correction], f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
                    "trainer.logger=[console]", "trainer.save_last=false", *([f"trainer.total_training_steps={steps}"] if steps else []))
    lines, seconds = run_train(cmd, run_dir)
    val = [m["val/score/mean"] for m in lines if "val/score/mean" in m]
    steps_m = [m for m in lines if "critic/score/mean" in m]
    out = {"mismatch": mismatch, "correction": correction, "seed": seed, "val_before": val[0],
           "val_after": val[-1], "seconds": seconds, "steps": len(steps_m)}
    for label, key in GAP.items():
        xs = [m[key] for m in steps_m if key in m]
        out[label] = statistics.fmean(xs) if xs else None
    return out


def run_train(cmd: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """Run a `posttrain train` command (its failure stops the bench with its stderr). -> the lines of its
    metrics.jsonl, its seconds."""
    log("$ " + shlex.join(cmd))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return lines, round(time.perf_counter() - start, 1)


def record(r: dict, model: str, json_path: Path | None) -> dict:
    """A run's figures, tagged with its model, logged and (with --json) appended as a line."""
    r["model"] = model
    log(json.dumps(r))
    if json_path:
        with json_path.open("a") as f:
            f.write(json.dumps(r) + "\n")
    return r


def cell(xs: list, fmt: str) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    mean = format(statistics.fmean(xs), fmt)
    return mean if len(xs) == 1 else f"{mean} ({format(min(xs), fmt)}..{format(max(xs), fmt)})"


def table(runs: list[dict]) -> str:
    rows = []
    for key in dict.fromkeys((r["mismatch"], r["correction"]) for r in runs):
        rs = [r for r in runs if (r["mismatch"], r["correction"]) == key]
        rows.append([*key, len(rs), cell([r["val_before"] for r in rs], ".3f"), cell([r["val_after"] for r in rs], ".3f"),
                     cell([r["val_after"] - r["val_before"] for r in rs], "+.3f"),
                     *(cell([r[label] for r in rs], ".2e" if label != "IS mean" else ".4f") for label in GAP),
                     cell([r["seconds"] for r in rs], ".0f")])
    return markdown_table(["rollout", "correction", "seeds", "val before", "val after", "gain", *GAP, "s/run"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--mismatch", default=",".join(MISMATCHES), help=f"of {', '.join(MISMATCHES)}")
    p.add_argument("--correction", default="none,tis,icepop,seqmask", help=f"of {', '.join(CORRECTIONS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, help="trainer.total_training_steps (a quick check, not the published figure)")
    p.add_argument("--workdir", type=Path, help="data and runs (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="append each run's figures as a JSON line")
    args = p.parse_args(argv)
    mismatches, corrections = args.mismatch.split(","), args.correction.split(",")
    for name, known in ((mismatches, MISMATCHES), (corrections, CORRECTIONS)):
        bad = [x for x in name if x not in known]
        if bad:
            raise SystemExit(f"unknown {bad}; choose from {', '.join(known)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rollout-mismatch-"))
    base = model_args(args.model, workdir)
    runs = []
    for mismatch in mismatches:
        # with no mismatch, one uncorrected baseline is enough: every correction is a no-op up to rounding
        for correction in (corrections if mismatch != "none" else ["none"]):
            for seed in args.seeds:
                r = run_one(base, mismatch, correction, seed, workdir / "runs" / f"{mismatch}-{correction}-{seed}",
                            args.steps)
                runs.append(record(r, args.model, args.json))
    print(table(runs))


if __name__ == "__main__":
    main()
