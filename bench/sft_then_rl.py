"""SFT, then GRPO, on SmolLM2-135M-Instruct: the held-out score after SFT alone and after SFT + RL.

The task is examples/smollm2_addition.yaml's ("What is a + b?", a, b in 1..15; 180 training pairs, 45 held out).
SFT learns worked answers to the training pairs ("6 + 14 = 20", --answers worked; or the bare sum, --answers
bare) for --sft-epochs epochs; then the example's GRPO run (8 steps) starts from the SFT checkpoint. RL alone is the example itself
(README: 0.333 -> 0.844 / 0.800 / 0.867 over seeds 0 1 2; `bench/example_runs.py smollm2` reruns it).

    python bench/sft_then_rl.py                     # seeds 0 1 2 (about 10 minutes a seed on 2 cores)
    python bench/sft_then_rl.py --seeds 0 --sft-lr 2e-5

Prints per seed: the validation loss before and after SFT, the greedy held-out score after SFT alone (the RL
run's step-0 validation) and after SFT + RL, and the minutes each took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POSTTRAIN = [sys.executable, "-m", "posttrain"]


def posttrain(*args: str) -> str:
    done = subprocess.run([*POSTTRAIN, *args], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        sys.exit(f"posttrain {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def sft_rows(rl_rows: Path, answers: str) -> Path:
    """The arith rows as SFT rows (verl's default columns): question, and the answer worked or bare."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = rl_rows.with_name(f"sft-{answers}-{rl_rows.name}")
    rows = []
    for r in pq.read_table(rl_rows).to_pylist():
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        rows.append({"question": r["prompt"][-1]["content"],
                     "answer": f"{a} + {b} = {a + b}" if answers == "worked" else str(a + b)})
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sft-lr", default="2e-5")
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--answers", choices=("worked", "bare"), default="worked")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="posttrain-sft-rl-"))
    model = posttrain("fetch-model").strip().splitlines()[-1]
    data = tmp / "add15"
    posttrain("preprocess", "arith", "--output-dir", str(data), "--min-value", "1", "--max-value", "15",
              "--style", "question")
    files = [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}"]
    sft_files = [f"data.train_files={sft_rows(data / 'train.parquet', args.answers)}",
                 f"data.val_files={sft_rows(data / 'test.parquet', args.answers)}"]
    for seed in args.seeds:
        start = time.perf_counter()
        sft_dir = tmp / f"sft-{seed}"
        posttrain("sft", f"model.path={model}", *sft_files, "data.train_batch_size=16",
                  "data.micro_batch_size_per_gpu=16", "data.max_length=128", f"optim.lr={args.sft_lr}",
                  f"trainer.total_epochs={args.sft_epochs}", f"trainer.run_dir={sft_dir}", "trainer.logger=[]",
                  f"trainer.seed={seed}", "trainer.save_freq=1000", "trainer.test_freq=-1")
        lines = [json.loads(x) for x in (sft_dir / "metrics.jsonl").read_text().splitlines()]
        val = [x["val/loss"] for x in lines if "val/loss" in x]
        sft_minutes = (time.perf_counter() - start) / 60
        ckpt = max((sft_dir / "checkpoints").glob("global_step_*"), key=lambda d: int(d.name.split("_")[-1]))
        rl_dir = tmp / f"rl-{seed}"
        posttrain("train", "examples/smollm2_addition.yaml", f"model.path={ckpt / 'actor'}", *files,
                  f"trainer.run_dir={rl_dir}", "trainer.logger=[]", f"trainer.seed={seed}")
        scores = [x["val/score/mean"] for x in (json.loads(y) for y in (rl_dir / "metrics.jsonl").read_text()
                                                .splitlines()) if "val/score/mean" in x]
        print(f"seed {seed}: SFT val loss {val[0]:.3f} -> {val[-1]:.3f} ({ckpt.name}, {sft_minutes:.1f} min) | "
              f"held-out score after SFT {scores[0]:.3f}, after SFT + RL {scores[-1]:.3f} "
              f"({(time.perf_counter() - start) / 60:.1f} min in all)", flush=True)


if __name__ == "__main__":
    main()
