"""Where a run resumes from, whether it may, and putting the state back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from posttrain.checkpoint.manifest import latest_valid, list_checkpoints, verify
from posttrain.checkpoint.state import ROLLOUTS_AHEAD, restore_rng
from posttrain.config import SCHEMA, flatten
from posttrain.config.dialects import verl
from posttrain.errors import CheckpointError, ConfigError
from posttrain.text.redact import matches_redacted, redact_mapping
from posttrain.text.lines import one_line
from posttrain.files.yamlfile import UnreadableYaml, load_yaml

# Keys that may change between a run and its resumption: how long to run,
# how often to validate and save, where to log, how to validate, how the layers are split over the workers
# (torch.distributed.checkpoint reshards the saved shards to the new layout).
MAY_DIFFER = ("trainer.", "data.val_files", "data.val_dataset_name", "data.val_batch_size", "data.val_max_samples",
              "rollout.val_kwargs.", "reward.timeout_s", "profiler.",  # profiler.*: e.g. resume to profile a later step
              "actor.tensor_parallel_size", "actor.sequence_parallel",
              # asynchronous training's rollout workers: how many and where (their sampling streams then start anew)
              "async_training.rollout_", "async_training.max_rollout_failures")
MUST_MATCH = ("trainer.seed",)


def find_checkpoint(run_dir: Path, resume_mode: str, resume_from_path: str | None):
    """-> the checkpoint directory to resume from, or None to start afresh.

    auto: the newest valid checkpoint in the run directory (invalid newer
    ones are reported and skipped); disable: none; a path (or
    resume_mode=resume_path with trainer.resume_from_path): that one, which
    must be valid.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        found = latest_valid(run_dir)
        for info in list_checkpoints(run_dir, checksums=False):
            if found is None or info.step > found.step:
                print(f"posttrain: warning: skipping {info.path}: {info.problem or 'invalid'}", file=sys.stderr)
        return found.path if found else None
    path = Path(resume_from_path if resume_mode == "resume_path" else resume_mode)
    problem = verify(path) if path.is_dir() else "not a directory"
    if problem:
        raise CheckpointError(f"cannot resume from '{path}': {problem}; pass a valid global_step_N directory "
                              "(`posttrain checkpoints RUN_DIR` lists them) or trainer.resume_mode=auto")
    return path


def check_compatible(ckpt: Path, config: dict, model_dir: str) -> None:
    """Refuse a checkpoint made with another model or an incompatible config."""
    state = read_json(ckpt / "trainer_state.json")
    # a key an older posttrain saved that verl's dialect now reads before the merge (data.return_raw_chat, a
    # *_global size, async_training.staleness_threshold) is no difference: unused, or already made into posttrain's
    # keys (null) when that config.yaml was written
    saved = {k: v for k, v in flatten(read_yaml(ckpt / "config.yaml")).items() if not verl.reads(k)}
    now = flatten(config)
    shown = redact_mapping(now)  # the message names values, never a credential among them
    # the saved config was redacted (build.build_run): a `***` there matches whatever secret is given now,
    # and a saved `***` is never put back into the config
    # a key newer than the checkpoint (not in its config.yaml) left at its default is no difference: every
    # new key's default is what posttrain did before it existed
    diffs = [
        f"{k}: {saved.get(k)!r} -> {shown.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if not matches_redacted(saved.get(k), now.get(k)) and (k in MUST_MATCH or not k.startswith(MAY_DIFFER))
        and not (k not in saved and k in SCHEMA and now.get(k) == SCHEMA[k][1])
    ]
    if state.get("model_dir") != str(model_dir):
        diffs.insert(0, f"model: {state.get('model_dir')!r} -> {str(model_dir)!r}")
    if diffs:
        raise ConfigError(
            f"checkpoint {ckpt} was made with a different model or config ({'; '.join(diffs)}); "
            "use the same settings to resume, or start a new run (another trainer.run_dir / experiment_name, "
            "or trainer.resume_mode=disable in a fresh directory)"
        )


def is_sharded(ckpt: Path) -> bool:
    """Written by a worker group (actor_dcp/), not by one process (actor/model.safetensors)."""
    return (Path(ckpt) / "actor_dcp").is_dir()


def restore(run, ckpt: Path) -> None:
    """Optimizer, scheduler, data position, KL controller, step and every RNG.

    One-process checkpoint: the policy's (and critic's) weights were loaded
    from ckpt/actor (ckpt/critic) when they were built; optimizer.pt (and
    critic_optimizer.pt) hold the rest. Sharded checkpoint: each
    worker loads its shards of policy + optimizer and its own random state."""
    actor = run.actor
    if is_sharded(ckpt):
        try:
            matched = actor.load_checkpoint(str(ckpt))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot load the sharded state of {ckpt}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}") from e
        if not matched:
            print(f"posttrain: warning: {ckpt} was saved by another number of workers: weights and optimizer "
                  "are resumed exactly, the rollout sampling streams start afresh", file=sys.stderr)
    else:
        opt = load_pt(ckpt / "optimizer.pt")
        actor.optimizer.load_state_dict(opt["optimizer"])
        actor.scheduler.load_state_dict(opt["scheduler"])
        if actor.critic is not None:  # its weights were loaded from ckpt/critic when it was built
            opt = load_pt(ckpt / "critic_optimizer.pt")
            actor.critic_optimizer.load_state_dict(opt["optimizer"])
            actor.critic_scheduler.load_state_dict(opt["scheduler"])
    state = read_json(ckpt / "trainer_state.json")
    run.sampler.load_state_dict(state["sampler"])
    if getattr(run, "kl_ctrl", None) is not None and state.get("kl_ctrl"):  # RL's (a supervised run has none)
        run.kl_ctrl.load_state_dict(state["kl_ctrl"])
    if state.get("nonfinite"):
        run.guard.load_state_dict(state["nonfinite"])
    run.global_step = state["global_step"]
    restore_rng(load_pt(ckpt / "rng.pt"), actor.generators())
    if getattr(run, "ahead", None) is not None:  # asynchronous training: the batches sampled ahead, if saved
        saved = ckpt / ROLLOUTS_AHEAD
        dropped = run.ahead.restore(load_pt(saved) if saved.exists() else None, run.global_step)
        if dropped:
            print(f"posttrain: {dropped} batch(es) sampled ahead in {ckpt} are older than "
                  f"async_training.max_trajectory_age_steps={run.ahead.k} allows now: dropped, their prompts skipped",
                  file=sys.stderr)


# A checkpoint is data: its files are parsed (JSON, YAML's safe subset, torch.load's weights-only
# unpickler, safetensors), never executed. A file that does not parse is a CheckpointError.
_UNREADABLE = ("; it is not a file posttrain wrote, or it was changed since: resume from another checkpoint "
               "(`posttrain checkpoints RUN_DIR`) or start afresh with trainer.resume_mode=disable")




def load_pt(path: Path):
    """torch.load(weights_only=True): tensors and plain containers, never arbitrary objects."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001  UnpicklingError, RuntimeError, EOFError, ... all mean "not ours"
        raise CheckpointError(f"cannot read {path} ({one_line(e)}){_UNREADABLE}") from e


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({one_line(e)}){_UNREADABLE}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a mapping{_UNREADABLE}")
    return data


def read_yaml(path: Path) -> dict:
    try:
        data = load_yaml(path)  # a safe loader: a `!!python/...` tag is an error, not a call
    except UnreadableYaml as e:
        raise CheckpointError(f"cannot read {path} ({one_line(e.__cause__)}){_UNREADABLE}") from e.__cause__
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a mapping{_UNREADABLE}")
    return data
