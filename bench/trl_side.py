"""The TRL side of bench/trl_grpo.py: GRPO steps with trl's GRPOTrainer on the
benchmark model and prompts, timed per optimizer step.

Run by an interpreter that has trl (bench/trl_grpo.py starts it and builds
bench/.venv-trl when needed); not meant to be run by hand:

    bench/.venv-trl/bin/python bench/trl_side.py --config CONFIG.json --out RESULT.json

CONFIG.json: {"model_dir", "rows" (common.make_prompts rows), "prompts", "n",
"response_length", "steps", "threads", "lr", "beta", "temperature",
"batch_split" ("PER_DEVICExACCUMULATION", e.g. "128x1"), "output_dir"}, and optionally "device"
("cpu", the default, or "cuda") and "bf16" (mixed precision over float32 weights; default false); for
bench/gpu/suite.py's speed part also "continuous_batching" (GRPOConfig's
use_transformers_continuous_batching: transformers' continuous batching instead of
generate(); RESULT.json says "unavailable" where this trl lacks it; "continuous_batching_config":
its ContinuousBatchingConfig's fields, TRL's defaults when absent), "phase_timers" (seconds
per step of generation, the reference and old log-prob passes and the update, each timer
synchronising CUDA: see phase_timers below), "profile_step" (that step, from 1, runs under
torch.profiler for the device's busy fraction: bench/gpu/busy.py) and "strict_lengths" (default
true: every completion exactly response_length tokens, or exit).
RESULT.json: the seconds of each step, the completion lengths TRL logged,
what the reward function saw per call, and the versions that ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

TRL_PHASES = ("gen", "ref", "old_log_prob", "update", "score_other")


def phase_timers(trainer, sync) -> dict:
    """Wraps the trainer's methods (on the instance) with timers that call `sync` (CUDA's) before and after;
    -> the dict the seconds accumulate in: TRL 1.16's GRPOTrainer, where
      - generate_and_score: _generate_and_score_completions (called from training_step's _prepare_inputs on
        the step's first micro-batch: generation, rewards, advantages, the no-grad log-prob passes);
      - gen: _generate (the prompts' templating and tokenization, generate() or continuous batching's
        generate_batch, decoding); generate_call: _generate_single_turn, the generation call alone;
      - ref / old_log_prob: _get_per_token_logps_and_entropies called without grad on the reference model /
        on the policy (the old log-probs: only when generation and the optimizer step are misaligned);
    the update is the step's time outside generate_and_score (every micro-batch's forward and backward,
    the optimizer step, TRL's logging), computed per step by the caller."""
    spent: dict = defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                spent[name] += time.perf_counter() - start
        return wrapper

    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)
    trainer._generate = timed("gen", trainer._generate)
    trainer._generate_single_turn = timed("generate_call", trainer._generate_single_turn)
    logps = trainer._get_per_token_logps_and_entropies
    timed_ref, timed_old = timed("ref", logps), timed("old_log_prob", logps)

    def route(model, *args, **kwargs):
        if torch.is_grad_enabled():  # the update's forward, inside training_step
            return logps(model, *args, **kwargs)
        return (timed_ref if model is trainer.ref_model else timed_old)(model, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = route
    return spent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = json.loads(open(args.config).read())
    on_cpu = cfg.get("device", "cpu") == "cpu"
    cuda = not on_cpu and torch.cuda.is_available()

    def sync():
        if cuda:
            torch.cuda.synchronize()
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
        metrics TRL logs each step; with phase timers, each step's phases (the
        device synchronised at the step's end), and the profiled step's busy
        fraction (its profiler started and stopped outside the steps' times)."""

        def __init__(self):
            self.step_s: list[float] = []
            self.cpu_s: list[float] = []  # CPU seconds of this process per step (all its threads)
            self.logs: list[dict] = []
            self.phases: list[dict] = []
            self.spent: dict | None = None  # phase_timers' dict, when timed
            self.busy: dict | None = None
            self._busy = None
            self.last = self.last_cpu = 0.0

        def _maybe_profile(self, next_step: int):
            if cfg.get("profile_step") == next_step:
                sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
                from busy import StepBusy

                self._busy = StepBusy(cuda)
                self._busy.start()

        def on_train_begin(self, args, state, control, **kwargs):
            self._maybe_profile(1)
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            if self.spent is not None:
                sync()
            now, now_cpu = time.perf_counter(), time.process_time()
            self.step_s.append(now - self.last)
            self.cpu_s.append(now_cpu - self.last_cpu)
            if self.spent is not None:
                p = dict(self.spent)
                self.spent.clear()
                gs = p.get("generate_and_score", 0.0)
                p["update"] = self.step_s[-1] - gs
                p["score_other"] = gs - p.get("gen", 0.0) - p.get("ref", 0.0) - p.get("old_log_prob", 0.0)
                self.phases.append(p)
            if self._busy is not None:
                self.busy = {"step": len(self.step_s), **self._busy.stop()}
                self._busy = None
            self._maybe_profile(len(self.step_s) + 1)
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    def unavailable(why: str) -> None:
        with open(args.out, "w") as f:
            json.dump({"unavailable": why, "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                                         "torch": torch.__version__}}, f, indent=1)

    # EOS disabled: the MinNewTokens processor masks the EOS logit until length tokens are out, so
    # every completion is exactly max_completion_length tokens long.
    generation_kwargs, extra = {"min_new_tokens": length}, {}
    continuous = bool(cfg.get("continuous_batching"))
    if continuous:
        if "use_transformers_continuous_batching" not in getattr(GRPOConfig, "__dataclass_fields__", {}):
            unavailable(f"trl {trl.__version__}'s GRPOConfig has no use_transformers_continuous_batching")
            return
        extra["use_transformers_continuous_batching"] = True
        if cfg.get("continuous_batching_config"):  # transformers' ContinuousBatchingConfig's fields
            extra["transformers_continuous_batching_config"] = cfg["continuous_batching_config"]
        # continuous batching's requests take no logits processors (min_new_tokens is ignored); an EOS id of -1
        # is its "no EOS" (transformers 5.x, continuous_api: a request's EOS ids are those >= 0)
        generation_kwargs["eos_token_id"] = -1
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
        generation_kwargs=generation_kwargs,
        **extra,
    )
    if cfg.get("profile_step") and cuda:  # continuous batching captures CUDA graphs: the profiler first
        sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
        from busy import prepare_for_cuda_graphs

        prepare_for_cuda_graphs()
    try:
        trainer = GRPOTrainer(model=cfg["model_dir"], reward_funcs=arith_reward, args=config, train_dataset=dataset)
    except ImportError as e:  # continuous batching asks a newer transformers than this one
        if not continuous:
            raise
        unavailable(f"GRPOTrainer with use_transformers_continuous_batching=True: {e}")
        return
    if trainer.ref_model is None:
        raise SystemExit("no reference model although beta > 0")
    if config.generation_batch_size != prompts * n:
        raise SystemExit(f"generation batch {config.generation_batch_size} != {prompts * n}")
    timer = StepTimer()
    if cfg.get("phase_timers"):
        timer.spent = phase_timers(trainer, sync)
    trainer.add_callback(timer)
    trainer.train()

    if len(timer.step_s) != steps:
        raise SystemExit(f"timed {len(timer.step_s)} steps, expected {steps}")
    if len(reward_calls) != steps or any(c["completions"] != prompts * n or c["distinct_prompts"] != prompts
                                         for c in reward_calls):
        raise SystemExit(f"expected {steps} reward calls of {prompts} prompts x {n}: {reward_calls}")
    lengths = {(log["completions/min_length"], log["completions/max_length"]) for log in timer.logs}
    if lengths != {(float(length), float(length))} and cfg.get("strict_lengths", True):
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
        "continuous_batching": bool(getattr(config, "use_transformers_continuous_batching", False)),
        # continuous batching casts the policy to bf16 in place to generate (TRL 1.16): then it trains in bf16
        "policy_dtype_after": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
        "phases_s": timer.phases if cfg.get("phase_timers") else None,
        "busy": timer.busy,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "accelerate": accelerate.__version__, "datasets": datasets.__version__},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
