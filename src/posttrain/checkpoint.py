"""Checkpoints under `<run dir>/checkpoints/global_step_N/`.

    actor/               the policy as a Hugging Face directory (safetensors)
    optimizer.pt         optimizer and LR-scheduler state
    trainer_state.json   global step, data sampler position, KL controller

A checkpoint is written under a temporary name and renamed into place
once complete, so a crash mid-save never leaves a half-written
`global_step_N`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"global_step_{step}"


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, scheduler, trainer_state: dict) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "actor", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "actor")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step, **trainer_state}, indent=2))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    (final.parent / "latest_checkpointed_iteration.txt").write_text(str(step))
    return final


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
