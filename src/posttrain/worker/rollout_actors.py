"""Rollout workers as Ray actors: the rollout side of asynchronous training beside a trainer group.

With async_training.enable and a trainer group on Ray, worker 0 of the group makes a rollout/pool.py
`RolloutPool` of `RayEngine`s: each a `RolloutActor` in a bundle of a placement group of its own (the rollout's
devices: async_training.rollout_nnodes x rollout_n_gpus_per_node, rollout.tensor_parallel_size of them per
worker), which builds its engine there (engines.build_rollout_engine: the HF engine over a model of its own, or
vLLM's) and answers the verbs a rollout/remote.py `RemoteEngine` answers:

    spawn = ray_spawner(spec, eos, pad_token_id, size=2)   # places the bundles
    pool = RolloutPool(spawn, 2, pad_token_id, max_failures=3)

Weights travel through Ray's object store: one `ray.put` per version (shared memory on the node, Ray's transfer to
other nodes), which every actor reads. An actor that dies raises `RolloutProcessError` with how it ended (the pool
replaces it); an error inside one comes back with its traceback.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Callable

from posttrain.rollout.remote import (EngineServer, InFlight, RemoteGenerator, RolloutProcessError, min_version_of,
                                     on_cpu)
from posttrain.worker.engines import build_rollout_engine
from posttrain.worker.spec import WorkerSpec

PLACEMENT_TIMEOUT_S = 120.0


class RolloutActor(EngineServer):
    """One rollout worker, in a Ray actor of its own (threaded: an in-flight update comes while it generates):
    `build()` makes its engine there, and it answers the verbs a rollout/remote.py child process answers."""

    def __init__(self, build: Callable, threads: int | None = None, in_flight: bool = False):
        import torch

        if threads:
            torch.set_num_threads(threads)
        engine = build()
        super().__init__(engine, InFlight(engine) if in_flight else None)

    def ready(self) -> dict:
        from posttrain.worker.process import host

        return {"pid": os.getpid(), "host": host(), "generator": getattr(self.engine, "generator", None) is not None}

    def send_weights(self, version: int, weights) -> None:
        self.in_flight.offer((version, weights))


class RayEngine:
    """A `RolloutActor` answering as a rollout/remote.py `RemoteEngine` does (module docstring)."""

    def __init__(self, actor, name: str):
        self.actor, self.name, self.min_version = actor, name, None
        self.where = {}
        self.where = self.call("ready")
        self.generator = RemoteGenerator(self) if self.where["generator"] else None

    @property
    def pid(self) -> int | None:
        return self.where.get("pid")

    def call(self, verb: str, *args):
        import ray

        try:
            return ray.get(getattr(self.actor, verb).remote(*args))
        except ray.exceptions.RayActorError as e:
            where = f"pid {self.pid} on {self.where['host']}" if self.where else "not started"
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RolloutProcessError(f"the {self.name} ({where}) died during {verb}: {cause}") from None
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"the {self.name} (pid {self.pid}) failed in {verb}:\n{e}") from None

    def generate(self, prompts, params):
        return self.call("generate", prompts, params, min_version_of(self, params))

    @staticmethod
    def prepare_weights(weights):
        """One object in Ray's store for every actor of a pool: CPU tensors put once."""
        import ray

        return ray.put(on_cpu(weights))

    def load_weights(self, weights) -> None:
        self.call("load_weights", weights)

    def send_weights(self, version: int, weights) -> None:
        self.call("send_weights", version, weights)

    def close(self) -> None:
        import ray

        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001  dead or stuck: killed below either way
            pass
        ray.kill(self.actor)


def ray_spawner(spec: WorkerSpec, eos: list[int], pad_token_id: int, size: int):
    """Place `size` rollout workers' bundles (one device each, rollout.tensor_parallel_size on a GPU) and return
    spawn(i, attempt) -> a `RayEngine` in bundle i (a replacement in the dead one's bundle); `spawn.close()`
    removes the placement group. It is named (spec.rollout.placement_group) so that the trainer group removes
    it at its end even when its worker 0 is gone: a placement group outlives the actor that made it."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = spec.device == "cuda"
    bundle = {"CPU": 1, **({"GPU": spec.rollout.tensor_parallel_size} if gpu else {})}
    pg = placement_group([bundle] * size, strategy="PACK", name=spec.rollout.placement_group or "")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RolloutProcessError(
            f"the Ray cluster cannot place {size} rollout workers with {bundle} each beside the trainer group "
            f"(available: {ray.available_resources()}); lower async_training.rollout_n_gpus_per_node / "
            "rollout_nnodes or add nodes")
    actor = ray.remote(RolloutActor)

    def spawn(i: int, attempt: int) -> RayEngine:
        handle = actor.options(
            num_cpus=1, num_gpus=spec.rollout.tensor_parallel_size if gpu else 0, max_restarts=0,
            max_concurrency=2, runtime_env={"env_vars": spec.env} if spec.env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(partial(build_rollout_engine, spec, eos, pad_token_id, i + attempt * size), spec.rollout.threads,
                 spec.rollout.in_flight)
        engine = RayEngine(handle, f"rollout worker {i}")
        if attempt:
            print(f"posttrain: rollout worker {i} replaced: pid {engine.pid} on {engine.where['host']}",
                  file=sys.stderr)
        return engine

    spawn.close = lambda: ray.util.remove_placement_group(pg)  # the pool's end frees the bundles
    return spawn
