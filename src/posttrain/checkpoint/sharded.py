"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Every worker writes its own shards of the policy and of the optimizer
state into one directory (`actor_dcp/`; the critic's into `critic_dcp/`); a later run with any number of
workers (one process included) reads them back resharded. Names are the
Hugging Face ones: DCP's state-dict helpers drop wrapper parts such as
`_checkpoint_wrapped_module.`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])


def load_full_model(path: str | Path, model: torch.nn.Module) -> None:
    """Fill an unsharded model (one process, no process group) with the
    policy weights of a sharded checkpoint."""
    import warnings

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
