"""The supervised fine-tuning loop (`posttrain sft`): `sft_step()` is one step top to bottom; `train_sft()` runs
many. The same workers, checkpoints, resume, loggers and stop signals as the RL loop (lifecycle.py); the step is a
batch of SFT examples (data/sft.py) and one optimizer step of next-token cross-entropy (training/sft.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.data.dataset import PromptSampler
from posttrain.data.sft import SFTExample, collate
from posttrain.driver.lifecycle import (
    close, due, install_stop_handlers, open_logger, restore_stop_handlers, save, stop_if_asked,
)
from posttrain.driver.nonfinite import NonfiniteGuard, update_fault
from posttrain.metrics.flops import ModelFlops
from posttrain.metrics.logger import MetricsLogger, format_sft_line, perf_metrics, timed
from posttrain.runtime.profiling import StepProfiler
from posttrain.worker.verbs import Worker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.checkpoint import CheckpointWriter
    from posttrain.config import Config
    from posttrain.distributed.group import WorkerGroup

VAL_CHUNK = 256  # validation rows collated and scored at a time


@dataclass
class SFTRun:
    """What a supervised run holds between steps (built by `posttrain.driver.build_sft.build_sft_run`). Its fields
    are named as the RL Run's where they mean the same: the run's lifecycle (lifecycle.py: saving, stopping, the
    logger) and resuming (checkpoint.resume) are shared."""

    cfg: Config
    run_dir: Path
    actor: Worker | WorkerGroup
    tokenizer: PreTrainedTokenizerBase
    train_data: list[SFTExample]
    val_data: list[SFTExample] | None
    sampler: PromptSampler
    total_steps: int
    writer: CheckpointWriter
    model_dir: str = ""
    resumed_from: Path | None = None
    global_step: int = 0
    stop_signal: int | None = None
    flops: ModelFlops | None = None
    peak_flops: float | None = None
    guard: NonfiniteGuard | None = None
    profiler: StepProfiler = field(default_factory=StepProfiler)

    def __post_init__(self):
        if self.guard is None:
            self.guard = NonfiniteGuard(self.cfg.trainer.max_nonfinite_steps)


def sft_step(run: SFTRun, examples: list[SFTExample]) -> tuple[dict[str, float], dict]:
    """One supervised step: collate the examples, one optimizer step over them on the workers. -> (metrics,
    the collated batch)."""
    m: dict[str, float] = {}
    batch = collate(examples, run.tokenizer.pad_token_id)  # input_ids, attention_mask, labels [B, L]
    with timed(m, "update_actor"):
        m.update(run.actor.sft_step(batch))
    m["train/nonfinite_steps"] = run.guard.observe(run.global_step + 1, update_fault(m))
    return m, batch


def validation_loss(run: SFTRun) -> dict[str, float]:
    """val/loss: the mean -log p over every learned token of the validation examples."""
    m: dict[str, float] = {}
    with timed(m, "testing"):
        nll, tokens = 0.0, 0
        for start in range(0, len(run.val_data), VAL_CHUNK):
            part = collate(run.val_data[start:start + VAL_CHUNK], run.tokenizer.pad_token_id)
            s, n = run.actor.sft_loss(part)
            nll, tokens = nll + s, tokens + n
    m["val/loss"] = nll / max(tokens, 1)
    return m


def train_sft(run: SFTRun) -> dict[str, float]:
    """Validate, run steps up to `total_steps` (validating every test_freq and saving every save_freq steps, and
    at the end unless save_last is false), validate again. SIGTERM/SIGINT: the step finishes, a checkpoint is
    written, `Preempted` raised.
    -> summary: val_before, val_after, loss_first, loss_last, steps, seconds, run_dir"""
    tr = run.cfg.trainer
    logger = open_logger(run, line=format_sft_line)
    summary: dict = {"run_dir": str(run.run_dir), "start_step": run.global_step}
    start = time.perf_counter()
    previous = install_stop_handlers(run)
    try:
        if run.val_data is not None and tr.val_before_train and run.resumed_from is None:
            m = validation_loss(run)
            summary["val_before"] = m["val/loss"]
            logger.log(m, run.global_step)
        while run.global_step < run.total_steps:
            metrics: dict = {}
            with run.profiler.step(run.global_step + 1), timed(metrics, "step"):
                epoch, indices = run.sampler.next_batch()
                step_metrics, batch = sft_step(run, [run.train_data[i] for i in indices])
                metrics.update(step_metrics)
                metrics["training/epoch"] = float(epoch)
                run.global_step += 1
                metrics["training/global_step"] = float(run.global_step)
                validating, saving = due(run, run.val_data is not None)
                if validating:
                    metrics.update(validation_loss(run))
                    summary["val_after"] = metrics["val/loss"]
                if saving:
                    save(run, metrics)
            summary.setdefault("loss_first", metrics["train/loss"])
            summary["loss_last"] = metrics["train/loss"]
            log_step(run, logger, metrics, batch)
            stop_if_asked(run)
    finally:
        restore_stop_handlers(previous)
        close(run, logger)
    summary["steps"] = run.global_step
    summary["seconds"] = time.perf_counter() - start
    return summary


class _Rows:
    """What perf_metrics reads of a batch: its real tokens (all of them trained on) and no shared prompts."""

    def __init__(self, batch: dict):
        self.attention_mask = batch["attention_mask"]


def log_step(run: SFTRun, logger: MetricsLogger, metrics: dict, batch: dict) -> None:
    """The step's line: its metrics with throughput, MFU and peak memory."""
    world = getattr(run.actor, "world_size", 1)
    metrics.update(perf_metrics(metrics, _Rows(batch), run.flops, run.peak_flops, 1, world, share_prompt=False))
    metrics.update(run.actor.memory())
    logger.log(metrics, run.global_step)
