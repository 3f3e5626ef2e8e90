"""How posttrain's step time grows with the samples per prompt (n) and with
the response length.

The benchmark model and prompts of common.py, `--prompts` prompts per step,
responses of exactly the given length (EOS disabled), KL loss to the
reference (beta 0.04), one update per step, float32, `--threads` threads.
Two sweeps, each point a fresh posttrain run of `--steps` steps (the first is
warm-up; the median of the rest is reported):
  - A: n in `--n` at `--length-for-n` tokens (default 1,4,8,16,32 at 16 tokens);
  - B: the response length in `--lengths` at n = `--n-for-lengths`
    (default 16,64,256 tokens at n = 8).
Each sweep prints a Markdown table: seconds per step, completions per second,
the step time relative to the first row, that ratio divided by the
setting's ratio to the first row (below 1.0: the cost grows sub-linearly),
and the median seconds of the main phases (generation, reference pass,
old-policy pass, actor update; "-" where a run has no such phase).

    .venv/bin/python bench/scaling.py [--n 1,4,8,16,32] [--lengths 16,64,256] [--steps 3]
                                     [--length-for-n 16] [--n-for-lengths 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import common

PHASES = [("gen", "timing_s/gen"), ("ref", "timing_s/ref"), ("old_log_prob", "timing_s/old_log_prob"),
          ("update_actor", "timing_s/update_actor")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sweep(label: str, key: str, points: list[dict], model_dir: Path, data_file: Path, prompts: int,
          steps: int) -> list[dict]:
    """Time each point ({"n", "response_length"}); -> the points with their numbers."""
    out = []
    for point in points:
        common.log(f"{label}: n={point['n']}, response length {point['response_length']}, {steps} steps")
        r = common.time_posttrain(model_dir, data_file, prompts, point["n"], point["response_length"], steps)
        median = common.median_after_warmup(r["step_s"])
        out.append({**point, "setting": point[key], "step_s": r["step_s"], "median_s": median,
                    "completions_per_s": prompts * point["n"] / median, "response_length_mean": r["response_length"],
                    "phases": r["phases"]})
    return out


def table(key_name: str, rows: list[dict]) -> str:
    first = rows[0]
    body = []
    for r in rows:
        relative = r["median_s"] / first["median_s"]
        per_setting = relative / (r["setting"] / first["setting"])
        body.append([r["setting"], f"{r['median_s']:.3f}", f"{r['completions_per_s']:.1f}", f"{relative:.2f}",
                     f"{per_setting:.2f}"] + [f"{r['phases'][k]:.3f}" if k in r["phases"] else "-" for _, k in PHASES])
    return common.markdown_table(
        [key_name, "s/step", "completions/s", "vs first", f"vs first / {key_name} ratio"]
        + [f"{name} s" for name, _ in PHASES], body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=ints, default=[1, 4, 8, 16, 32], help="sweep A: samples per prompt")
    p.add_argument("--lengths", type=ints, default=[16, 64, 256], help="sweep B: response lengths in tokens")
    p.add_argument("--length-for-n", type=int, default=16, help="response length in sweep A")
    p.add_argument("--n-for-lengths", type=int, default=8, help="n in sweep B")
    p.add_argument("--steps", type=int, default=3, help="steps per point; the first is warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = common.make_model(tmp / "model")
        data_file = common.write_prompts(common.make_prompts(args.prompts * args.steps), tmp / "train.parquet")
        a = sweep("sweep A", "n", [{"n": n, "response_length": args.length_for_n} for n in args.n], model_dir,
                  data_file, args.prompts, args.steps) if args.n else []
        b = sweep("sweep B", "response_length", [{"n": args.n_for_lengths, "response_length": length}
                                                  for length in args.lengths],
                  model_dir, data_file, args.prompts, args.steps) if args.lengths else []

    print(common.versions())
    print(f"{args.prompts} prompts per step, responses of exactly the given length (EOS off), KL beta 0.04, "
          f"1 update per step, float32; median of steps 2..{args.steps} per row; phases: median seconds")
    if a:
        print(f"\n### Sweep A: samples per prompt (n), responses of {args.length_for_n} tokens\n")
        print(table("n", a))
    if b:
        print(f"\n### Sweep B: response length (tokens), n = {args.n_for_lengths}\n")
        print(table("length", b))
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": args.prompts, "steps": args.steps, "threads": args.threads,
                                               "versions": common.versions(), "n": a, "length": b}, indent=1))


if __name__ == "__main__":
    main()
