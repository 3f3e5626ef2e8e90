"""The TRL side of bench/trl_grpo.py: GRPO steps with trl's GRPOTrainer on the
benchmark model and prompts, timed per optimizer step.

Run by an interpreter that has trl (bench/trl_grpo.py starts it and builds
bench/.venv-trl when needed); not meant to be run by hand:

    bench/.venv-trl/bin/python bench/trl_side.py --config CONFIG.json --out RESULT.json

CONFIG.json: {"model_dir", "rows" (common.make_prompts rows), "prompts", "n",
"response_length", "steps", "threads", "lr", "beta", "temperature",
"batch_split" ("PER_DEVICExACCUMULATION", e.g. "128x1"), "output_dir"}, and optionally "device"
("cpu", the default, or "cuda") and "bf16" (mixed precision over float32 weights; default false).
RESULT.json: the seconds of each step, the completion lengths TRL logged,
what the reward function saw per call, and the versions that ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = json.loads(open(args.config).read())
    on_cpu = cfg.get("device", "cpu") == "cpu"
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])

    import accelerate
    import datasets
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.rewards.arith import compute_score

    prompts, n, length, steps = cfg["prompts"], cfg["n"], cfg["response_length"], cfg["steps"]
    per_device, accumulation = (int(x) for x in cfg["batch_split"].split("x"))
    if per_device * accumulation != prompts * n:
        raise SystemExit(f"batch split {cfg['batch_split']} is not {prompts} x {n} = {prompts * n} completions")

    dataset = datasets.Dataset.from_list([
        {"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]} for row in cfg["rows"]])

    reward_calls: list[dict] = []  # what each reward call saw: completions, distinct prompts, their lengths

    def arith_reward(completions, ground_truth, prompts=None, completion_ids=None, **kwargs):
        reward_calls.append({
            "completions": len(completions),
            "distinct_prompts": len({json.dumps(p, sort_keys=True) for p in prompts or []}),
            "token_lengths": sorted({len(ids) for ids in completion_ids or []}),
        })
        return [compute_score(c[0]["content"], gt) for c, gt in zip(completions, ground_truth, strict=True)]

    class StepTimer(TrainerCallback):
        """Seconds between on_train_begin and each on_step_end (one optimizer
        step: generation, scoring, the reference pass and the update), and the
        metrics TRL logs each step."""

        def __init__(self):
            self.step_s: list[float] = []
            self.cpu_s: list[float] = []  # CPU seconds of this process per step (all its threads)
            self.logs: list[dict] = []
            self.last = self.last_cpu = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            now, now_cpu = time.perf_counter(), time.process_time()
            self.step_s.append(now - self.last)
            self.cpu_s.append(now_cpu - self.last_cpu)
            self.last, self.last_cpu = now, now_cpu

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    config = GRPOConfig(
        output_dir=cfg["output_dir"],
        use_cpu=on_cpu,
        # float32 weights; bf16 autocast when asked for (GRPOConfig's default loads the model in bf16)
        bf16=bool(cfg.get("bf16", False)), fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        # GRPOConfig's default is True (layers recomputed in the backward); off, TRL does the same work as posttrain
        gradient_checkpointing=cfg.get("gradient_checkpointing", False),
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
        max_steps=steps,
        learning_rate=cfg["lr"],
        beta=cfg["beta"],
        num_iterations=1,
        num_generations=n,
        max_completion_length=length,
        temperature=cfg["temperature"],
        # One optimizer step = one generation of prompts x n completions: the generation batch is
        # per_device x steps_per_generation completions and steps_per_generation equals the accumulation
        # steps, so every step generates once and updates once (no importance-sampling pass needed).
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        # EOS disabled: the MinNewTokens processor masks the EOS logit until length tokens are out, so
        # every completion is exactly max_completion_length tokens long.
        generation_kwargs={"min_new_tokens": length},
    )
    trainer = GRPOTrainer(model=cfg["model_dir"], reward_funcs=arith_reward, args=config, train_dataset=dataset)
    if trainer.ref_model is None:
        raise SystemExit("no reference model although beta > 0")
    if config.generation_batch_size != prompts * n:
        raise SystemExit(f"generation batch {config.generation_batch_size} != {prompts * n}")
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()

    if len(timer.step_s) != steps:
        raise SystemExit(f"timed {len(timer.step_s)} steps, expected {steps}")
    if len(reward_calls) != steps or any(c["completions"] != prompts * n or c["distinct_prompts"] != prompts
                                         for c in reward_calls):
        raise SystemExit(f"expected {steps} reward calls of {prompts} prompts x {n}: {reward_calls}")
    lengths = {(log["completions/min_length"], log["completions/max_length"]) for log in timer.logs}
    if lengths != {(float(length), float(length))}:
        raise SystemExit(f"completion lengths (min, max) {lengths}, expected exactly {length}")
    result = {
        "step_s": timer.step_s,
        "cpu_s": timer.cpu_s,
        "response_length": statistics.mean(log["completions/mean_length"] for log in timer.logs),
        "completion_length_min": min(log["completions/min_length"] for log in timer.logs),
        "completion_length_max": max(log["completions/max_length"] for log in timer.logs),
        "kl": [log.get("kl") for log in timer.logs],
        "reward_calls": reward_calls,
        "ref_model": type(trainer.ref_model).__name__,
        "generation_batch_size": config.generation_batch_size,
        "batch_split": cfg["batch_split"],
        "threads": torch.get_num_threads(),
        "device": "cpu" if on_cpu else torch.cuda.get_device_name(0),
        "max_memory_allocated_gb": None if on_cpu else torch.cuda.max_memory_allocated() / 2 ** 30,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "accelerate": accelerate.__version__, "datasets": datasets.__version__},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
