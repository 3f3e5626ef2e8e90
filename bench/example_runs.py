"""The examples' published runs: the figures of README.md and docs/ that come from
`posttrain train examples/...`, rerun with the documented overrides, one
`posttrain train` subprocess per (variant, seed), the table printed in the
doc's layout.

    python bench/example_runs.py smollm2 --seeds 0 1 2     # README "A real model on your laptop" (~8 min a run)
    python bench/example_runs.py smollm2-kl --seeds 0      # the same with actor.use_kl_loss=true: the reference's cost
    python bench/example_runs.py lora --seeds 0 1 2        # docs/lora.md: full fine-tuning vs LoRA r16 (lr 3e-4)
    python bench/example_runs.py lora-1e-4 --seeds 0       # docs/lora.md: LoRA at lr 1e-4, the smaller gain
    python bench/example_runs.py lora-memory               # docs/lora.md "Memory where it shows": 3 steps, seed 0
    python bench/example_runs.py tools --seeds 0 1 2       # docs/multi-turn-tools.md (~2 min a run)
    python bench/example_runs.py tools --seeds 0 --steps 1 --num-test 20   # a quick check of the plumbing

Each run prepares what the example needs in the work dir (`--workdir DIR`, kept;
else a temporary one): the data (`posttrain preprocess arith ... --style question`
or `posttrain preprocess products --no-system-prompt --num-test 500`) and the
model (`posttrain fetch-model`, SmolLM2-135M-Instruct, ~93 MB downloaded once and
cached; `posttrain tiny-model --task tools`, shipped). A run's output goes to
WORKDIR/runs/NAME/train.log; its figures come from its metrics.jsonl:

- held-out score and `tool_correct`: `val/score/mean`, `val/tool_correct/mean` at each validated step;
- s/step, generation, reference, update: the mean over the steps of `timing_s/step` (as in verl it holds
  the step's validation and save), `timing_s/gen`, `timing_s/ref`, `timing_s/update_actor`; the per-run
  table adds their min..max;
- peak RSS: the largest `perf/max_rss_gb`; time: the seconds of the run's `done:` line;
- checkpoint (lora): the size of checkpoints/global_step_N/ (saved at the last step, trainer.save_freq=N),
  in GB of 10^9 bytes; the checkpoint is deleted once measured.

--steps N overrides trainer.total_training_steps (a quick check, not the published figure); --num-test N
cuts the held-out split (products: 500, add15: all 45 pairs). --json FILE appends each run's figures as a
JSON line. Timings depend on the machine and whatever else runs on it (the docs': a 2-core CPU, idle).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import log, markdown_table  # noqa: E402

LORA = ["model.lora_rank=16", "model.lora_alpha=32", "actor.lr=3e-4"]
KL_SMALL_BATCHES = ["actor.use_kl_loss=true", "actor.ppo_micro_batch_size=16", "rollout.log_prob_micro_batch_size=16",
                    "ref.log_prob_micro_batch_size=16", "trainer.total_training_steps=3"]


@dataclass
class Group:
    example: str  # examples/NAME
    data: str  # "add15" or "products"
    variants: dict[str, list[str]]  # label -> the documented overrides
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    save: bool = False  # save at the last step and measure the checkpoint


SMOLLM2 = "smollm2_addition.yaml"
GROUPS = {
    "smollm2": Group(SMOLLM2, "add15", {"full fine-tuning (lr 1e-5)": []}),
    "smollm2-kl": Group(SMOLLM2, "add15", {"actor.use_kl_loss=true": ["actor.use_kl_loss=true"]}, seeds=[0]),
    "lora": Group(SMOLLM2, "add15", {"full fine-tuning (lr 1e-5)": [], "LoRA r16 (lr 3e-4)": LORA}, save=True),
    "lora-1e-4": Group(SMOLLM2, "add15", {"LoRA r16 (lr 1e-4)": LORA[:2] + ["actor.lr=1e-4"]}, seeds=[0]),
    "lora-memory": Group(SMOLLM2, "add15", {
        "full fine-tuning (lr 1e-5)": KL_SMALL_BATCHES,
        "LoRA r16, `rollout.lora_sync=adapter` (default)": KL_SMALL_BATCHES + LORA + ["rollout.lora_sync=adapter"],
        "LoRA r16, `rollout.lora_sync=merged`": KL_SMALL_BATCHES + LORA + ["rollout.lora_sync=merged"]}, seeds=[0]),
    "tools": Group("tiny_tools.yaml", "products", {"tiny_tools": []}),
}


def posttrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "posttrain", *args]


def prepare(group: Group, workdir: Path, num_test: int | None) -> tuple[Path, Path]:
    """-> (data directory, model directory), made in `workdir` (data) or the cache (models) if not there yet."""
    name = group.data + (f"-test{num_test}" if num_test is not None else "")
    data = workdir / "data" / name
    if not (data / "train.parquet").exists():
        if group.data == "add15":
            cmd = posttrain("preprocess", "arith", "--output-dir", str(data), "--min-value", "1", "--max-value", "15",
                            "--style", "question")
        else:
            cmd = posttrain("preprocess", "products", "--output-dir", str(data), "--no-system-prompt", "--num-test",
                            str(500 if num_test is None else num_test))
        if group.data == "add15" and num_test is not None:
            cmd += ["--num-test", str(num_test)]
        log("$ " + shlex.join(cmd))
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    cmd = posttrain("fetch-model") if group.data == "add15" else posttrain("tiny-model", "--task", "tools")
    log("$ " + shlex.join(cmd))
    model = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return data, Path(model)


def total_steps(group: Group, overrides: list[str], steps: int | None) -> int:
    if steps:
        return steps
    for o in reversed(overrides):
        if o.startswith("trainer.total_training_steps="):
            return int(o.split("=", 1)[1])
    import yaml

    return int(yaml.safe_load((ROOT / "examples" / group.example).read_text())["trainer"]["total_training_steps"])


def train_command(group: Group, overrides: list[str], seed: int, data: Path, model: Path, run_dir: Path,
                  steps: int | None) -> list[str]:
    """`posttrain train EXAMPLE` with the model, the data, the documented overrides, the seed, and the run dir."""
    extra = [f"trainer.total_training_steps={steps}"] if steps else []
    if group.save:
        extra.append(f"trainer.save_freq={total_steps(group, overrides, steps)}")
    return posttrain("train", f"examples/{group.example}", f"model.path={model}",
                     f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
                     *overrides, f"trainer.seed={seed}", *extra, f"trainer.run_dir={run_dir}")


def figures(run_dir: Path, output: str, steps: int) -> dict:
    """What the tables show, from the run's metrics.jsonl, its `done:` line and its last checkpoint."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val = {m["step"]: m["val/score/mean"] for m in lines if "val/score/mean" in m}
    tool = {m["step"]: m["val/tool_correct/mean"] for m in lines if "val/tool_correct/mean" in m}
    step_lines = [m for m in lines if "timing_s/step" in m]
    out = {"val": val, "tool_correct": tool, "steps": len(step_lines),
           "train_score": [m["critic/score/mean"] for m in step_lines],
           "train_tool_correct": [m["reward/tool_correct/mean"] for m in step_lines if "reward/tool_correct/mean" in m],
           "peak_rss_gb": max((m["perf/max_rss_gb"] for m in lines if "perf/max_rss_gb" in m), default=None)}
    for name, key in (("step_s", "step"), ("gen_s", "gen"), ("ref_s", "ref"), ("update_s", "update_actor")):
        out[name] = [m[f"timing_s/{key}"] for m in step_lines if f"timing_s/{key}" in m]
    done = re.search(r"^done: .*? steps? in (\d+) s", output, re.M)
    out["seconds"] = int(done.group(1)) if done else None
    ckpt = run_dir / "checkpoints" / f"global_step_{steps}"
    if ckpt.is_dir():
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        shutil.rmtree(run_dir / "checkpoints")
    return out


