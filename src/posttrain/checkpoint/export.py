"""A checkpoint's policy as a stand-alone Hugging Face model directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from posttrain.checkpoint.manifest import STEP_DIR, latest_valid, verify
from posttrain.errors import CheckpointError


def resolve(path: str | Path) -> Path:
    """A global_step_N directory, or a run directory (its newest valid checkpoint)."""
    p = Path(path)
    if STEP_DIR.match(p.name):
        return p
    found = latest_valid(p)
    if found is None:
        raise CheckpointError(f"'{p}' is neither a global_step_N checkpoint nor a run directory with a valid one")
    return found.path


def export_checkpoint(checkpoint: str | Path, output: str | Path) -> Path:
    """Verify the checkpoint, then write its actor/ (config, safetensors,
    tokenizer with its chat template, generation config) to `output`."""
    ckpt = resolve(checkpoint)
    problem = verify(ckpt) if ckpt.is_dir() else "not a directory"
    if problem:
        raise CheckpointError(f"cannot export '{ckpt}': {problem}; pick a valid one (`posttrain checkpoints RUN_DIR`)")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"output directory '{out}' is not empty; choose a new --output")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt / "actor", tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out
