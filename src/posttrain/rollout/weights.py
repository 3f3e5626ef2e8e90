"""Moving the trainer's weights to a rollout engine: full tensors under the
names of the Hugging Face checkpoint.

A sharded (FSDP2) model holds DTensors, and wrappers add parts to the
parameter names (`_checkpoint_wrapped_module.` from activation
checkpointing, `_orig_mod.` from torch.compile, `_fsdp_wrapped_module.`
from FSDP1). Engines (the HF copy, vLLM's `load_weights`) expect the names
of the model directory and whole tensors.

`WeightHistory` keeps versions of those weights on the CPU, so an engine can
sample with the weights of k updates ago (rollout.stale_updates) or of the
version asynchronous training names.
"""

from __future__ import annotations

import threading
from typing import Iterable, Iterator

import torch

WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


def hf_name(name: str) -> str:
    """'model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight' ->
    'model.layers.0.mlp.up_proj.weight'."""
    for part in WRAPPER_PARTS:
        if name.startswith(part):
            name = name[len(part):]
        name = name.replace("." + part, ".")
    return name


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank must call it, in the
    same order); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def named_full_weights(model: torch.nn.Module, device: str | torch.device | None = None, lora_only: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every entry of the model's state dict (`lora_only`: its LoRA adapters'
    alone), one at a time, so at most one gathered tensor is alive beyond the engine's copy."""
    for name, t in model.state_dict().items():
        if lora_only and ".lora_" not in name:
            continue  # every rank skips the same names: the gathers stay in step
        full = full_tensor(t.detach())
        yield hf_name(name), (full.to(device) if device is not None else full)


class WeightHistory:
    """Versions of a model's full weights, each a CPU copy in `dtype` (None: as given), numbered 0, 1, ... from
    the first push (or the last restart). `push` one after every update.

    With `lag` k (rollout.stale_updates) the last k + 1 are kept and `oldest` is the weights of k updates ago, or
    the first version while fewer updates have happened. With `lag=None` (asynchronous training) every version
    stays until `drop_below`: the rollout asks for one by number (`get`) while the trainer pushes newer ones, from
    another thread.

        history = WeightHistory(lag=2, dtype=torch.bfloat16)
        history.push(named_full_weights(policy), restart=True)  # the starting weights (or a resume's)
        ...; history.push(named_full_weights(policy)); engine.load_weights(history.oldest())
    """

    def __init__(self, lag: int | None, dtype: torch.dtype | None = None):
        self.lag, self.dtype = lag, dtype
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.newest_version = -1
        self._lock = threading.Lock()

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], restart: bool = False) -> int:
        """Add a version (HF name, full tensor); `restart` forgets the others first and numbers it 0. -> its number."""
        # copy=True: a CPU tensor already in `dtype` would otherwise be the model's own storage
        copy = {name: t.detach().to("cpu", dtype=self.dtype if t.is_floating_point() else None, copy=True)
                for name, t in weights}
        with self._lock:
            if restart:
                self.versions.clear()
                self.newest_version = -1
            self.newest_version += 1
            self.versions[self.newest_version] = copy
            if self.lag is not None:
                self._drop_below(self.newest_version - self.lag)
            return self.newest_version

    def get(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        with self._lock:
            if version not in self.versions:
                raise KeyError(f"weights version {version} is not kept (kept: {sorted(self.versions)})")
            return iter(self.versions[version].items())

    def drop_below(self, version: int) -> None:
        """Let go of the versions older than `version` (no one will ask for them)."""
        with self._lock:
            self._drop_below(version)

    def _drop_below(self, version: int) -> None:
        for v in [v for v in self.versions if v < version]:
            del self.versions[v]

    def oldest(self) -> Iterator[tuple[str, torch.Tensor]]:
        with self._lock:
            return iter(self.versions[min(self.versions)].items())

    def newest(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The last version pushed: the policy's weights now (validation samples with them)."""
        return self.get(self.newest_version)