def run_one(group: Group, label: str, overrides: list[str], seed: int, data: Path, model: Path, workdir: Path,
            steps: int | None, name: str) -> dict:
    run_dir = workdir / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run, never a resumed one
    run_dir.mkdir(parents=True)
    cmd = train_command(group, overrides, seed, data, model, run_dir, steps)
    log(f"{name}: $ {shlex.join(cmd)}")
    with open(run_dir / "train.log", "w") as f:  # as it goes: `tail -f` it
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}); its output: {run_dir / 'train.log'}")
    fig = figures(run_dir, (run_dir / "train.log").read_text(), total_steps(group, overrides, steps))
    log(f"{name}: held-out {fmt_val(fig)}, {fig['steps']} step(s) in {fig['seconds']} s")
    return {"variant": label, "seed": seed, "command": shlex.join(cmd), **fig}


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def secs(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.1f}{unit}"


def spread(xs: list[float]) -> str:
    return "-" if not xs else f"{mean(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"


def span(xs: list, fmt) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    lo, hi = fmt(min(xs)), fmt(max(xs))
    return lo if lo == hi else f"{lo.split()[0]}-{hi}"


def gb(x: float) -> str:
    return f"{x:.2f} GB" if x < 10 else f"{x:.1f} GB"


def size(b: int) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def fmt_val(r: dict) -> str:
    v = list(r["val"].values())
    return f"{v[0]:.3f} -> {v[-1]:.3f}" if len(v) > 1 else (f"{v[0]:.3f}" if v else "-")


def per_run_table(runs: list[dict]) -> str:
    rows = [[r["variant"], r["seed"], fmt_val(r), r["steps"], "-" if r["seconds"] is None else f"{r['seconds']} s",
             spread(r["step_s"]), spread(r["gen_s"]), spread(r["ref_s"]), spread(r["update_s"]),
             "-" if r["peak_rss_gb"] is None else gb(r["peak_rss_gb"]),
             size(r["checkpoint_bytes"]) if "checkpoint_bytes" in r else "-",
             ", ".join(f"{s:.3f}" for s in r["train_score"]) if r["steps"] <= 8 else "-"]
            for r in runs]
    return markdown_table(["run", "seed", "held-out score", "steps", "time", "s/step", "generation", "reference",
                           "update", "peak RSS", "checkpoint", "training score by step"], rows)


