"""Checkpoints: complete or absent, resumable exactly, written in the background."""

from posttrain.checkpoint.manifest import CheckpointInfo, latest_valid, list_checkpoints, verify
from posttrain.checkpoint.remote import RemoteRunDir, is_url
from posttrain.checkpoint.resume import check_compatible, find_checkpoint, is_sharded, restore
from posttrain.checkpoint.state import Snapshot, shards_snapshot, take_snapshot
from posttrain.checkpoint.writer import CheckpointWriter, checkpoint_dir, static_model_files

__all__ = ["RemoteRunDir", "is_url", "CheckpointInfo", "latest_valid", "list_checkpoints", "verify",
           "check_compatible", "find_checkpoint", "is_sharded", "restore", "Snapshot", "shards_snapshot",
           "take_snapshot", "CheckpointWriter", "checkpoint_dir", "static_model_files"]
