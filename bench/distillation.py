"""On-policy distillation against RL alone, on the same budget, several seeds.

The teacher: the embedded tiny model after the default GRPO run (100 steps, seed 0). The student: the
embedded model itself (--student embedded), or the same architecture warmed up for 200 steps instead of
until half its answers are right (--student weak: about 0.08 held out). Each setting runs the default task's
100 steps (32 prompts x 8 samples) from the student at each --lrs, validating greedily on 512 held-out
prompts every 25 steps:

    rl          GRPO on the reward (the default run)
    opd-pg      distillation alone: k1, the reverse KL's policy gradient (verl's use_policy_gradient=true)
    opd-k3      distillation alone: the k3 divergence as a direct loss (verl's default loss_mode)
    opd-pg+rl   the policy gradient of both: GRPO's advantages and the teacher's (use_task_rewards=true)
    opd-topk-fkl    distillation alone: verl's forward KL over the teacher's 16 likeliest tokens (forward_kl_topk)
    opd-topk-mixed  distillation alone: NeMo-RL's loss, half forward, half reverse KL over the teacher's 16 (kl_topk)

    python bench/distillation.py                       # seeds 0 1 2
    python bench/distillation.py --seeds 0 --settings rl opd-pg
    python bench/distillation.py --student weak --settings rl opd-pg --lrs 1e-4 3e-4

Prints, per setting, the validation score at steps 0, 25, 50, 75, 100 (mean over seeds, and each seed's
gain), and the distillation runs' reverse KL to the teacher at the first and last step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

TEACHER_KEYS = "distillation.enabled=true distillation.teacher_models.teacher.model_path={teacher}".split()
SETTINGS = {
    "rl": [],
    "opd-pg": [*TEACHER_KEYS, "distillation.distillation_loss.loss_mode=k1",
               "distillation.distillation_loss.use_policy_gradient=true"],
    "opd-k3": [*TEACHER_KEYS, "distillation.distillation_loss.loss_mode=k3"],
    "opd-pg+rl": [*TEACHER_KEYS, "distillation.distillation_loss.loss_mode=k1",
                  "distillation.distillation_loss.use_policy_gradient=true",
                  "distillation.distillation_loss.use_task_rewards=true"],
    "opd-topk-fkl": [*TEACHER_KEYS, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                     "distillation.distillation_loss.topk=16"],
    "opd-topk-mixed": [*TEACHER_KEYS, "distillation.distillation_loss.loss_mode=kl_topk",
                       "distillation.distillation_loss.topk=16", "distillation.distillation_loss.kl_type=mixed"],
}


def run(run_dir: Path, extra: list[str]) -> list[dict]:
    from posttrain.driver.build import build_run
    from posttrain.config import load_config
    from posttrain.driver.loop import train

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(build_run(load_config(None, [f"trainer.run_dir={run_dir}", "trainer.logger=[]", *extra])))
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _flat(path: Path) -> dict:
    """The embedded preset's keys (it applies only without model.path), for a student of another directory."""
    import yaml

    from posttrain.config import flatten

    return {k: (str(v).lower() if isinstance(v, bool) else "null" if v is None else v)
            for k, v in flatten(yaml.safe_load(path.read_text())).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--student", choices=("embedded", "weak"), default="embedded")
    p.add_argument("--lrs", nargs="+", default=["1e-4"], help="actor.lr of the student's runs (the preset's: 1e-4)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="posttrain-distill-"))
    run(tmp / "teacher", ["trainer.seed=0", "trainer.save_freq=100"])
    teacher = tmp / "teacher" / "checkpoints" / "global_step_100" / "actor"
    print(f"teacher: {teacher}")
    student = []
    if args.student == "weak":
        from posttrain.tiny.arith import TinySpec, ensure_tiny_model

        weak = ensure_tiny_model(spec=TinySpec(sft_max_steps=200, sft_eval_every=1000), progress=False)
        preset = Path(__file__).resolve().parents[1] / "src" / "posttrain" / "configs" / "tiny_arith.yaml"
        student = [f"model.path={weak}", *(f"{k}={v}" for k, v in _flat(preset).items())]
    for name, lr in [(n, lr) for n in args.settings for lr in args.lrs]:
        curves, kls = [], []
        for seed in args.seeds:
            extra = [*student, f"actor.lr={lr}", *(k.format(teacher=teacher) for k in SETTINGS[name])]
            lines = run(tmp / f"{name}-{lr}-{seed}", [f"trainer.seed={seed}", "trainer.save_last=false", *extra])
            curves.append([x["val/score/mean"] for x in lines if "val/score/mean" in x])
            kl = [x["distillation/reverse_kl"] for x in lines if "distillation/reverse_kl" in x]
            if kl:
                kls.append((kl[0], kl[-1]))
        mean = [statistics.mean(c[i] for c in curves) for i in range(len(curves[0]))]
        gains = ", ".join(f"{c[-1] - c[0]:+.3f}" for c in curves)
        line = f"{name:10s} lr {lr} val " + " ".join(f"{v:.3f}" for v in mean) + f" | gains {gains}"
        if kls:
            line += " | reverse KL " + ", ".join(f"{a:.3f}->{b:.3f}" for a, b in kls)
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
