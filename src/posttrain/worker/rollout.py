"""The rollout engine as the worker sees it: one interface, `Rollout`, and its two kinds.

`LocalRollout`: the engine in this process (the HF engine over the policy's module or a model of its own,
vLLM's engine). After each update the policy's weights are pushed into it as `weights.sending` says; with
rollout.stale_updates=k they go through a WeightHistory of the last k + 1 versions and the engine loads the
oldest, the weights of k updates ago. An engine that can sleep (vLLM) sleeps between generations.

`RemoteRollout`: the engine in a process of its own (rollout/remote.py: asynchronous training). Each push is a
new version in a WeightHistory; the rollout process samples with the version the driver names (`load_version`)
or, with in-flight updates, takes each new one as it comes, even mid-batch.

`make_rollout` picks one at setup; the worker then calls it without asking which:

    rollout = make_rollout(spec, policy, copy, eos, pad_token_id, rank, sharded)
    rollout.push_weights(policy, restart=True)        # the starting weights (or a resume's)
    out = rollout.generate(prompts, params)
    rollout.push_weights(policy)                      # after an update
    rollout.close()
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.weights import WeightHistory
from posttrain.worker.engines import autocast_of, build_rollout_engine, engine_dtype_of, make_engine, rollout_dtype_of
from posttrain.worker.spec import WorkerSpec
from posttrain.worker.weights import Sending, adapters, full_weights, merged_rollout, sending


class Rollout(Protocol):
    """What the worker asks of its rollout engine. `engine` is the engine itself (its model, llm, generator or
    pid are read through it); `history` the versions of the weights kept for it (None: none are)."""

    engine: object
    history: WeightHistory | None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample `params.n` responses per prompt (token ids, no padding)."""
        ...

    def push_weights(self, policy: torch.nn.Module, restart: bool = False) -> None:
        """The policy's weights after an update reach the engine (a collective when sharded); `restart`: they
        are the first of the history (at start, after a resume)."""
        ...

    def validation_weights(self, on: bool) -> None:
        """Validation samples with the policy's weights now (`on`), then the engine goes back to its own
        (not `on`)."""
        ...

    def load_version(self, version: int, keep_older: bool = False) -> None:
        """Sample with `version` of the weights (counted from the start or the resume) from the next batch on;
        older versions are let go unless `keep_older`."""
        ...

    def close(self) -> None:
        """Stop the engine's process, if it has one of its own."""
        ...


class LocalRollout:
    """The engine in this process (module docstring)."""

    def __init__(self, engine, spec: WorkerSpec, send: Sending, history: WeightHistory | None):
        self.engine, self.spec, self.send, self.history = engine, spec, send, history
        self.merged = merged_rollout(spec)
        self.own_dtype = rollout_dtype_of(spec) is not None  # it computes in it: autocast would recast its matmuls
        self.free_cache = spec.rollout.free_cache_engine  # rollout.free_cache_engine: it may sleep
        self.asleep = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """An engine that can sleep is woken for it and put back to sleep after: training has the device memory
        to itself."""
        self._wake()
        try:
            with autocast_of(self.spec) if not self.own_dtype else contextlib.nullcontext():
                return self.engine.generate(prompts, params)
        finally:
            if self.free_cache and getattr(self.engine, "can_sleep", False):
                self.engine.sleep()
                self.asleep = True

    def push_weights(self, policy: torch.nn.Module, restart: bool = False) -> None:
        if self.send is Sending.MODULE:
            self.engine.update_weights(policy)  # the same module: nothing to copy
            return
        self._wake()  # the weights go into a sleeping engine's device memory
        if self.send is Sending.ADAPTERS:
            self.engine.load_adapter(*adapters(policy))
            return
        weights = full_weights(policy, self.merged)
        if self.history is not None:  # rollout.stale_updates=k: the weights of k updates ago (the first ones before)
            self.history.push(weights, restart=restart)
            weights = self.history.oldest()
        self.engine.load_weights(weights)

    def validation_weights(self, on: bool) -> None:
        """With rollout.stale_updates the newest weights for validation, the k-updates-old ones back after; other
        engines already hold the policy's weights now."""
        if self.history is None:
            return
        self._wake()
        self.engine.load_weights(self.history.newest() if on else self.history.oldest())

    def load_version(self, version: int, keep_older: bool = False) -> None:
        raise RuntimeError("engine_weights names the weights' version of a rollout process of its own "
                           "(async_training.enable); this worker's engine runs in its process")

    def close(self) -> None:
        pass  # the engine ends with this process

    def _wake(self) -> None:
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False


