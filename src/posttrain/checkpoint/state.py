"""Capture a run's state as plain CPU copies (so it can be written while
training goes on), and put it back."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


def capture_rng(generators: dict[str, torch.Generator]) -> dict:
    """Every RNG the run draws from: python, numpy, torch (CPU, CUDA) and
    named generators (the rollout sampler's). Stored as tensors and plain
    types so it loads with torch.load(weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "generators": {name: g.get_state() for name, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    random.setstate(_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for key, g in generators.items():
        g.set_state(state["generators"][key])


def _tuples(x):
    """random.setstate needs tuples where a round trip may give lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the model's tensors, each shared (tied) tensor once,
    under the first name it has (the embedding, for tied LM heads)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


ROLLOUTS_AHEAD = "rollouts_ahead.pt"  # asynchronous training's batches sampled ahead, in a checkpoint


@dataclass
class Snapshot:
    """Everything a checkpoint holds, detached from the live run."""

    step: int
    model: dict[str, torch.Tensor] | None
    optimizer: dict | None
    scheduler: dict | None
    rng: dict
    trainer_state: dict
    metrics: dict = field(default_factory=dict)
    shards: Path | None = None  # instead of model/optimizer/scheduler: a directory of worker shards
    critic: dict | None = None  # one process with a critic: see critic_snapshot
    adapter_config: str | None = None  # LoRA: `model` holds the adapters only (peft's names), this their config
    rollouts_ahead: dict | None = None  # asynchronous training: the batches sampled ahead (async_rollout.state)


def take_snapshot(step, model, optimizer, scheduler, generators, trainer_state, metrics) -> Snapshot:
    """A one-process run's state, copied to CPU (a LoRA model's: its adapters)."""
    from posttrain.models.lora import adapter_config_json, adapter_tensors, is_lora

    lora = is_lora(model)
    return Snapshot(
        step=step,
        model=adapter_tensors(model) if lora else model_tensors(model),
        adapter_config=adapter_config_json(model) if lora else None,
        optimizer=copy.deepcopy(optimizer.state_dict()),
        scheduler=copy.deepcopy(scheduler.state_dict()),
        rng=capture_rng(generators),
        trainer_state=copy.deepcopy(trainer_state),
        metrics=numbers(metrics),
    )


def critic_snapshot(model, optimizer, scheduler) -> dict:
    """A one-process critic's state, copied to CPU: its weights, its config
    (config.json of a token-classification model with one label), optimizer
    and scheduler."""
    return {"model": model_tensors(model), "config": model.config.to_json_string(),
            "optimizer": copy.deepcopy(optimizer.state_dict()), "scheduler": copy.deepcopy(scheduler.state_dict())}


def shards_snapshot(step, shards: Path, generators, trainer_state, metrics) -> Snapshot:
    """A sharded run's state: the workers already wrote theirs into `shards`."""
    return Snapshot(step=step, model=None, optimizer=None, scheduler=None, rng=capture_rng(generators),
                    trainer_state=copy.deepcopy(trainer_state), metrics=numbers(metrics), shards=Path(shards))


def numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
