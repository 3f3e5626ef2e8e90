"""Asynchronous training against synchronous: seconds per step, each side's idle time, and learning.

Each (setting, seed) is one `posttrain train` subprocess of the embedded default run (`--model tiny`) or the
SmolLM2 example (`--model smollm2`). Settings:

  sync        the rollout engine inside the trainer process (today's default)
  k0          the engine in a process of its own, synchronous (async_training.max_trajectory_age_steps=0)
  k1, k2      sampling 1 or 2 updates ahead, the weights changing between batches (deterministic)
  k1f, k2f    the same with in-flight weight updates (new weights reach the sequences mid-batch)
  ...-tis     with token TIS (algorithm.rollout_correction.rollout_is=token, threshold 2)
  ...-lenN    every response exactly N tokens (data.max_response_length=N, rollout.ignore_eos=true), e.g. k1f-len96
  ...-gN       N trainer workers (FSDP2, on Ray: trainer.n_gpus_per_node=N), e.g. sync-g2, k1-tis-g2
  ...-rM       M rollout workers of their own (async_training.rollout_n_gpus_per_node=M), e.g. k1-tis-g2-r2
  ...-sP       streamed samples, P prompts a piece (async_training.stream_samples=true), e.g. k1-tis-r2-s1
  ...-lenN-mbM  and the batch sampled M sequences at a time (rollout.micro_batch_size=M): a slower engine, so
              generation is the longer phase and in-flight updates land mid-batch (k1f-len96-mb16)

    python bench/async_training.py --speed                      # tiny, 30 steps a setting, no validation
    python bench/async_training.py --speed --model smollm2 --steps 4
    python bench/async_training.py --learn                      # tiny, 100 steps, seeds 0 1 2, held-out gain

Speed rows: the mean over the steps after the first of timing_s/step, the phases (gen, the update), the
trainer's wait for samples (timing_s/wait_rollout) and the rollout's wait for weights (timing_s/rollout_idle),
and the ratio of the synchronous step to this one (above 1: faster). The model line after the table says what
a machine whose rollout and trainer do not share cores would give: a step of max(gen, train) instead of their
sum, from the synchronous run's own phases.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import markdown_table  # noqa: E402
from rollout_mismatch import model_args, posttrain, record, run_train  # noqa: E402

A = "async_training."
TIS = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]
SETTINGS = {
    "sync": [],
    "k0": [f"{A}enable=true", f"{A}max_trajectory_age_steps=0"],
    "k1": [f"{A}enable=true", f"{A}max_trajectory_age_steps=1"],
    "k2": [f"{A}enable=true", f"{A}max_trajectory_age_steps=2"],
    "k1f": [f"{A}enable=true", f"{A}max_trajectory_age_steps=1", f"{A}in_flight_weight_updates=true"],
    "k2f": [f"{A}enable=true", f"{A}max_trajectory_age_steps=2", f"{A}in_flight_weight_updates=true"],
}
SETTINGS.update({f"{name}-tis": [*keys, *TIS] for name, keys in list(SETTINGS.items()) if name not in ("sync", "k0")})
PHASES = {"step": "timing_s/step", "gen": "timing_s/gen", "update": "timing_s/update_actor",
          "old log-probs": "timing_s/old_log_prob", "trainer waits": "timing_s/wait_rollout",
          "rollout waits": "timing_s/rollout_idle"}


def shape_of(setting: str) -> tuple[str, list[str]]:
    """'k1-tis-g2-r2-s1' -> ('k1-tis', the keys of 2 trainer workers on Ray, 2 rollout workers, streamed)."""
    rest, keys = [], []
    for part in setting.split("-"):
        if re.fullmatch(r"g\d+", part):
            keys += [f"trainer.n_gpus_per_node={part[1:]}", "trainer.use_ray=true"]
        elif re.fullmatch(r"r\d+", part):
            keys += [f"{A}rollout_n_gpus_per_node={part[1:]}"]
        elif re.fullmatch(r"s\d+", part):
            keys += [f"{A}stream_samples=true", f"{A}stream_piece_size={part[1:]}"]
        else:
            rest.append(part)
    return "-".join(rest), keys


def run_one(base: list[str], setting: str, seed: int, run_dir: Path, steps: int | None, speed: bool) -> dict:
    extra = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.val_at_end=false"] if speed else []
    name, shape = shape_of(setting)
    extra += shape
    keys, _, length = name.partition("-len")
    length, _, chunk = length.partition("-mb")
    if length:  # every response exactly that long
        extra += [f"data.max_response_length={length}", "rollout.ignore_eos=true"]
    if chunk:  # the batch sampled in chunks of that many sequences, one after another: a slower engine
        extra += [f"rollout.micro_batch_size={chunk}"]
    cmd = posttrain("train", *base, *SETTINGS[keys], f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
                    "trainer.logger=[console]", "trainer.save_last=false", "trainer.resume_mode=disable", *extra,
                    *([f"trainer.total_training_steps={steps}"] if steps else []))
    lines, seconds = run_train(cmd, run_dir)
    steps_m = [m for m in lines if "critic/score/mean" in m]
    val = [m["val/score/mean"] for m in lines if "val/score/mean" in m]
    out = {"setting": setting, "seed": seed, "seconds": seconds, "steps": len(steps_m),
           "val_before": val[0] if val else None, "val_after": val[-1] if val else None,
           "age": statistics.fmean(m.get("async/trajectory_age", 0.0) for m in steps_m),
           "token age": statistics.fmean(m.get("async/token_age_mean", m.get("async/trajectory_age", 0.0))
                                         for m in steps_m),
           "updated": statistics.fmean(m.get("async/in_flight_updated_share", 0.0) for m in steps_m)}
    later = steps_m[1:] or steps_m  # the first step pays for warm-up (and, async, for the first batch alone)
    for label, key in PHASES.items():
        out[label] = statistics.fmean(m.get(key, 0.0) for m in later)
    return out


def speed_table(runs: list[dict]) -> str:
    """One row a run, its ratio against the synchronous run of the same response length (sync, sync-lenN)."""
    def sync_of(r):
        length = r["setting"].partition("-len")[2]  # with its -mbM, if any
        return next((x for x in runs if x["setting"] == "sync" + (f"-len{length}" if length else "")), None)

    rows = []
    for r in runs:
        sync = sync_of(r)
        ratio = f"{sync['step'] / r['step']:.2f}x" if sync else "-"
        rows.append([r["setting"], f"{r['age']:.2f}", f"{r['token age']:.2f}", f"{r['updated']:.2f}",
                     *(f"{r[label]:.3f}" for label in PHASES), ratio])
    table = markdown_table(["setting", "mean age", "token age", "updated mid-batch", *(f"{p} s" for p in PHASES),
                            "sync/this"], rows)
    for sync in (r for r in runs if r["setting"].startswith("sync")):
        train = sync["step"] - sync["gen"]
        table += (f"\n\n{sync['setting']}'s phases: gen {sync['gen']:.3f} s + the rest {train:.3f} s = "
                  f"{sync['step']:.3f} s a step; with the rollout on devices of its own (no shared cores), an "
                  f"overlapped step would take max(gen, rest) = {max(sync['gen'], train):.3f} s: "
                  f"{sync['step'] / max(sync['gen'], train):.2f}x")
    return table


def learn_table(runs: list[dict]) -> str:
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == setting]
        gains = [r["val_after"] - r["val_before"] for r in rs]
        rows.append([setting, len(rs), f"{statistics.fmean(r['val_before'] for r in rs):.3f}",
                     f"{statistics.fmean(r['val_after'] for r in rs):.3f}",
                     f"{statistics.fmean(gains):+.3f} ({min(gains):+.3f}..{max(gains):+.3f})",
                     f"{statistics.fmean(r['age'] for r in rs):.2f}", f"{statistics.fmean(r['step'] for r in rs):.3f}"])
    return markdown_table(["setting", "seeds", "val before", "val after", "gain", "mean age", "s/step"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--speed", action="store_true", help="seconds per step, one seed, no validation")
    mode.add_argument("--learn", action="store_true", help="held-out gain over seeds")
    p.add_argument("--settings", help=f"comma list of {', '.join(SETTINGS)} (default: per mode)")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, help="trainer.total_training_steps (speed default: 30)")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path, help="append each run's figures as a JSON line")
    args = p.parse_args(argv)
    default = "sync,k0,k1,k2,k1f,k2f" if args.speed else "sync,k1,k1-tis,k2,k2-tis,k2f-tis"
    settings = (args.settings or default).split(",")
    bad = [s for s in settings if shape_of(s)[0].partition("-len")[0] not in SETTINGS]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {', '.join(SETTINGS)}")
    seeds = args.seeds or ([0] if args.speed else [0, 1, 2])
    steps = args.steps or (30 if args.speed and args.model == "tiny" else None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="async-training-"))
    base = model_args(args.model, workdir)
    runs = []
    for setting in settings:
        for seed in seeds:
            r = run_one(base, setting, seed, workdir / "runs" / f"{setting}-{seed}", steps, args.speed)
            runs.append(record(r, args.model, args.json))
    print(speed_table(runs) if args.speed else learn_table(runs))


if __name__ == "__main__":
    main()
