"""Writing checkpoints: atomically, optionally in a background thread, and
pruning old ones by the retention rules."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from posttrain.checkpoint.manifest import fsync_path, list_checkpoints, write_manifest
from posttrain.checkpoint.state import ROLLOUTS_AHEAD, Snapshot
from posttrain.errors import CheckpointError
from posttrain.files.cache import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from posttrain.models.processor import PROCESSOR_FILES

# A pause between writing the files and the manifest, for tests that kill a
# process in the middle of a save. Not for production use.
_TEST_DELAY_ENV = "POSTTRAIN_TEST_CHECKPOINT_DELAY_S"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"global_step_{step}"


def static_model_files(model_dir: str | Path, tokenizer, apart: bool = False) -> dict[str, bytes]:
    """The model directory's files that do not change while training
    (config.json, generation_config.json, remote code, a vision-language model's processor files) and the run's
    tokenizer's files, as bytes. `apart`: the tokenizer was given apart (model.tokenizer_path), so the model
    directory's chat template files are not its."""
    src = Path(model_dir)
    own = ("config.json", "generation_config.json", *(f for f in PROCESSOR_FILES
                                                      if not (apart and f.startswith("chat_template"))))
    files = {p.name: p.read_bytes() for p in src.iterdir()
             if p.is_file() and (p.name in own or p.suffix == ".py")}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files.update({p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()})
    return files


class CheckpointWriter:
    """Writes `Snapshot`s under <run dir>/checkpoints.

    With `async_save`, each write runs in a background thread so training
    goes on; at most one is in flight (a new save first waits for the last),
    and a failed write is raised at the next `save()` or at `close()`.

    Retention after each save: the newest `max_to_keep` checkpoints, plus the
    first `keep_top_k` of every valid checkpoint ranked by `metric` (`mode`
    max or min; `ranked`: one without the metric ranks last, ties go to the
    newer step, so with fewer than keep_top_k scored checkpoints the newest
    unscored ones fill the rest); the newest valid one always stays. Neither
    set: keep everything.
    """

    def __init__(self, run_dir, static_files: dict[str, bytes], config_yaml: str, async_save: bool = True,
                 max_to_keep: int | None = None, keep_top_k: int | None = None, metric: str = "val/score/mean",
                 mode: str = "max", remote=None):
        self.run_dir = Path(run_dir)
        self.static_files, self.config_yaml = static_files, config_yaml
        self.async_save, self.max_to_keep, self.keep_top_k = async_save, max_to_keep, keep_top_k
        self.metric, self.mode = metric, mode
        self.remote = remote  # a RemoteRunDir that mirrors each finished checkpoint, or None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, snap: Snapshot) -> None:
        self.wait()
        if not self.async_save:
            self._write(snap)
            return
        self._thread = threading.Thread(target=self._run, args=(snap,), name="posttrain-checkpoint", daemon=True)
        self._thread.start()

    def staging_dir(self, step: int) -> Path:
        """An empty directory beside the checkpoints, for workers to write a
        step's shards into before `save` moves them into the checkpoint."""
        self.wait()
        path = self.run_dir / "checkpoints" / f".shards_global_step_{step}.tmp-{os.getpid()}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def wait(self) -> None:
        """Block until the save in flight is written; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint failed: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Wait for the save in flight, then mirror the run's files (metrics, config) remotely."""
        self.wait()
        if self.remote is not None:
            self.remote.push_files()

    def _run(self, snap: Snapshot) -> None:
        try:
            self._write(snap)
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def _write(self, snap: Snapshot) -> Path:
        final = checkpoint_dir(self.run_dir, snap.step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "actor").mkdir(parents=True)
        for name, data in self.static_files.items():
            (tmp / "actor" / name).write_bytes(data)
        if snap.shards is not None:  # written by the workers: actor_dcp/ (weights + optimizer), rng/
            for entry in Path(snap.shards).iterdir():
                os.replace(entry, tmp / entry.name)
            Path(snap.shards).rmdir()
        elif snap.adapter_config is not None:  # LoRA: the adapters alone, as peft saves them; the base is model.path
            save_file(snap.model, str(tmp / "actor" / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            (tmp / "actor" / ADAPTER_CONFIG).write_text(snap.adapter_config)
            torch.save({"optimizer": snap.optimizer, "scheduler": snap.scheduler}, tmp / "optimizer.pt")
        else:
            save_file(snap.model, str(tmp / "actor" / "model.safetensors"), metadata={"format": "pt"})
            torch.save({"optimizer": snap.optimizer, "scheduler": snap.scheduler}, tmp / "optimizer.pt")
        if snap.critic is not None:  # a Hugging Face directory too: the LM body with its value head
            (tmp / "critic").mkdir()
            for name, data in self.static_files.items():
                (tmp / "critic" / name).write_bytes(data)
            (tmp / "critic" / "config.json").write_text(snap.critic["config"])
            save_file(snap.critic["model"], str(tmp / "critic" / "model.safetensors"), metadata={"format": "pt"})
            torch.save({"optimizer": snap.critic["optimizer"], "scheduler": snap.critic["scheduler"]},
                       tmp / "critic_optimizer.pt")
        torch.save(snap.rng, tmp / "rng.pt")
        if snap.rollouts_ahead is not None:
            torch.save(snap.rollouts_ahead, tmp / ROLLOUTS_AHEAD)
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": snap.step, **snap.trainer_state}, indent=1))
        (tmp / "config.yaml").write_text(self.config_yaml)
        if os.environ.get(_TEST_DELAY_ENV):
            time.sleep(float(os.environ[_TEST_DELAY_ENV]))
        write_manifest(tmp, snap.step, snap.metrics)
        if final.exists():  # a same-step leftover (e.g. an invalid one): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(final.parent)
        latest = final.parent / "latest_checkpointed_iteration.txt"
        latest.with_suffix(".tmp").write_text(str(snap.step))
        os.replace(latest.with_suffix(".tmp"), latest)
        if self.remote is not None:
            self.remote.push_checkpoint(final)
        self._prune()
        return final

    def _prune(self) -> None:
        if self.max_to_keep is None and self.keep_top_k is None:
            return
        valid = [i for i in list_checkpoints(self.run_dir, checksums=False) if i.valid]
        keep = {valid[-1].step} if valid else set()
        if self.max_to_keep:
            keep |= {i.step for i in valid[-self.max_to_keep:]}
        if self.keep_top_k:
            keep |= {i.step for i in ranked(valid, self.metric, self.mode)[: self.keep_top_k]}
        for info in valid:
            if info.step not in keep:
                if self.remote is not None:
                    self.remote.delete_checkpoint(info.path)
                shutil.rmtree(info.path, ignore_errors=True)


def ranked(infos: list, metric: str, mode: str = "max") -> list:
    """Checkpoints best first for keep_top_k (NeMo-RL's order): by `metric`
    (mode max: highest first; min: lowest first), a checkpoint without it
    (or with a non-numeric or NaN value) ranked after every scored one, and
    equal values (missing ones too) newest step first.

    Example: metrics {2: 0.5, 4: 0.7, 6: none, 8: 0.7}, mode max -> steps
    [8, 4, 2, 6]; mode min -> [2, 8, 4, 6]."""
    def value(info) -> float | None:
        v = info.metrics.get(metric)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # v == v: not NaN
        return float(v) if ok else None

    worst = float("-inf") if mode == "max" else float("inf")

    def order(info) -> tuple[float, int]:  # ascending for min; for max sorted in reverse, so newer ties first
        v = value(info)
        return (worst if v is None else v, info.step if mode == "max" else -info.step)

    return sorted(infos, key=order, reverse=mode == "max")
