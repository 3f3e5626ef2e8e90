"""Learning in an environment that talks back: the embedded tiny model on its arith task with
posttrain.envs.games:AnswerWithHints (a wrong answer gets "higher" or "lower" and another try, 3 tries; reward 1
for a right first answer, halved for each try after), against the plain single-turn run on the same steps.

    python bench/env_learning.py                      # 100 steps, seeds 0 1 2, both settings
    python bench/env_learning.py --settings hints --seeds 0 --steps 10

Each (setting, seed) is one `posttrain train` subprocess. Figures from the validation (greedy, the held-out split):
- first try: the share answered right at once (hints: val/env/first_try/mean; single: val/score/mean);
- solved in 3: the share answered right within the three tries (hints only: val/env/success_ratio);
- score: val/score/mean (hints: the discounted reward above).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import markdown_table  # noqa: E402
from rollout_mismatch import posttrain, record, run_train  # noqa: E402

MT = "rollout.multi_turn."
SETTINGS = {
    "single": [],
    "hints": [f"{MT}enable=true", f"{MT}environment=posttrain.envs.games:AnswerWithHints",
              "data.max_response_length=64"],
}


def run_one(setting: str, seed: int, run_dir: Path, steps: int | None) -> dict:
    cmd = posttrain("train", *SETTINGS[setting], f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
                    "trainer.logger=[console]", "trainer.save_freq=-1", "trainer.resume_mode=disable",
                    *([f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}"] if steps else []))
    lines, seconds = run_train(cmd, run_dir)
    val = [m for m in lines if "val/score/mean" in m]
    steps_m = [m for m in lines if "critic/score/mean" in m]

    def first_try(m):
        return m.get("val/env/first_try/mean", m["val/score/mean"])

    return {"setting": setting, "seed": seed, "seconds": seconds, "steps": len(steps_m),
            "first_before": first_try(val[0]), "first_after": first_try(val[-1]),
            "solved_before": val[0].get("val/env/success_ratio"), "solved_after": val[-1].get("val/env/success_ratio"),
            "score_before": val[0]["val/score/mean"], "score_after": val[-1]["val/score/mean"],
            "turns": statistics.fmean(m.get("env/turns/mean", 1.0) for m in steps_m),
            "s_per_step": statistics.fmean(m["timing_s/step"] for m in steps_m)}


def table(runs: list[dict]) -> str:
    def span(xs):
        xs = [x for x in xs if x is not None]
        return "-" if not xs else f"{statistics.fmean(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})"

    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == setting]
        rows.append([setting, len(rs), span([r["first_before"] for r in rs]), span([r["first_after"] for r in rs]),
                     span([r["solved_before"] for r in rs]), span([r["solved_after"] for r in rs]),
                     f"{statistics.fmean(r['turns'] for r in rs):.2f}",
                     f"{statistics.fmean(r['s_per_step'] for r in rs):.2f}"])
    return markdown_table(["setting", "seeds", "first try before", "first try after", "solved in 3 before",
                           "solved in 3 after", "turns (train)", "s/step"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="single,hints", help=f"comma list of {', '.join(SETTINGS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, help="trainer.total_training_steps (default: the run's 100)")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path, help="append each run's figures as a JSON line")
    args = p.parse_args(argv)
    settings = args.settings.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {', '.join(SETTINGS)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="env-learning-"))
    runs = [record(run_one(s, seed, workdir / f"{s}-{seed}", args.steps), "tiny", args.json)
            for s in settings for seed in args.seeds]
    print(table(runs))


if __name__ == "__main__":
    main()
