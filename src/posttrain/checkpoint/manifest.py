"""What makes a checkpoint directory valid: a manifest, written last, that
lists every file with its size and SHA-256. A directory without a manifest
that matches its files is never loaded.

    <run dir>/checkpoints/global_step_N/
      actor/               the policy as a Hugging Face directory (safetensors)
      optimizer.pt         optimizer and LR-scheduler state
      critic/, critic_optimizer.pt   the same for the value model (PPO with GAE)
      (actor_dcp/, critic_dcp/, rng/   instead, from a run on several workers: sharded state)
      rng.pt               python, numpy, torch and rollout-sampler RNG states
      trainer_state.json   global step, data position, KL controller, metrics
      config.yaml          the resolved config of the run that wrote it
      manifest.json        written last: files, sizes, checksums
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.files.cache import sha256

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt_dir: Path, step: int, metrics: dict) -> None:
    """Checksum every file, fsync them, then write and fsync the manifest."""
    files = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        fsync_path(path)
        files[str(path.relative_to(ckpt_dir))] = {"size": path.stat().st_size, "sha256": sha256(path)}
    manifest = {"format": 1, "global_step": step, "files": files, "metrics": metrics}
    target = ckpt_dir / MANIFEST
    with open(target, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    for d in {ckpt_dir} | {(ckpt_dir / f).parent for f in files}:
        fsync_path(d)


def verify(ckpt_dir: Path, checksums: bool = True) -> str | None:
    """None when the checkpoint is complete and intact, else the reason it is not."""
    manifest_path = Path(ckpt_dir) / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {str(rel): (int(meta["size"]), str(meta["sha256"])) for rel, meta in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unreadable manifest"
    for rel, (size, digest) in files.items():
        path = Path(ckpt_dir) / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {size} (truncated?)"
        if checksums and sha256(path) != digest:
            return f"{rel} does not match its checksum"
    return None


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    problem: str | None  # None: valid
    size: int = 0
    metrics: dict = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.problem is None


def list_checkpoints(run_dir: str | Path, checksums: bool = True) -> list[CheckpointInfo]:
    """Every global_step_N under <run dir>/checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    infos = []
    for d in root.iterdir() if root.is_dir() else []:
        m = STEP_DIR.match(d.name)
        if not (m and d.is_dir()):
            continue
        problem = verify(d, checksums)
        metrics = {}
        if problem is None:
            metrics = json.loads((d / MANIFEST).read_text()).get("metrics", {})
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        infos.append(CheckpointInfo(int(m.group(1)), d, problem, size, metrics))
    return sorted(infos, key=lambda i: i.step)


def latest_valid(run_dir: str | Path) -> CheckpointInfo | None:
    valid = [i for i in list_checkpoints(run_dir) if i.valid]
    return valid[-1] if valid else None