class RemoteRollout:
    """The engine in a process of its own (module docstring). It never sleeps: it has its device to itself."""

    def __init__(self, engine, spec: WorkerSpec, history: WeightHistory):
        self.engine, self.history = engine, history
        self.merged, self.in_flight = merged_rollout(spec), spec.rollout.in_flight
        self.version: int | None = None  # the version load_version loaded into the rollout process
        self.streamed = spec.rollout.piece_size > 0 and not self.in_flight
        if self.streamed:  # a streamed piece names its version; the pool loads it from here into the worker
            engine.weights_of = history.get

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        out = self.engine.generate(prompts, params)  # under the policy's autocast there (engines.InAutocast)
        if self.streamed and params.weights_version is not None:  # versions no piece needs any more let go
            self.history.drop_below(self.engine.oldest_needed())
        return out

    def push_weights(self, policy: torch.nn.Module, restart: bool = False) -> None:
        """A new version; the rollout process takes the one the driver names (load_version) or, in flight, each
        new one at its next forward."""
        self.history.push(full_weights(policy, self.merged), restart=restart)
        if restart:
            self.version = None
            if self.streamed:
                self.engine.forget_versions()
        if self.in_flight:
            self.engine.send_weights(self.history.newest_version, self.history.newest())

    def validation_weights(self, on: bool) -> None:
        """The rollout process reloads its own version before its next batch: nothing to give back."""
        if on:
            self.load_version(self.history.newest_version, keep_older=True)

    def load_version(self, version: int, keep_older: bool = False) -> None:
        if self.in_flight:  # it has been sent each version: it waits for this one, or takes a newer
            self.engine.min_version = version
            return
        if self.version != version:
            self.engine.load_weights(self.history.get(version))
            self.version = version
        if not keep_older:
            self.history.drop_below(version)

    def close(self) -> None:
        self.engine.close()


class PeerRollout:
    """A trainer group's worker other than 0 with asynchronous training: worker 0 holds the rollout workers; this
    one takes part in gathering each update's weights from the shards (a collective) and keeps nothing."""

    engine, history = None, None

    def __init__(self, spec: WorkerSpec):
        self.merged = merged_rollout(spec)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        raise RuntimeError("asynchronous training samples on worker 0's rollout workers, not on this worker")

    def push_weights(self, policy: torch.nn.Module, restart: bool = False) -> None:
        for _ in full_weights(policy, self.merged):  # the gathers, in step with worker 0's
            pass

    def validation_weights(self, on: bool) -> None:
        pass

    def load_version(self, version: int, keep_older: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def rollout_pool(spec: WorkerSpec, eos: list[int], pad_token_id: int, sharded: bool):
    """Asynchronous training's rollout workers (rollout/pool.py): processes of this one beside one trainer
    process; Ray actors of their own beside a trainer group (worker 0 holds them)."""
    from functools import partial

    from posttrain.rollout.pool import RolloutPool
    from posttrain.rollout.remote import RemoteEngine

    r = spec.rollout
    if sharded:
        from posttrain.worker.rollout_actors import ray_spawner

        spawn = ray_spawner(spec, eos, pad_token_id, r.workers)
    else:
        threads = max(1, r.threads // r.workers) if r.threads else None  # the rollout's cores shared out

        def spawn(i: int, attempt: int) -> RemoteEngine:
            return RemoteEngine(partial(build_rollout_engine, spec, eos, pad_token_id, i + attempt * r.workers),
                                threads=threads, name="rollout" if r.workers == 1 else f"rollout worker {i}",
                                in_flight=r.in_flight)
    return RolloutPool(spawn, r.workers, pad_token_id, max_failures=r.max_failures, piece_size=r.piece_size)


def make_rollout(spec: WorkerSpec, policy: torch.nn.Module, copy: torch.nn.Module | None, eos: list[int],
                 pad_token_id: int, rank: int, sharded: bool) -> Rollout:
    """The worker's rollout: remote with asynchronous training (rollout workers of their own; worker 0 of a
    trainer group holds them, the others only help gather the weights), else local over `copy`
    (weights.make_rollout_copy) or the policy's module. The one place that asks which."""
    r = spec.rollout
    dtype = getattr(torch, engine_dtype_of(spec))
    if r.remote:
        if rank > 0:
            return PeerRollout(spec)
        engine = rollout_pool(spec, eos, pad_token_id, sharded)
        # the versions the rollout workers may still ask for (in flight: the newest, on its way to them)
        return RemoteRollout(engine, spec, WeightHistory(0 if r.in_flight else None, dtype))
    send = sending(spec, sharded)
    model = copy if copy is not None else None if sharded else policy  # vLLM's engine loads its own
    lora_rank = policy.peft_config["default"].r if send is Sending.ADAPTERS else 0
    engine = make_engine(spec, model, eos, pad_token_id, rank, progress=not sharded, lora_rank=lora_rank)
    return LocalRollout(engine, spec, send, WeightHistory(r.stale_updates, dtype) if r.stale_updates else None)