def doc_table(name: str, runs: list[dict]) -> str:
    """The table in the layout of the doc that publishes the group's figures."""
    by_variant: dict[str, list[dict]] = {}
    for r in runs:
        by_variant.setdefault(r["variant"], []).append(r)
    if name == "tools":
        steps = sorted({s for r in runs for s in r["val"]})

        def cell(xs: list) -> str:  # the last step's in bold, as the doc has it
            return " / ".join("-" if x is None else f"{x:.3f}" for x in xs[:-1]) + f" / **{xs[-1]:.3f}**"

        rows = []
        for r in runs:
            v, t = [r["val"].get(s) for s in steps], [r["tool_correct"].get(s) for s in steps]
            rss = "-" if r["peak_rss_gb"] is None else f"{r['peak_rss_gb']:.1f} GB"
            rows.append([r["seed"], f"{cell(v)} ({v[-1] - v[0]:+.3f})", cell(t), f"{r['seconds']} s, {rss}"])
        at = " / ".join(map(str, steps))
        table = markdown_table(["seed", f"held-out score, steps {at}", f"held-out `tool_correct`, steps {at}",
                                "time, peak RSS"], rows)
        k = min(10, len(runs[0]["train_tool_correct"]))
        rises = [f"seed {r['seed']} {mean(r['train_tool_correct'][:k]):.3f} -> {mean(r['train_tool_correct'][-k:]):.3f}"
                 for r in runs]
        return table + f"\n\nTraining `reward/tool_correct/mean`, the first {k} steps' mean -> the last {k} steps': " + (
            ", ".join(rises) + ".")
    if name == "lora-memory":
        first = runs[0]["peak_rss_gb"]
        change = [f" ({r['peak_rss_gb'] / first - 1:+.0%})" if i else "" for i, r in enumerate(runs)]  # vs full
        rows = [[r["variant"], gb(r["peak_rss_gb"]) + change[i],
                 secs(mean(r["step_s"])), secs(mean(r["gen_s"]), " s"), secs(mean(r["ref_s"]), " s"),
                 secs(mean(r["update_s"]), " s")] for i, r in enumerate(runs)]
        return markdown_table(["", "peak RSS", "s/step", "generation", "reference", "update"], rows)
    rows = []
    for label, rs in by_variant.items():  # lora, smollm2, smollm2-kl: a row per variant, the seeds' figures together
        befores = sorted({f"{list(r['val'].values())[0]:.3f}" for r in rs if r["val"]})
        afters = " / ".join(f"{list(r['val'].values())[-1]:.3f}" for r in rs if r["val"])
        row = [label, f"{' / '.join(befores)} -> {afters}", " / ".join(str(r["seed"]) for r in rs),
               secs(mean([mean(r["step_s"]) for r in rs])), secs(mean([mean(r["gen_s"]) for r in rs]), " s"),
               secs(mean([mean(r["update_s"]) for r in rs]), " s"), span([r["peak_rss_gb"] for r in rs], gb)]
        if name == "smollm2-kl":
            row.insert(5, secs(mean([mean(r["ref_s"]) for r in rs]), " s"))
        if name == "lora":
            row.append(span([r.get("checkpoint_bytes") for r in rs], size))
        rows.append(row)
    headers = ["", "held-out score", "seeds", "s/step", "generation", "update", "peak RSS"]
    if name == "smollm2-kl":
        headers.insert(5, "reference")
    if name == "lora":
        headers.append("checkpoint")
    return markdown_table(headers, rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("group", choices=list(GROUPS), help="which published figures")
    ap.add_argument("--seeds", type=int, nargs="+", help="trainer.seed values (default: the doc's: 0 1 2, or 0)")
    ap.add_argument("--steps", type=int, help="trainer.total_training_steps (default: the documented run's)")
    ap.add_argument("--num-test", type=int, help="held-out rows (default: the documented split)")
    ap.add_argument("--workdir", type=Path, help="data and run directories here, kept (default: a temporary dir)")
    ap.add_argument("--json", metavar="FILE", help="append each run's figures as a JSON line")
    args = ap.parse_args()
    group = GROUPS[args.group]
    seeds = args.seeds if args.seeds is not None else group.seeds
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="example-runs-") as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        data, model = prepare(group, workdir, args.num_test)
        runs = []
        for label, overrides in group.variants.items():
            for seed in seeds:
                tag = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
                r = run_one(group, label, overrides, seed, data, model, workdir, args.steps,
                            f"{args.group}-{tag}-seed{seed}")
                runs.append(r)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({"group": args.group, **r}) + "\n")
    print(f"## {args.group}: examples/{group.example}, seeds {' '.join(map(str, seeds))}"
          + (f", {args.steps} steps" if args.steps else "") + "\n")
    print(doc_table(args.group, runs) + "\n")
    print(per_run_table(runs) + "\n")
    print("Commands:\n")
    print("\n".join(r["command"] for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
