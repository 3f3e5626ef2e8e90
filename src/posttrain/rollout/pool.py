"""Several rollout workers as one engine: asynchronous training's rollout side at cluster shape.

`RolloutPool(spawn, size)` holds `size` rollout workers, each an engine of its own process (rollout/remote.py's
`RemoteEngine` beside one trainer process, or a Ray actor beside a trainer group: worker/rollout_actors.py), made by
`spawn(i, attempt)`. It answers the verbs a `RemoteEngine` answers, so the trainer's side (worker/rollout.py's
`RemoteRollout`) does not know how many there are:

    pool = RolloutPool(spawn, size=2, max_failures=3)
    pool.load_weights(weights)           # every worker loads the same version (sent once; kept for a replacement)
    out = pool.generate(prompts, params) # consecutive chunks of prompts, one per worker, sampled at once, in order
    pool.close()

**Order.** Worker i samples chunk i of `even_chunks(len(prompts), size)` with its own sampling stream (seeded
seed + i), and the answers are joined in prompt order: a run is determined by its seed, as a trainer group's
colocated engines are (worker i of a synchronous group samples the same chunk with the same seed).

**A worker that dies** (killed, out of memory, its node lost) is replaced by a new one (`spawn(i, attempt)`,
seeded apart from the first) that loads the weights the pool last loaded, and its chunk is sampled again; the
other workers' answers are kept. After `max_failures` replacements over the pool's life the next death stops the
run with a one-line error naming the worker and how it ended. A replacement's sampling stream is not the dead
one's: the run goes on, but no longer as the uninterrupted run would have.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from posttrain.rollout.base import RolloutOutput, SamplingParams, concat_rollouts, even_chunks
from posttrain.rollout.remote import RolloutProcessError, on_cpu


class RolloutPool:
    """`size` rollout workers answering as one engine (module docstring)."""

    def __init__(self, spawn: Callable[[int, int], object], size: int, pad_token_id: int, max_failures: int = 0):
        """spawn(i, attempt): rollout worker i's engine (attempt 0 at start, then 1, 2, ... for its replacements);
        max_failures: how many replacements over the pool's life before a death stops the run."""
        self.spawn, self.size, self.pad_token_id, self.max_failures = spawn, size, pad_token_id, max_failures
        self.failures, self.attempts = 0, [0] * size
        self._lock = threading.Lock()
        self._weights: list | None = None  # the last full weights loaded: a replacement loads them
        self._in_flight: tuple[int, list] | None = None  # in flight: the last (version, weights) sent
        self._min_version: int | None = None
        with ThreadPoolExecutor(size) as ex:  # the workers build their engines at once
            self.workers = list(ex.map(lambda i: spawn(i, 0), range(size)))
        self._ex = ThreadPoolExecutor(size, thread_name_prefix="posttrain-rollout-pool")
        gens = [getattr(w, "generator", None) for w in self.workers]
        self.generator = PoolGenerator(self) if all(g is not None for g in gens) else None

    @property
    def pid(self) -> list:
        return [getattr(w, "pid", None) for w in self.workers]

    # ------------------------------------------------------------ the RolloutEngine verbs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        chunks = even_chunks(len(prompts), self.size)
        busy = [i for i, c in enumerate(chunks) if len(c) > 0]
        futures = {i: self._ex.submit(self._generate_one, i, [prompts[j] for j in chunks[i]], params) for i in busy}
        outs, first_error = {}, None
        for i in busy:
            try:
                outs[i] = futures[i].result()
            except BaseException as e:  # noqa: BLE001  wait for every chunk, then raise the first failure
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return concat_rollouts([outs[i] for i in busy], self.pad_token_id)

    def _generate_one(self, i: int, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Worker i samples its chunk; a death replaces it (up to max_failures over the pool's life) and the
        chunk is sampled again by the new one."""
        while True:
            worker = self.workers[i]
            try:
                return worker.generate(prompts, params)
            except RolloutProcessError as e:
                self._replace(i, worker, e)

    def _replace(self, i: int, dead, error: RolloutProcessError) -> None:
        how = error.how  # "the rollout worker 1 process (pid N) was killed by signal 9 during generate"
        with self._lock:
            if self.failures >= self.max_failures:
                raise RolloutProcessError(
                    f"{how} (rollout worker {i} of {self.size}; {self.failures} replacement"
                    f"{'' if self.failures == 1 else 's'} of async_training.max_rollout_failures={self.max_failures} "
                    "already made): the run stops here; its last checkpoint holds every update up to it: run the "
                    "same command again to resume") from None
            self.failures += 1
            self.attempts[i] += 1
            attempt = self.attempts[i]
        print(f"posttrain: warning: {how}; replacing it ({self.failures} of async_training.max_rollout_failures="
              f"{self.max_failures}) and sampling its prompts again", file=sys.stderr)
        try:
            dead.close()
        except Exception:  # noqa: BLE001  it is dead: nothing of it is needed
            pass
        worker = self.spawn(i, attempt)
        if self._weights is not None:
            worker.load_weights(self._weights)
        if self._in_flight is not None:
            worker.send_weights(*self._in_flight)
        if self._min_version is not None:
            worker.min_version = self._min_version
        self.workers[i] = worker

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every worker loads the same weights (CPU tensors: shared memory to child processes, one object to
        Ray actors), at once."""
        self._weights = self._prepare(weights)
        self._each(lambda w: w.load_weights(self._weights))

    def send_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In flight: every worker is handed `version` now, even mid-batch."""
        self._in_flight = (version, self._prepare(weights))
        self._weights = None  # a replacement takes the in-flight version instead
        self._each(lambda w: w.send_weights(*self._in_flight))

    def _prepare(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The weights as every worker takes them: CPU tensors (shared memory to a child process), or one
        object of Ray's store for Ray actors (their `prepare_weights`)."""
        prepare = getattr(self.workers[0], "prepare_weights", None)
        return prepare(weights) if prepare is not None else on_cpu(weights)

    @property
    def min_version(self) -> int | None:
        return self._min_version

    @min_version.setter
    def min_version(self, version: int | None) -> None:
        self._min_version = version
        for w in self.workers:
            w.min_version = version

    def _each(self, verb: Callable) -> None:
        """`verb(worker)` on every worker at once; a dead worker is replaced (it loads the weights kept)."""
        futures = [self._ex.submit(verb, w) for w in self.workers]
        for i, f in enumerate(futures):
            try:
                f.result()
            except RolloutProcessError as e:
                self._replace(i, self.workers[i], e)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self._ex.shutdown(wait=False)
        close = getattr(self.spawn, "close", None)  # what the workers were placed in (a Ray placement group)
        if close is not None:
            close()


class PoolGenerator:
    """The workers' sampling streams as one, for checkpoints: one worker's state as it is, several stacked
    [size, ...]. A checkpoint of a pool of another size does not fit: the streams go on from their seeds, and a
    warning says so."""

    def __init__(self, pool: RolloutPool):
        self.pool = pool

    def get_state(self) -> torch.Tensor:
        states = [w.generator.get_state() for w in self.pool.workers]
        return states[0] if self.pool.size == 1 else torch.stack(states)

    def set_state(self, state: torch.Tensor) -> None:
        size = self.pool.size
        states = [state] if size == 1 and state.dim() == 1 else list(state) if state.dim() == 2 else []
        if len(states) != size:
            print(f"posttrain: warning: the checkpoint holds the sampling streams of {len(states) or 1} rollout "
                  f"worker(s), this run has {size}: theirs start from their seeds", file=sys.stderr)
            return
        for w, s in zip(self.pool.workers, states):
            w.generator.set_state(s.clone())
