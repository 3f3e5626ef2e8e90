"""A run directory over its life: where it is (a path, or a URL worked on
through a local copy), whether a run starts fresh in it or resumes from its
newest checkpoint, and the metrics of an abandoned timeline set aside.

    run_dir, remote = open_run_dir(tr.run_dir, project, experiment, nnodes, staging)
    ckpt = find_checkpoint(run_dir, resume_mode, resume_from_path)
    check_start(run_dir, ckpt, resume_mode, config, model_dir, distributed)   # before anything is written
    ...                                                                        # the run is built
    resume(run, ckpt)                                                          # with a checkpoint: last
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from posttrain.checkpoint.remote import RemoteRunDir, is_url
from posttrain.checkpoint.resume import check_compatible, is_sharded, restore
from posttrain.errors import CheckpointError, ConfigError


def open_run_dir(run_dir: str | None, project_name: str, experiment_name: str | None, nnodes: int,
                 staging: Path) -> tuple[Path, RemoteRunDir | None]:
    """-> the local directory the run works in, and the RemoteRunDir that mirrors it when trainer.run_dir is
    a URL (pulled into `staging`; checkpoints and metrics are pushed back), else None."""
    if not is_url(run_dir):
        return resolve_run_dir(run_dir, project_name, experiment_name), None
    if nnodes > 1:
        raise ConfigError(f"trainer.run_dir={run_dir} is a URL, but workers on {nnodes} nodes write "
                          "their shards to a path they all see: use a shared file system path")
    remote = RemoteRunDir(run_dir, staging)
    return remote.pull(), remote  # work locally; checkpoints and metrics are mirrored to the URL


def resolve_run_dir(run_dir: str | None, project_name: str, experiment_name: str | None) -> Path:
    """trainer.run_dir, else runs/<project_name>/<experiment_name or a timestamp>."""
    name = experiment_name or time.strftime("run-%Y%m%d-%H%M%S")
    return Path(run_dir) if run_dir else Path("runs") / project_name / name


def check_start(run_dir: Path, ckpt: Path | None, resume_mode: str, config: dict, model_dir: str,
                distributed: bool) -> None:
    """A checkpoint to resume from must match this run's config and model (checkpoint.check_compatible)
    and its workers (check_resumable); without one the directory must hold no earlier run (check_fresh_run_dir)."""
    if ckpt is not None:
        check_compatible(ckpt, config, model_dir)
        check_resumable(ckpt, distributed)
    else:
        check_fresh_run_dir(run_dir, resume_mode)


def check_fresh_run_dir(run_dir: Path, resume_mode: str) -> None:
    """Without a checkpoint to resume from, an earlier run's files are never
    mixed into. With resume_mode=auto the earlier run left no complete
    checkpoint (it died before its first, or saved none): one line says so,
    its metrics are set aside (appended to metrics.discarded.jsonl, never
    deleted) and its unfinished saves, never loaded, are overwritten. With
    disable the directory must be new."""
    metrics = run_dir / "metrics.jsonl"
    if resume_mode == "auto":
        moved = set_aside(metrics, keep_up_to=-1)
        if moved:
            print(f"posttrain: warning: {run_dir} holds an earlier run's metrics ({moved}) but no valid checkpoint "
                  f"to resume from: starting over at step 0, the old metrics appended to "
                  f"{metrics.with_name(DISCARDED)} (another trainer.experiment_name keeps runs apart)", file=sys.stderr)
        return
    leftovers = [p for p in (metrics, run_dir / "checkpoints") if p.exists()]
    if leftovers:
        raise ConfigError(
            f"run directory '{run_dir}' already holds an earlier run ({leftovers[0].name}) and "
            f"trainer.resume_mode={resume_mode}; choose another trainer.run_dir or trainer.experiment_name"
        )


def check_resumable(ckpt: Path, distributed: bool) -> None:
    """A one-process checkpoint resumes in one process only (its optimizer
    state is not sharded); a sharded one resumes with any number of workers."""
    if distributed and not is_sharded(ckpt):
        raise CheckpointError(
            f"checkpoint {ckpt} was written by a one-process run; resume it with trainer.n_gpus_per_node=1 "
            f"trainer.nnodes=1, or start a new run on Ray workers from its weights: model.path={ckpt / 'actor'}")


def resumed_model_dirs(ckpt: Path | None) -> tuple[str | None, str | None]:
    """The policy's and the critic's weights to build the workers from: a one-process checkpoint's actor/
    and critic/ (None where it has none). None for a fresh run, and for a sharded checkpoint, whose workers
    load their shards after they are built (checkpoint.restore)."""
    if ckpt is None or is_sharded(ckpt):
        return None, None
    return str(ckpt / "actor"), (str(ckpt / "critic") if (ckpt / "critic").is_dir() else None)


def resume(run, ckpt: Path) -> None:
    """Load `ckpt` into the built `run` (checkpoint.restore: weights, optimizer, sampler, random state) and
    set aside the metrics of the steps after it. Last: nothing after this may draw random numbers."""
    restore(run, ckpt)
    moved = set_aside(run.run_dir / "metrics.jsonl", keep_up_to=run.global_step)
    after = f"; the metrics logged after it ({moved}) appended to {DISCARDED}" if moved else ""
    print(f"posttrain: resuming from {ckpt} (step {run.global_step}){after}", file=sys.stderr)
    if run.global_step >= run.total_steps:
        print(f"posttrain: the run in {run.run_dir} is finished (step {run.global_step} of {run.total_steps}): "
              "nothing to train; raise trainer.total_training_steps (or total_epochs) to go on, or give another "
              "trainer.experiment_name for a new run", file=sys.stderr)


DISCARDED = "metrics.discarded.jsonl"


def set_aside(metrics: Path, keep_up_to: int) -> str:
    """Keep the metrics of steps <= keep_up_to; append the rest (steps of a timeline abandoned by a crash, or
    of an earlier run) to metrics.discarded.jsonl. -> what was moved, for a message ('41 lines, steps 0-40';
    '' if nothing)."""
    if not metrics.exists():
        return ""
    keep, drop, steps = [], [], []
    for line in filter(str.strip, metrics.read_text().splitlines()):
        step = _step(line)
        if step is None:
            drop.append(line)  # a line cut short by a kill
            continue
        if step <= keep_up_to:
            keep.append(line)
        else:
            drop.append(line)
            steps.append(step)
    if not drop:
        return ""
    with open(metrics.with_name(DISCARDED), "a", encoding="utf-8") as fh:
        fh.write("\n".join(drop) + "\n")
    metrics.write_text("".join(line + "\n" for line in keep))
    lines = f"{len(drop)} line{'s' * (len(drop) > 1)}"
    if not steps:
        return lines
    return f"{lines}, step {steps[0]}" if min(steps) == max(steps) else f"{lines}, steps {min(steps)}-{max(steps)}"


def _step(line: str) -> float | None:
    """A metrics line's step, None for a line that is not one (cut short by a kill)."""
    try:
        step = json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None
