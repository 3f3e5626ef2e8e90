"""What the benchmarks share: the model directory, the prompts, and a timed
posttrain run.

The model has the embedded tiny model's architecture (Qwen2, its byte-level
tokenizer and chat template, 4 layers, 4 heads, 2 KV heads) at hidden size 256
(intermediate 768, about 3.2M parameters), seeded and untrained: a benchmark
times the work, not what is learnt.

The prompts are synthetic sums of 2 to 6 numbers ("Add 12, 345 and 7."),
which gives prompts of different lengths (about 30 to 60 tokens with the
chat template), scored by the arith reward (the last integer of the response
against the sum).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

BENCH_SPEC = dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2)


def make_model(output_dir: str | Path, seed: int = 0, spec: dict | None = None) -> Path:
    """Write the benchmark model (config, safetensors, tokenizer) to `output_dir` (`spec`: other sizes)."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from posttrain.tiny.arith import TinySpec, _config
    from posttrain.models.tokenizer import write_tokenizer

    out = Path(output_dir)
    write_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_config(TinySpec(**(spec or BENCH_SPEC)), tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_prompts(count: int, seed: int = 0) -> list[dict]:
    """`count` rows in posttrain's (verl's) parquet schema: a user message
    asking for a sum of 2..6 numbers, and the sum as the ground truth."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        numbers = [rng.randint(1, 999) for _ in range(rng.randint(2, 6))]
        text = "Add " + ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}."
        rows.append({
            "data_source": "arith",
            "prompt": [{"role": "user", "content": text}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(sum(numbers))},
            "extra_info": {"index": i},
        })
    return rows


def write_prompts(rows: list[dict], path: str | Path) -> Path:
    from posttrain.data.schema import write_rows

    return write_rows(rows, Path(path))


def posttrain_overrides(model_dir: Path, data_file: Path, run_dir: Path, prompts: int, n: int, response_length: int,
                        steps: int) -> list[str]:
    """The settings both sides share, in posttrain's (verl's) keys: `prompts`
    x `n` samples per step, responses of exactly `response_length` tokens, KL
    to the reference as a loss (beta 0.04, the k3 estimator), one update per
    step, float32."""
    return [
        f"model.path={model_dir}", "model.dtype=float32",
        f"data.train_files=[{data_file}]", "data.val_files=null", "trainer.val_before_train=false",
        f"data.train_batch_size={prompts}", f"data.max_response_length={response_length}",
        f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.ignore_eos=True",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor.ppo_mini_batch_size={prompts}", "actor.ppo_epochs=1", "actor.lr=1e-6",
        # 64 sequences per training micro-batch (or what divides the batch): on 2 cores faster than 8 (the
        # default), 32 or all 128 at once
        f"actor.ppo_micro_batch_size={math.gcd(64, prompts * n)}",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.04", "actor.kl_loss_type=low_var_kl",
        f"trainer.total_training_steps={steps}", "trainer.save_last=false", "trainer.test_freq=-1",
        "trainer.logger=[]", f"trainer.run_dir={run_dir}", "trainer.device=cpu",
    ]


def time_posttrain(model_dir: Path, data_file: Path, prompts: int, n: int, response_length: int, steps: int,
                   extra: list[str] = ()) -> dict:
    """Train `steps` steps of the benchmark's work in this process (see `timed_run`)."""
    return timed_run(lambda run_dir: posttrain_overrides(model_dir, data_file, run_dir, prompts, n, response_length,
                                                         steps) + list(extra))


def timed_run(overrides) -> dict:
    """Train with the config `overrides(run_dir)` in this process; -> seconds
    of each step (as the run's metrics.jsonl records timing_s/step), the mean
    response length and the median seconds of each phase (timing_s/...) after
    the first step."""
    from posttrain.driver.build import build_run
    from posttrain.config import load_config
    from posttrain.driver.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        train(build_run(load_config(None, overrides(Path(tmp) / "run"))))
        lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m for m in lines if "timing_s/step" in m]
    return {"step_s": [m["timing_s/step"] for m in steps_m],
            "response_length": statistics.mean(m["response_length/mean"] for m in steps_m),
            "phases": {k: statistics.median(m.get(k, 0.0) for m in steps_m[1:] or steps_m)
                       for k in steps_m[-1] if k.startswith("timing_s/")}}


def median_after_warmup(times: list[float]) -> float:
    """The median seconds per step, the first (warm-up) step left out."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def versions() -> str:
    import platform

    import transformers

    import posttrain

    return (f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"posttrain {getattr(posttrain, '__version__', '?')}, {torch.get_num_threads()} threads")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def learning_parser(description: str, settings: dict, default: str, steps_help: str) -> argparse.ArgumentParser:
    """The arguments of the learning benches (env_learning.py, vision_learning.py): which settings (a comma list
    of `settings`' names), seeds, steps, the training-score window, the work directory, a JSON log."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--settings", default=default, help=f"comma list of {', '.join(settings)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, help=steps_help)
    p.add_argument("--window", type=int, default=10, help="steps of the training-score windows (default 10)")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path, help="append each run's figures as a JSON line")
    return p


def chosen_settings(text: str, settings: dict) -> list[str]:
    """--settings' comma list, each a name of `settings` (else the bench stops naming the unknown ones)."""
    chosen = text.split(",")
    bad = [s for s in chosen if s not in settings]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {', '.join(settings)}")
    return chosen


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table; cells are written with str()."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
