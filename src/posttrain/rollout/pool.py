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

**Streamed** (`piece_size` > 0, async_training.stream_samples, for a call whose params name a seed): the prompts
are cut into pieces of `piece_size` prompts (each with its n samples) in one queue that every worker takes from
as it becomes free, so a fast worker takes more pieces and a second call's pieces start while the first's last
ones finish; each piece comes back as it is done and the call returns when all of its pieces have. Piece j is
sampled from its own seed (`mixed_seed(params.seed, j)`) with the weights of `params.weights_version` (loaded into
the worker that takes it, from `weights_of`): what it samples does not depend on which worker took it, or how
many there are. A dead worker's piece goes back to the front of the queue.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from posttrain.rollout.base import RolloutOutput, SamplingParams, concat_rollouts, even_chunks, mixed_seed
from posttrain.rollout.remote import RolloutProcessError, on_cpu


class RolloutPool:
    """`size` rollout workers answering as one engine (module docstring)."""

    def __init__(self, spawn: Callable[[int, int], object], size: int, pad_token_id: int, max_failures: int = 0,
                 piece_size: int = 0):
        """spawn(i, attempt): rollout worker i's engine (attempt 0 at start, then 1, 2, ... for its replacements);
        max_failures: how many replacements over the pool's life before a death stops the run; piece_size > 0:
        calls with a seed are streamed in pieces of that many prompts (module docstring)."""
        self.spawn, self.size, self.pad_token_id, self.max_failures = spawn, size, pad_token_id, max_failures
        self.piece_size = piece_size
        self.weights_of: Callable[[int], Iterable] | None = None  # streamed: version -> its weights (None: none loaded)
        self._pieces: deque[_Piece] = deque()  # streamed: the pieces no worker has taken yet
        self._cond = threading.Condition()
        self._feeders: list[threading.Thread] = []
        self._loaded: list[int | None] = [None] * size  # streamed: the version each worker holds (None: unknown)
        self._prepared: dict[int, object] = {}  # streamed: versions prepared for the workers (_prepare)
        self._versions_lock = threading.Lock()
        self._unfinished: Counter = Counter()  # streamed: pieces queued or sampling, by their weights' version
        self._newest_asked = -1
        self._broken: BaseException | None = None  # streamed: a death past max_failures: every call raises it
        self._closing = False
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
        if self._closing:
            raise RolloutProcessError("the rollout workers were closed")
        if self.piece_size > 0 and params.seed is not None:
            return self._generate_streamed(prompts, params)
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
        if self._closing:  # closed under a call still going (the sampling thread's, at the run's end): no one waits
            raise RolloutProcessError(f"{how}: the rollout workers were closed", how) from None
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
        self._loaded = [None] * self.size  # a streamed piece loads its own version again
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

    # ------------------------------------------------------------ streamed

    def _generate_streamed(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """The call's pieces queued behind any other call's; each worker takes the next one as it is free. Waits
        for all of them, then joins them in prompt order."""
        cuts = [range(s, min(s + self.piece_size, len(prompts))) for s in range(0, len(prompts), self.piece_size)]
        ticket = _Ticket(len(cuts))
        version = params.weights_version
        with self._cond:
            if self._broken is not None:
                raise self._broken
            if not self._feeders:
                self._feeders = [threading.Thread(target=self._feed, args=(i,), daemon=True,
                                                  name=f"posttrain-rollout-feeder-{i}") for i in range(self.size)]
                for t in self._feeders:
                    t.start()
            for j, cut in enumerate(cuts):
                self._pieces.append(_Piece(ticket, j, [prompts[i] for i in cut],
                                           dataclasses.replace(params, seed=mixed_seed(params.seed, j))))
            self._unfinished[version] += len(cuts)
            self._newest_asked = max(self._newest_asked, -1 if version is None else version)
            self._cond.notify_all()
        ticket.done.wait()
        if ticket.error is not None:
            raise ticket.error
        return concat_rollouts(ticket.outs, self.pad_token_id)

    def _feed(self, i: int) -> None:
        """Worker i's thread: take the next piece, load its weights' version if the worker holds another, sample
        it, hand it back; a death puts the piece back first in the queue and replaces the worker."""
        while True:
            with self._cond:
                while not self._pieces and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                piece = self._pieces.popleft()
            if piece.ticket.error is not None:  # its call failed already: nothing waits for this piece
                self._finish(piece, None)
                continue
            worker = self.workers[i]
            try:
                version = piece.params.weights_version
                if self.weights_of is not None and version is not None and self._loaded[i] != version:
                    worker.load_weights(self._version(version))
                    self._loaded[i] = version
                out = worker.generate(piece.prompts, piece.params)
            except RolloutProcessError as e:
                with self._cond:
                    self._pieces.appendleft(piece)
                try:
                    self._replace(i, worker, e)
                except RolloutProcessError as final:
                    self._fail_all(final)
                    return
                self._loaded[i] = None
                with self._cond:
                    self._cond.notify_all()
                continue
            except BaseException as e:  # noqa: BLE001  raised by the call that waits for it
                self._finish(piece, None, e)
                continue
            self._finish(piece, out)

    def _finish(self, piece: "_Piece", out: RolloutOutput | None, error: BaseException | None = None) -> None:
        t = piece.ticket
        with self._cond:
            t.outs[piece.index] = out
            t.error = t.error or error
            t.left -= 1
            if t.left == 0:
                t.done.set()
            version = piece.params.weights_version
            self._unfinished[version] -= 1
            if self._unfinished[version] == 0:
                del self._unfinished[version]
            oldest = self.oldest_needed()
        with self._versions_lock:
            for v in [v for v in self._prepared if v < oldest]:
                del self._prepared[v]

    def _fail_all(self, error: BaseException) -> None:
        """No more replacements: every call waiting on a piece raises `error`, and so does every later one."""
        with self._cond:
            self._broken = error
            waiting = list(self._pieces)
            self._pieces.clear()
        for piece in waiting:
            piece.ticket.error = piece.ticket.error or error
            self._finish(piece, None)

    def _version(self, version: int):
        """`version`'s weights as the workers take them, prepared once for all of them."""
        with self._versions_lock:
            if version not in self._prepared:
                self._prepared[version] = self._prepare(self.weights_of(version))
            return self._prepared[version]

    def oldest_needed(self) -> int:
        """Streamed: the oldest version of the weights a piece queued or sampling still needs (a later call asks
        for the newest asked so far, or a newer one)."""
        with self._cond:
            asked = [v for v in self._unfinished if v is not None]
            return min(asked) if asked else self._newest_asked

    def forget_versions(self) -> None:
        """The versions start again from 0 (a resume): nothing loaded or prepared is of them."""
        with self._cond:
            self._loaded, self._newest_asked = [None] * self.size, -1
        with self._versions_lock:
            self._prepared.clear()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._fail_all(RolloutProcessError("the rollout workers were closed"))  # nothing waits on a piece for ever
        for w in self.workers:
            w.close()
        self._ex.shutdown(wait=False)
        close = getattr(self.spawn, "close", None)  # what the workers were placed in (a Ray placement group)
        if close is not None:
            close()


class _Ticket:
    """A streamed call's pieces: their answers as they come, the first error, and `done` when none is left."""

    def __init__(self, count: int):
        self.outs: list[RolloutOutput | None] = [None] * count
        self.left, self.error, self.done = count, None, threading.Event()


@dataclasses.dataclass
class _Piece:
    ticket: _Ticket
    index: int  # its place in the call's answers
    prompts: list
    params: SamplingParams  # the call's, with the piece's own seed


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
