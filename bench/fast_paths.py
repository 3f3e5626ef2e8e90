"""What each of posttrain's fast paths saves: the step with all of them on,
with each one switched off by its flag, and with all of them off.

Two workloads, each timed in this process (median seconds per step after a
warm-up step, 2 threads):
  - bench: the TRL comparison's work (common.py's model and prompts,
    16 prompts x 8 samples, 16-token responses with EOS off, KL loss);
  - arith: the embedded default (the tiny model, the addition task, EOS on,
    so responses end at different lengths), 32 prompts x 8 samples, with a
    64-token response budget instead of its 8 (real tasks give budgets far
    above most answers, which is where early stopping and skipping ended
    sequences pay).

    .venv/bin/python bench/fast_paths.py [--steps 5] [--workloads bench,arith]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import common

FLAGS = {
    "rollout.shared_prefill": "prompt prefilled once per group",
    "rollout.remove_padding": "ended sequences leave the decoding batch",
    "rollout.early_stop": "decoding stops when all have ended",
    "model.use_remove_padding": "no compute on padding in passes",
    "model.share_prompt": "prompt run once in log-prob/training passes",
    "model.small_attention": "small CPU attentions as grouped matmuls",
    "actor.reuse_on_policy_log_probs": "no separate old log-prob pass",
    "trainer.reuse_cpu_memory": "malloc keeps freed memory for reuse (CPU)",
}


def settings() -> list[tuple[str, list[str]]]:
    out = [("all on", [])]
    out += [(f"{flag}=false", [f"{flag}=false"]) for flag in FLAGS]
    out.append(("all off", [f"{flag}=false" for flag in FLAGS]))
    return out


def time_arith(steps: int, extra: list[str]) -> dict:
    """The embedded default for `steps` steps (no validation, no checkpoints)."""
    return common.timed_run(lambda run_dir: [
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "data.max_response_length=64",
        "data.val_files=[]", "trainer.save_last=false", "trainer.test_freq=-1", "trainer.logger=[]",
        f"trainer.run_dir={run_dir}", *extra])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="steps per setting; the first is warm-up")
    p.add_argument("--workloads", default="bench,arith")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    phases = ["timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = common.make_model(tmp / "model")
        data_file = common.write_prompts(common.make_prompts(16 * args.steps), tmp / "train.parquet")
        for workload in args.workloads.split(","):
            rows, base = [], None
            for name, extra in [("warm-up (not shown)", [])] + settings():  # a process's first run pays once
                common.log(f"{workload}: {name}")
                if workload == "bench":
                    r = common.time_posttrain(model_dir, data_file, 16, 8, 16, args.steps, extra)
                else:
                    r = time_arith(args.steps, extra)
                if name.startswith("warm-up"):
                    continue
                s = common.median_after_warmup(r["step_s"])
                base = base or s
                rows.append([name, f"{s:.3f}", f"{s / base:.2f}", f"{r['response_length']:.1f}",
                             *(f"{r['phases'][k]:.3f}" if k in r["phases"] else "-" for k in phases)])
            print(f"\n{workload}: median s/step of steps 2..{args.steps}, {torch.get_num_threads()} threads\n")
            print(common.markdown_table(["setting", "s/step", "vs all on", "response length",
                                         *(k.split("/")[1] + " s" for k in phases)], rows))


if __name__ == "__main__":
    main()
