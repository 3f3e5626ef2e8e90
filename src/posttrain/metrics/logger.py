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

from posttrain.runtime.profiling import phase


@contextmanager
def timed(metrics: dict, name: str):
    """Adds the block's wall time to metrics[f"timing_s/{name}"]; in a profiled step the block is a
    profiler phase (profiling.phase: a record_function or NVTX range named `name`)."""
    start = time.perf_counter()
    try:
        with phase(name):
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
    # not attention - response: an empty response's EOS is attended, unmasked
    prompt_lengths = batch.attention_mask[:, :batch.prompt_width].sum(-1)
    _stats("prompt_length", prompt_lengths, m)
    return m


def perf_metrics(m: dict, batch, flops, peak_flops: float | None, ppo_epochs: int, devices: int,
                 share_prompt: bool = False) -> dict:
    """Tokens, throughput and MFU of a finished step (`m` holds its timings
    and perf/flops/rollout). FLOPs count real tokens only, each group's prompt
    once in the update with share_prompt (see flops.py)."""
    from posttrain.metrics.flops import mfu

    tokens = float(batch.attention_mask.sum())
    out = {"perf/total_num_tokens": tokens, "perf/throughput": tokens / m["timing_s/step"] / devices}  # per device
    if flops is None:
        return out
    if "perf/flops/rollout" in m:
        out["perf/mfu/rollout"] = mfu(m["perf/flops/rollout"], m.get("timing_s/gen", 0.0), peak_flops, devices)
    if "timing_s/update_actor" in m:  # not during the critic's warm-up
        if share_prompt:
            p = batch.prompt_width
            per_epoch = flops.training_shared(batch.attention_mask[:, :p].sum(-1), batch.attention_mask[:, p:].sum(-1),
                                              batch.group)
        else:
            per_epoch = flops.training(batch.attention_mask.sum(-1))
        out["perf/flops/actor"] = ppo_epochs * per_epoch
        out["perf/mfu/actor"] = mfu(out["perf/flops/actor"], m["timing_s/update_actor"], peak_flops, devices)
    return {k: v for k, v in out.items() if v is not None}


def raise_measured_peak(perf: dict, peak: float, keys: list[str]) -> float | None:
    """A step's perf metrics with an MFU over 1 against a measured CPU peak: the peak was measured too low
    (on a busy machine). -> the FLOP/s per device the step achieved, now the cached peak of `keys` (with a
    warning); None when no MFU is over 1."""
    from posttrain.metrics.flops import raise_cpu_peak

    top = max((v for k, v in perf.items() if k.startswith("perf/mfu/")), default=0.0)
    if top <= 1.0:
        return None
    achieved = top * peak
    for key in keys:
        raise_cpu_peak(key, achieved)
    print(f"posttrain: warning: a step computed {achieved / 1e9:.1f} GFLOP/s per device, more than the CPU's "
          f"measured peak ({peak / 1e9:.1f}, measured while the machine was busy?): MFU is measured against "
          "that from now on, and the next run measures the peak again", file=sys.stderr)
    return achieved


# The console line: fixed-width fields, so the columns line up from step to step.
# (label, metric, format, width)
CONSOLE_FIELDS = [
    ("score", "critic/score/mean", "{:.3f}", 6),
    ("val", "val/score/mean", "{:.3f}", 5),
    ("kl", "actor/kl_loss", "{:.4f}", 6),
    ("ent", "actor/entropy", "{:.3f}", 5),
    ("len", "response_length/mean", "{:.1f}", 5),
    ("gen", "timing_s/gen", "{:.2f}", 5),
    ("rew", "timing_s/reward", "{:.2f}", 4),
    ("logp", "timing_s/old_log_prob", "{:.2f}", 4),
    ("ref", "timing_s/ref", "{:.2f}", 4),
    ("upd", "timing_s/update_actor", "{:.2f}", 5),
    ("step", "timing_s/step", "{:.2f}", 5),
]


def _fmt(m: dict, key: str, fmt: str, width: int) -> str:
    v = m.get(key)
    text = "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)
    return text.rjust(width)


def format_line(step: int, total: int, m: dict) -> str:
    """One compact line per step, aligned across steps:
    score, validation score, KL loss, entropy, mean response length, seconds
    by phase (gen, reward, old log-prob, ref, update, whole step), tokens/s
    per device and the actor's MFU."""
    head = f"step {step}/{total}".ljust(len(f"step {total}/{total}"))  # `^step 7/` stays greppable
    if "critic/score/mean" not in m:  # a validation on its own (before training)
        per_source = ", ".join(f"{k[4:-11]} {v:.3f}" for k, v in m.items()
                               if k.startswith("val/") and k.endswith("/score/mean") and k != "val/score/mean")
        return f"{head.rstrip()} | validation score {_fmt(m, 'val/score/mean', '{:.3f}', 0)} ({per_source})"
    return _step_line(head, m, CONSOLE_FIELDS, timings_from=5)


def _step_line(head: str, m: dict, fields_spec, timings_from: int) -> str:
    """head | each field (label value) | the timing fields together, in seconds | tokens/s | the actor's MFU."""
    fields = [f"{label} {_fmt(m, key, fmt, w)}" for label, key, fmt, w in fields_spec]
    tail = f"{_fmt(m, 'perf/throughput', '{:.0f}', 6)} tok/s"
    if "perf/mfu/actor" in m:
        tail += f" | mfu {100 * m['perf/mfu/actor']:5.2f}%"
    return " | ".join([head, *fields[:timings_from], " ".join(fields[timings_from:]) + " s", tail])


SFT_FIELDS = [
    ("loss", "train/loss", "{:.4f}", 6),
    ("val", "val/loss", "{:.4f}", 6),
    ("lr", "train/lr", "{:.2e}", 8),
    ("gnorm", "train/grad_norm", "{:.3f}", 6),
    ("upd", "timing_s/update_actor", "{:.2f}", 5),
    ("step", "timing_s/step", "{:.2f}", 5),
]


def format_sft_line(step: int, total: int, m: dict) -> str:
    """posttrain sft's line: training and validation loss, LR, gradient norm, seconds, tokens/s, MFU."""
    head = f"step {step}/{total}".ljust(len(f"step {total}/{total}"))  # as format_line's
    if "train/loss" not in m:  # a validation on its own (before training)
        return f"{head.rstrip()} | validation loss {_fmt(m, 'val/loss', '{:.4f}', 0)}"
    return _step_line(head, m, SFT_FIELDS, timings_from=4)


class MetricsLogger:
    """Appends every step's metrics to `metrics.jsonl` and sample completions
    to `samples.jsonl` (always), prints a line to the console when 'console'
    is among `names`, and passes both on to `sinks` (sinks.py: TensorBoard,
    wandb, MLflow)."""

    def __init__(self, run_dir: Path, names: list[str], total_steps: int, sinks: list | None = None,
                 line=format_line):
        self.run_dir = Path(run_dir)
        self.line = line  # (step, total, metrics) -> the console line
        self.console = "console" in names
        self.total_steps = total_steps
        self.sinks = list(sinks or [])
        self._file = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.console:
            tqdm.write(self.line(step, self.total_steps, metrics), file=sys.stdout)
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        if not rows:
            return
        rows = [{"step": step, **{k: _plain(v) for k, v in row.items()}} for row in rows]
        with open(self.run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        for sink in self.sinks:
            sink.log_samples(rows, step)

    def close(self) -> None:
        self._file.close()
        for sink in self.sinks:
            sink.close()


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    return v
