"""Learning to answer from an image: the tiny vision model on the vision-digits task, beside the text model.

- vision: examples/tiny_vision_digits.yaml: the shipped tiny vision model (`posttrain tiny-model --task vision`,
  a Qwen2.5-VL whose language model is the embedded arith model, warmed up to read `23` drawn in a 56x28 image)
  answers `<image>+45=`; 3000 training rows, validated greedy on 256 held-out pairs
  (`posttrain preprocess vision-digits --num-train 3000 --num-test 256`);
- text (the peer): the same run's settings on the embedded text model (`posttrain tiny-model`) with the same pairs
  written out (`23+45=`; `posttrain preprocess arith --num-train 3000 --num-test 256`);
- frozen (not in the default list): vision with actor.freeze_vision_tower=true.

    python bench/vision_learning.py                       # 150 steps, seeds 0 1 2, vision and text (about 15 minutes)
    python bench/vision_learning.py --settings vision --seeds 0 --steps 25

Each (setting, seed) is one `posttrain train` subprocess. The table gives each setting's held-out score before and
after (mean over the seeds, then min..max), its gain, and the vision gain as a share of the text model's gain
on the same steps; under it, each run's held-out scores and its training score over its first and last
`--window` steps.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import chosen_settings, learning_parser, markdown_table  # noqa: E402
from rollout_mismatch import posttrain, record, run_train  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "tiny_vision_digits.yaml")
VISION = ("vision-digits", ["--task", "vision"])
TASKS = {"vision": VISION, "text": ("arith", []), "frozen": VISION}  # setting -> (its rows' task, tiny-model's flags)
SETTINGS = {"vision": [], "text": [], "frozen": ["actor.freeze_vision_tower=true"]}


def data_args(setting: str, workdir: Path) -> list[str]:
    """The setting's rows (written once in the workdir) and its shipped model."""
    task, model_flags = TASKS[setting]
    data = workdir / "data" / task
    if not (data / "test.parquet").exists():
        subprocess.run(posttrain("preprocess", task, "--output-dir", str(data), "--num-train", "3000",
                                 "--num-test", "256"), check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    model = subprocess.run(posttrain("tiny-model", *model_flags), check=True, cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return [f"model.path={model}", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}"]


def run_one(setting: str, seed: int, workdir: Path, steps: int | None) -> dict:
    run_dir = workdir / f"{setting}-{seed}"
    cmd = posttrain("train", EXAMPLE, *data_args(setting, workdir), *SETTINGS[setting], f"trainer.seed={seed}",
                    f"trainer.run_dir={run_dir}", "trainer.logger=[console]", "trainer.save_last=false",
                    "trainer.resume_mode=disable",
                    *([f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}"] if steps else []))
    lines, seconds = run_train(cmd, run_dir)
    val = [m["val/score/mean"] for m in lines if "val/score/mean" in m]
    steps_m = [m for m in lines if "critic/score/mean" in m]
    return {"setting": setting, "seed": seed, "seconds": seconds, "steps": len(steps_m), "val": val,
            "before": val[0], "after": val[-1], "gain": val[-1] - val[0],
            "train_score": [m["critic/score/mean"] for m in steps_m],
            "s_per_step": statistics.fmean(m["timing_s/step"] for m in steps_m)}


def span(xs: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.fmean(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def table(runs: list[dict]) -> str:
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == setting]
        rows.append([setting, len(rs), span([r["before"] for r in rs]), span([r["after"] for r in rs]),
                     span([r["gain"] for r in rs], "+.3f"), f"{statistics.fmean(r['s_per_step'] for r in rs):.2f}"])
    return markdown_table(["setting", "seeds", "held-out before", "held-out after", "gain", "s/step"], rows)


def ratio(runs: list[dict]) -> str:
    gains = {s: statistics.fmean(r["gain"] for r in runs if r["setting"] == s) for s in ("vision", "text")
             if any(r["setting"] == s for r in runs)}
    if len(gains) < 2 or gains["text"] == 0:
        return ""
    return (f"vision gain / text gain: {gains['vision'] / gains['text']:.2f} "
            f"({gains['vision']:+.3f} / {gains['text']:+.3f}, the same steps and settings)")


def main(argv=None) -> None:
    p = learning_parser(__doc__.splitlines()[0], SETTINGS, "vision,text",
                        "trainer.total_training_steps (default: the example's 150)")
    args = p.parse_args(argv)
    settings = chosen_settings(args.settings, SETTINGS)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vision-learning-"))
    runs = [record(run_one(s, seed, workdir, args.steps), "tiny", args.json) for s in settings for seed in args.seeds]
    print(table(runs))
    print(ratio(runs))
    k = args.window
    for r in runs:
        xs = r["train_score"]
        first, last = statistics.fmean(xs[:k]), statistics.fmean(xs[-k:])
        print(f"{r['setting']} seed {r['seed']}: held-out " + " -> ".join(f"{v:.3f}" for v in r["val"])
              + f"; training score, steps 1-{k} {first:.3f} -> steps {len(xs) - k + 1}-{len(xs)} {last:.3f} "
              f"({last - first:+.3f}); {r['seconds']} s")


if __name__ == "__main__":
    main()
