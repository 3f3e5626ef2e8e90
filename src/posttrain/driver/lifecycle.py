"""A run's lifecycle, shared by the RL loop (loop.py) and the supervised one (sft.py): its logger, when a step
validates and saves, the checkpoint, the stop signals, and closing what it started.

Both take a run object with these fields: cfg, run_dir, actor (a Worker or WorkerGroup), writer (a
CheckpointWriter), sampler, guard (a NonfiniteGuard), profiler, total_steps, global_step, stop_signal, model_dir.
Neither loop imports the other.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from posttrain.config import config_to_dict
from posttrain.errors import NonfiniteError, Preempted
from posttrain.metrics.logger import MetricsLogger, format_line, timed
from posttrain.metrics.sinks import make_sinks


def open_logger(run, line=format_line) -> MetricsLogger:
    """metrics.jsonl, the console line (`line`) and the loggers of trainer.logger (make_sinks redacts the
    config it hands them)."""
    tr = run.cfg.trainer
    return MetricsLogger(run.run_dir, tr.logger, run.total_steps, line=line, sinks=make_sinks(
        tr.logger, run.run_dir, tr.project_name, run.run_dir.name, config_to_dict(run.cfg)))


def due(run, has_validation: bool) -> tuple[bool, bool]:
    """After run.global_step steps: (validate now, save now). Validation every trainer.test_freq steps and at
    the last (unless trainer.val_at_end is false); a checkpoint every trainer.save_freq steps (save_freq > 0), at
    the last (unless trainer.save_last is false), and always on a stop (a signal, or a streak of non-finite steps)."""
    tr = run.cfg.trainer
    last = run.global_step == run.total_steps
    periodic = tr.test_freq > 0 and run.global_step % tr.test_freq == 0
    validating = has_validation and ((last and tr.val_at_end) or periodic)
    stopping = run.stop_signal is not None or run.guard.exhausted
    saving = stopping or (last and tr.save_last) or (tr.save_freq > 0 and run.global_step % tr.save_freq == 0)
    return validating, saving


def save(run, m: dict, kl_ctrl=None, ahead=None) -> None:
    """Checkpoint the state after `run.global_step` steps (written in the background with trainer.async_save;
    the copy is taken now). RL's extras: its KL controller's state and the batches sampled ahead (`ahead`:
    asynchronous training; the sampler's position is after them)."""
    with timed(m, "save_checkpoint"):
        trainer_state = {"epoch": run.sampler.epoch, "sampler": run.sampler.state_dict(),
                         "kl_ctrl": kl_ctrl.state_dict() if kl_ctrl is not None else None,
                         "nonfinite": run.guard.state_dict(),
                         "model_dir": str(run.model_dir)}
        snap = run.actor.snapshot(run.global_step, run.writer, trainer_state, m)
        if ahead is not None:
            snap.rollouts_ahead = ahead.state()
        run.writer.save(snap)


def stop_if_asked(run) -> None:
    """NonfiniteError after a streak of non-finite steps (trainer.max_nonfinite_steps), Preempted after
    SIGTERM/SIGINT: raised once the step's checkpoint is written."""
    if run.guard.exhausted:
        run.writer.wait()
        raise NonfiniteError(run.guard.message(run.global_step, run.run_dir / "checkpoints"))
    if run.stop_signal is not None:
        run.writer.wait()
        raise Preempted(
            f"stopped by {signal.Signals(run.stop_signal).name} after step {run.global_step}; checkpoint "
            f"saved in {run.run_dir / 'checkpoints'}; run the same command again to resume")


def close(run, logger: MetricsLogger) -> None:
    """What every run started: the logger, the checkpoint writer (after its last save), the workers, the
    profiler."""
    logger.close()
    run.writer.close()
    run.actor.shutdown()
    run.profiler.close()


def install_stop_handlers(run) -> dict:
    """First SIGTERM/SIGINT: stop after the current step, with a checkpoint.
    Second: exit at once (status 128 + signal)."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # signal handlers can only be set from the main thread

    def on_signal(signum, frame):
        if run.stop_signal is not None:
            os._exit(128 + signum)
        run.stop_signal = signum
        print(f"posttrain: {signal.Signals(signum).name}: finishing step {run.global_step + 1}, then saving a "
              "checkpoint and stopping (send it again to exit at once)", file=sys.stderr, flush=True)

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_stop_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
