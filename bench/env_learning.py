"""Learning in an environment that talks back, on the embedded tiny model, 3 settings:

- guess: examples/tiny_guess_number.yaml: the tiny model warmed up on number guessing (`posttrain tiny-model
  --task games`) plays posttrain.envs.games:GuessTheNumber (1 to 16, 4 guesses, "higher"/"lower" after each;
  reward 1 for finding it), validated sampled (temperature 1) on 256 held-out games, every secret 16 times. A
  first guess finds the number 1 time in 16 whatever the player does: what is won beyond that is won on later
  turns, by the answers' use;
- hints: the arith task with posttrain.envs.games:AnswerWithHints (a wrong answer gets "higher" or "lower" and
  another try, 3 tries; reward 1 for a right first answer, halved for each try after), against
- single: the plain single-turn run on the same steps (both validated greedy on the held-out sums).

    python bench/env_learning.py                      # 100 steps, seeds 0 1 2, every setting
    python bench/env_learning.py --settings guess --seeds 0 --steps 10
    python bench/env_learning.py --settings guess --seeds 0 1 --steps 20 --num-test 16 --window 6   # the test's run, halved

Each (setting, seed) is one `posttrain train` subprocess. Figures from the validation:
- solved: the share of conversations that reached the answer (val/env/success_ratio; single: val/score/mean);
- first try (hints, single): the share answered right at once (val/env/first_try/mean; single: val/score/mean);
- inside bounds (guess): the share of guesses the answers so far allowed (val/env/consistent/mean);
- turns: assistant turns per training conversation.
Under the table, each run's training score (guess: the share of training games won) over its first and last
`--window` steps, the figure tests/test_end_to_end.py checks.
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

MT = "rollout.multi_turn."
GUESS_DATA = "data/guess_number"  # under the workdir
SETTINGS = {
    "guess": [str(ROOT / "examples" / "tiny_guess_number.yaml")],
    "single": [],
    "hints": [f"{MT}enable=true", f"{MT}environment=posttrain.envs.games:AnswerWithHints",
              "data.max_response_length=64"],
}


def guess_args(workdir: Path, num_test: int = 256) -> list[str]:
    """The guessing game's data (made once in the workdir; `num_test` held-out games) and the shipped
    number-guessing model."""
    data = workdir / (GUESS_DATA + ("" if num_test == 256 else f"-test{num_test}"))
    if not (data / "test.parquet").exists():
        subprocess.run(posttrain("preprocess", "guess-number", "--output-dir", str(data), "--num-test", str(num_test)),
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    model = subprocess.run(posttrain("tiny-model", "--task", "games"), check=True, cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return [f"model.path={model}", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}"]


def run_one(setting: str, seed: int, run_dir: Path, steps: int | None, num_test: int = 256) -> dict:
    extra = guess_args(run_dir.parent, num_test) if setting == "guess" else []
    cmd = posttrain("train", *SETTINGS[setting], *extra, f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
                    "trainer.logger=[console]", "trainer.save_last=false", "trainer.resume_mode=disable",
                    *([f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}"] if steps else []))
    lines, seconds = run_train(cmd, run_dir)
    val = [m for m in lines if "val/score/mean" in m]
    steps_m = [m for m in lines if "critic/score/mean" in m]

    def first_try(m):
        return m.get("val/env/first_try/mean", m["val/score/mean"]) if setting != "guess" else None

    def solved(m):
        return m.get("val/env/success_ratio", m["val/score/mean"])

    return {"setting": setting, "seed": seed, "seconds": seconds, "steps": len(steps_m),
            "first_before": first_try(val[0]), "first_after": first_try(val[-1]),
            "solved_before": solved(val[0]), "solved_after": solved(val[-1]),
            "bounds_before": val[0].get("val/env/consistent/mean"),
            "bounds_after": val[-1].get("val/env/consistent/mean"),
            "score_before": val[0]["val/score/mean"], "score_after": val[-1]["val/score/mean"],
            "turns": statistics.fmean(m.get("env/turns/mean", 1.0) for m in steps_m),
            "train_score": [m["critic/score/mean"] for m in steps_m],
            "s_per_step": statistics.fmean(m["timing_s/step"] for m in steps_m)}


def table(runs: list[dict]) -> str:
    def span(xs):
        xs = [x for x in xs if x is not None]
        return "-" if not xs else f"{statistics.fmean(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})"

    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == setting]
        rows.append([setting, len(rs), span([r["solved_before"] for r in rs]), span([r["solved_after"] for r in rs]),
                     span([r["first_before"] for r in rs]), span([r["first_after"] for r in rs]),
                     span([r["bounds_before"] for r in rs]), span([r["bounds_after"] for r in rs]),
                     f"{statistics.fmean(r['turns'] for r in rs):.2f}",
                     f"{statistics.fmean(r['s_per_step'] for r in rs):.2f}"])
    return markdown_table(["setting", "seeds", "solved before", "solved after", "first try before", "first try after",
                           "inside bounds before", "inside bounds after", "turns (train)", "s/step"], rows)


def windows(runs: list[dict], k: int) -> str:
    """Each run's training score, the mean of its first k steps -> its last k steps' (the gain)."""
    out = []
    for r in runs:
        xs = r["train_score"]
        first, last = statistics.fmean(xs[:k]), statistics.fmean(xs[-k:])
        out.append(f"{r['setting']} seed {r['seed']}: training score, steps 1-{k} {first:.3f} -> steps "
                   f"{len(xs) - k + 1}-{len(xs)} {last:.3f} ({last - first:+.3f}); {r['seconds']} s")
    return "\n".join(out)


def main(argv=None) -> None:
    p = learning_parser(__doc__.splitlines()[0], SETTINGS, "guess,single,hints",
                        "trainer.total_training_steps (default: the run's 100)")
    p.add_argument("--num-test", type=int, default=256, help="guess: held-out games (default 256)")
    args = p.parse_args(argv)
    settings = chosen_settings(args.settings, SETTINGS)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="env-learning-"))
    runs = [record(run_one(s, seed, workdir / f"{s}-{seed}", args.steps, args.num_test), "tiny", args.json)
            for s in settings for seed in args.seeds]
    print(table(runs))
    print(windows(runs, args.window))


if __name__ == "__main__":
    main()
