"""Metric names, reductions and sinks.

Names follow verl's where verl has one (`critic/score/mean`,
`actor/pg_loss`, `timing_s/gen`, `perf/throughput`, `val/score/mean`, ...),
because that is what users are told to watch.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm


@contextmanager
def timed(metrics: dict, name: str):
    """Adds the block's wall time to metrics[f"timing_s/{name}"]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor, out: dict) -> None:
    values = values.float()
    if values.numel() == 0:
        return
    out[f"{prefix}/mean"] = values.mean().item()
    out[f"{prefix}/max"] = values.max().item()
    out[f"{prefix}/min"] = values.min().item()


def batch_metrics(batch, max_response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages and lengths of a finished step's batch."""
    m: dict[str, float] = {}
    mask = batch.response_mask.bool()
    _stats("critic/score", batch.token_level_scores.sum(-1), m)
    _stats("critic/rewards", batch.token_level_rewards.sum(-1), m)
    _stats("critic/advantages", batch.advantages[mask], m)
    _stats("critic/returns", batch.returns[mask], m)
    if batch.values is not None:  # PPO with a critic
        from posttrain.algorithms import explained_variance

        _stats("critic/values", batch.values[mask], m)
        m["critic/vf_explained_var"] = float(explained_variance(batch.values, batch.returns, batch.response_mask))
    lengths = batch.response_mask.sum(-1)
    _stats("response_length", lengths, m)
    m["response_length/clip_ratio"] = (lengths >= max_response_length).float().mean().item()
    prompt_lengths = batch.attention_mask.sum(-1) - lengths
    _stats("prompt_length", prompt_lengths, m)
    return m


def format_line(step: int, total: int, m: dict) -> str:
    """One compact console line per step."""

    def f(key, fmt="{:.3f}"):
        v = m.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    if "critic/score/mean" not in m:  # a validation on its own (before training)
        per_source = ", ".join(f"{k[4:-11]} {v:.3f}" for k, v in m.items()
                               if k.startswith("val/") and k.endswith("/score/mean") and k != "val/score/mean")
        return f"step {step}/{total} | validation score {f('val/score/mean')} ({per_source})"
    parts = [
        f"step {step}/{total}",
        f"score {f('critic/score/mean')}",
        f"pg_loss {f('actor/pg_loss', '{:+.4f}')}",
        f"kl {f('actor/kl_loss', '{:.4f}')}",
        f"entropy {f('actor/entropy')}",
        f"resp_len {f('response_length/mean', '{:.1f}')}",
        f"gen {f('timing_s/gen', '{:.2f}')}s",
        f"update {f('timing_s/update_actor', '{:.2f}')}s",
        f"step {f('timing_s/step', '{:.2f}')}s",
        f"{f('perf/throughput', '{:.0f}')} tok/s",
    ]
    if "val/score/mean" in m:
        parts.insert(2, f"val {f('val/score/mean')}")
    return " | ".join(parts)


class MetricsLogger:
    """Appends every step's metrics to `metrics.jsonl` (always) and prints a
    line to the console when 'console' is among the sinks."""

    def __init__(self, run_dir: Path, sinks: list[str], total_steps: int):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.console = "console" in sinks
        self.total_steps = total_steps
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.console:
            tqdm.write(format_line(step, self.total_steps, metrics), file=sys.stdout)

    def close(self) -> None:
        self._file.close()


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    return v
