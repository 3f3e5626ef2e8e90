"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Every worker writes its own shards of the policy and of the optimizer
state into one directory (`actor_dcp/`; the critic's into `critic_dcp/`); a later run with any number of
workers (one process included) reads them back resharded. Names are the
Hugging Face ones: DCP's state-dict helpers drop wrapper parts such as
`_checkpoint_wrapped_module.`.

DCP reads its shards with torch.load(weights_only=True), but its index
(`.metadata`) with plain pickle, which runs whatever a crafted file asks
for. `SafeReader` reads the index with an unpickler that builds only DCP's
own metadata types (and the few torch and pathlib values they hold).
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from posttrain.errors import CheckpointError

# the modules an index may name, and the names it may use beyond DCP's metadata types and torch dtypes
_MODULES = ("torch", "torch.serialization", "torch.distributed.checkpoint.filesystem", dcp_metadata.__name__,
            "pathlib", "collections")
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if ((module == dcp_metadata.__name__ and isinstance(obj, type)) or (module, name) in _ALLOWED
                    or (module == "torch" and isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)))):
                return obj
        raise CheckpointError(f"the sharded checkpoint index names {module}.{name}, which is not checkpoint "
                              "metadata; the file was not written by posttrain (or was tampered with): do not load it")


class SafeReader(FileSystemReader):
    """DCP's file-system reader, its index read without arbitrary pickle."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _IndexUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
                raise CheckpointError(f"the sharded checkpoint index {path} is unreadable ({type(e).__name__}: "
                                      f"{e}); resume from another checkpoint") from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

DCP_DIR = "actor_dcp"
CRITIC_DCP_DIR = "critic_dcp"


def save_sharded(path: str | Path, model, optimizer, scheduler) -> None:
    """Collective: every rank calls it with the same path (a shared file
    system when workers are on several nodes)."""
    import warnings

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # a group of one worker has no process group: "single process" is right
        warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()},
                 checkpoint_id=str(path))


def load_sharded(path: str | Path, model, optimizer, scheduler) -> None:
    """Collective: load model, optimizer and scheduler state in place."""
    import warnings

    SafeReader(str(path)).read_metadata()  # a refused index is our CheckpointError, not DCP's wrapped one
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        dcp.load(state, storage_reader=SafeReader(str(path)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])


def load_full_model(path: str | Path, model: torch.nn.Module) -> None:
    """Fill an unsharded model (one process, no process group) with the
    policy weights of a sharded checkpoint."""
    import warnings

    SafeReader(str(path)).read_metadata()
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=True)
    model.load_state_dict(state["model"])
