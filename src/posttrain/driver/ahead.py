"""Asynchronous training's sampling side (async_training.enable): batches sampled and scored ahead of the trainer.

A thread of the driver draws the prompts of step j, has the rollout process (rollout/remote.py) sample them with
the weights of version v(j) = max(s0, j - 1 - k), scores them, and queues the batch, tagged with v(j). The trainer
takes step j's batch from the queue while the thread samples the next ones. v(j) is fixed: step j trains the
weights of j - 1 updates on a batch sampled k updates earlier (fewer in the first k steps after the start s0),
never older, whatever the two sides' speeds. So a run is deterministic given its seed, k = 0 is the synchronous
algorithm (the thread waits for each update), and k = 1 is one-step off-policy.

    ahead = RolloutsAhead(run.rollouts, run.draw, run.total_steps, k, start_step=run.global_step); ahead.start()
    batch = ahead.take(m)          # the trainer, for step run.global_step + 1 (waits if it is not sampled yet)
    ahead.updated(run.global_step) # after the step's update: versions up to it may be sampled with
    with ahead.settled(): ...      # validation, checkpoints: the thread has sampled all it may and waits

**Streamed** (async_training.stream_samples): the thread draws step j's prompts and hands them to a thread of
their own, which samples them (the rollout workers take them a piece at a time: rollout/pool.py) and scores them,
and goes on to step j + 1 as soon as its version exists: with k >= 1 the next batch's pieces start while this
one's last are sampled. Batches are queued in step order whatever order they finish in. Each batch's samples come
from its own seed (the run's and the step's, `Pinned`), and its weights' version travels with its prompts, so a
streamed run is determined by its seed too (not equal to the unstreamed one: other seeds). Everything but the
sampling itself (decoding, tools, scoring) runs one batch at a time.

At a checkpoint the queued batches (up to k of them, past the run's last step too) are saved with it
(`state`), and the data position and the rollout's random stream saved are the thread's, after them: a resumed
run takes the same batches and goes on as the uninterrupted one would (`restore`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.driver.rollouts import StepRollouts, rollout_and_score
from posttrain.rollout.base import SamplingParams, mixed_seed

LISTS = ("data_source", "ground_truth", "extra_info", "response_text")  # RolloutBatch's per-row Python lists


@dataclass
class Sampled:
    """A batch sampled ahead: for `step`, with the weights of `version` (updates since the start)."""

    step: int
    version: int
    epoch: int
    batch: RolloutBatch
    metrics: dict  # the sampling's and scoring's (gen time, reward counts, ...)


class RolloutsAhead:
    """The sampling thread and its queue (module docstring). `k`: async_training.max_trajectory_age_steps."""

    def __init__(self, rollouts: StepRollouts, draw: Callable[[], tuple[int, list]], total_steps: int, k: int,
                 in_flight: bool = False, start_step: int = 0, stream: bool = False, seed: int = 0):
        """rollouts: what sampling and scoring take (its actor's engine_weights verb picks the weights' version);
        draw(): the next prompts (epoch, items); total_steps: the run's last step; stream: streamed batches
        (module docstring), sampled from seeds made of `seed` and their step."""
        self.rollouts, self.draw, self.total_steps, self.k, self.in_flight = rollouts, draw, total_steps, k, in_flight
        self.stream, self.seed = stream, seed
        # dynamic sampling draws more prompts while it samples: its batches one at a time, to keep the data order
        self.overlap = stream and not getattr(rollouts.filter_groups, "enable", False)
        self.queue: list[Sampled] = []
        self.done: dict[int, Sampled] = {}  # streamed: batches sampled before an earlier one, by step
        self.reset(start_step)
        self.cond = threading.Condition()
        self.running = 0  # batches being sampled now (streamed: several)
        self.work_lock = threading.Lock()  # streamed: held by a batch's thread but while it samples
        self.paused = self.stopping = False
        self.past_end = False  # may sample for steps after the run's last (for a checkpoint: see settled)
        self.error: BaseException | None = None
        self.idle_s = 0.0  # the thread's time waiting for weights, since the last take
        self.thread = threading.Thread(target=self._run, name="posttrain-rollouts", daemon=True)

    def reset(self, start_step: int) -> None:
        """Start after `start_step` updates (a run's start or its resume) with nothing queued."""
        self.base = start_step  # the weights' version numbers count updates from here (engine_weights)
        self.trainer_step = start_step  # updates done: versions up to it exist
        self.next_step = start_step + 1  # the step the next batch sampled is for
        self.next_queued = start_step + 1  # the step the next batch queued is for
        self.queue.clear()
        self.done.clear()

    def version_for(self, step: int) -> int:
        return max(self.base, step - 1 - self.k)

    def start(self) -> None:
        self.thread.start()

    # ------------------------------------------------------------ the sampling thread

    def _may_sample(self) -> bool:
        return (not self.paused and self.version_for(self.next_step) <= self.trainer_step
                and (self.next_step <= self.total_steps or self.past_end))

    def _may_start(self) -> bool:
        return self._may_sample() and (self.running == 0 or self.overlap)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    waited = time.perf_counter()
                    while not (self.stopping or self._may_start()):
                        self.cond.wait()
                    if self.stopping:
                        return
                    self.idle_s += time.perf_counter() - waited
                    self.running += 1
                    step = self.next_step
                    if self.stream:
                        self.next_step += 1
                if self.stream:
                    self.start_one(step)
                else:
                    self.queue_one(step)
        except BaseException as e:  # noqa: BLE001  the trainer raises it at its next take
            self._failed(e)

    def _failed(self, e: BaseException) -> None:
        with self.cond:
            self.error, self.running = self.error or e, self.running - 1
            self.cond.notify_all()

    def queue_one(self, step: int) -> None:
        """Sample and score step `step`'s batch with its version of the weights, and queue it. In flight: with
        the newest weights, and any newer ones from the next token on (`version`: the oldest it may hold)."""
        if self.in_flight:
            with self.cond:
                version = self.trainer_step  # sent to the rollout process before it was announced here
        else:
            version = self.version_for(step)
        self.rollouts.actor.engine_weights(version - self.base)
        epoch, items = self.draw()
        m: dict = {}
        batch = rollout_and_score(self.rollouts, items, m)
        with self.cond:
            self.queue.append(Sampled(step, version, epoch, batch, m))
            self.next_step = self.next_queued = step + 1
            self.running -= 1
            self.cond.notify_all()

    def start_one(self, step: int) -> None:
        """Streamed: draw step `step`'s prompts here, in step order, and sample and score them in a thread of
        their own, with their version of the weights (in flight: the newest, or newer) and their own seed."""
        with self.cond:
            version = self.trainer_step if self.in_flight else self.version_for(step)
            m: dict = {"perf/batches_sampling": float(self.running)}  # with this one (timing-dependent)
        epoch, items = self.draw()
        pinned = Pinned(self.rollouts.actor, version - self.base, mixed_seed(self.seed, step), self.work_lock)
        threading.Thread(target=self._sample_one, args=(step, version, epoch, items, pinned, m), daemon=True,
                         name=f"posttrain-rollouts-{step}").start()

    def _sample_one(self, step: int, version: int, epoch: int, items, pinned: "Pinned", m: dict) -> None:
        try:
            with self.work_lock:
                pinned.owner = threading.get_ident()
                batch = rollout_and_score(dataclasses.replace(self.rollouts, actor=pinned), items, m)
        except BaseException as e:  # noqa: BLE001  the trainer raises it at its next take
            self._failed(e)
            return
        with self.cond:
            self.done[step] = Sampled(step, version, epoch, batch, m)
            while self.next_queued in self.done:
                self.queue.append(self.done.pop(self.next_queued))
                self.next_queued += 1
            self.running -= 1
            self.cond.notify_all()

    # ------------------------------------------------------------ the trainer's side

    def take(self, m: dict) -> RolloutBatch:
        """The next step's batch (waiting for it); adds its sampling metrics and async/* to `m`."""
        step = self.trainer_step + 1  # updates done so far, + 1
        start = time.perf_counter()
        with self.cond:
            while not self.queue and self.error is None:
                self.cond.wait()
            self.raise_error()
            item = self.queue.pop(0)
            idle, self.idle_s = self.idle_s, 0.0
        if item.step != step:
            raise RuntimeError(f"asynchronous training: step {step} was given the batch sampled for step {item.step}")
        m.update(item.metrics)
        m["training/epoch"] = float(item.epoch)
        m.update(self.ages(item, step))
        m["perf/rollouts_queued"] = float(len(self.queue))  # batches sampled ahead still waiting (timing-dependent)
        m["timing_s/wait_rollout"] = time.perf_counter() - start  # the trainer idle, waiting for samples
        m["timing_s/rollout_idle"] = idle  # the rollout process idle, waiting for weights
        return item.batch

    def ages(self, item: Sampled, step: int) -> dict[str, float]:
        """How many updates older than the trained weights (those of step - 1 updates) the sampling weights
        were: the batch's oldest token (async/trajectory_age), and per token and the share of sequences whose
        weights changed mid-flight, where the engine tagged its tokens. Older than k is a bug: raised."""
        versions = item.batch.weight_versions
        if versions is None:
            oldest, out = item.version, {}
        else:
            mask = item.batch.response_mask.bool()
            absolute = versions + self.base
            oldest = int(absolute[mask].min()) if bool(mask.any()) else item.version
            age = (step - 1 - absolute).float()
            lo = absolute.masked_fill(~mask, 10 ** 9).min(-1).values
            hi = absolute.masked_fill(~mask, -1).max(-1).values
            out = {"async/token_age_mean": float(age[mask].mean()) if bool(mask.any()) else 0.0,
                   "async/in_flight_updated_share": float((hi > lo).float().mean())}
        age = step - 1 - oldest
        if age > self.k:
            raise RuntimeError(f"asynchronous training: step {step}'s batch was sampled with weights {age} updates "
                               f"old, more than async_training.max_trajectory_age_steps={self.k}")
        return {"async/trajectory_age": float(age), **out}

    def updated(self, step: int) -> None:
        """The trainer finished step `step`'s update (and synced its weights): its version may sample."""
        with self.cond:
            self.trainer_step = step
            self.cond.notify_all()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    @contextlib.contextmanager
    def settled(self, checkpoint: bool = False):
        """The thread has sampled every batch the weights so far allow and waits, paused, until the block
        ends: validation and checkpoints happen at the same point of the sampling stream in every run. For a
        `checkpoint` that includes batches for steps past the run's end, so that a run resumed with more steps
        goes on as a longer one would have."""
        with self.cond:
            self.past_end = self.past_end or checkpoint
            self.cond.notify_all()
            while (self.running or self._may_sample()) and self.error is None:
                self.cond.wait()
            self.raise_error()
            self.paused = True
        try:
            yield
        finally:
            with self.cond:
                self.paused = False
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        # a thread inside a rollout call ends when the rollout process is closed (Worker.shutdown), after this
        self.thread.join(timeout=0.1)

    # ------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        """The queued batches, for a checkpoint (inside `settled`): tensors, and JSON for the rest."""
        return {"k": self.k, "base": self.base, "batches": [
            {"step": s.step, "version": s.version, "epoch": s.epoch, "metrics": json.dumps(s.metrics),
             "batch": batch_state(s.batch)} for s in self.queue]}

    def restore(self, state: dict | None, start_step: int) -> int:
        """After a resume to `start_step` updates (before `start`): queue a checkpoint's batches, unless one is
        older than k updates at its step (it was written with a larger k): then none, their prompts skipped.
        -> how many were dropped."""
        self.reset(start_step)
        if state is None:
            return 0
        saved = state["batches"]
        kept = saved if all(s["step"] - 1 - s["version"] <= self.k for s in saved) else []
        for s in kept:
            self.queue.append(Sampled(s["step"], s["version"], s["epoch"], batch_from_state(s["batch"]),
                                      json.loads(s["metrics"])))
        if self.queue:
            self.next_step = self.next_queued = self.queue[-1].step + 1
        return len(saved) - len(kept)


class Pinned:
    """A streamed batch's view of the actor: each generate samples with the batch's version of the weights and
    from a seed of its own (the batch's and the call's count: tools, greedy baselines and dynamic sampling call
    more than once), and lets go of `lock` (everything else of the batch, one at a time) while it waits."""

    def __init__(self, actor, version: int, seed: int, lock: threading.Lock):
        self.actor, self.version, self.seed, self.lock = actor, version, seed, lock
        self.calls = itertools.count()
        self.owner: int | None = None  # the batch's thread, which holds `lock`

    def generate(self, prompts, params: SamplingParams):
        params = dataclasses.replace(params, seed=mixed_seed(self.seed, next(self.calls)),
                                     weights_version=self.version)
        if threading.get_ident() != self.owner:  # an agent's server thread: the batch's thread keeps the lock
            return self.actor.generate(prompts, params)
        self.lock.release()
        try:
            return self.actor.generate(prompts, params)
        finally:
            self.lock.acquire()

    def __getattr__(self, name: str):
        return getattr(self.actor, name)


def batch_state(batch: RolloutBatch) -> dict:
    """A RolloutBatch as tensors and JSON text (what torch.load(weights_only=True) reads back)."""
    out = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value
        elif f.name in LISTS:
            out[f.name] = json.dumps(value, default=plain)
    return out


def batch_from_state(state: dict) -> RolloutBatch:
    return RolloutBatch(**{k: json.loads(v) if k in LISTS else v for k, v in state.items()})


def plain(value):
    """JSON for the numpy values a parquet row holds."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
