"""Checkpoints: complete or absent, resumable exactly, written in the background."""

from posttrain.checkpoint.manifest import CheckpointInfo, latest_valid, list_checkpoints, verify
from posttrain.checkpoint.remote import RemoteRunDir, is_url
from posttrain.checkpoint.resume import check_compatible, find_checkpoint, restore
from posttrain.checkpoint.state import Snapshot, take_snapshot
from posttrain.checkpoint.writer import CheckpointWriter, checkpoint_dir, static_model_files

__all__ = ["RemoteRunDir", "is_url", "CheckpointInfo", "latest_valid", "list_checkpoints", "verify", "check_compatible", "find_checkpoint",
           "restore", "Snapshot", "take_snapshot", "CheckpointWriter", "checkpoint_dir", "static_model_files"]
