"""Reward functions in worker processes, each call with a hard time limit.

    with RewardPool(reward_loader("my_reward.py:score"), num_workers=2, timeout_s=10) as pool:
        result = pool.score_batch(["arith", "arith"], ["68", "67"], ["68", "68"], [{}, {}])
    result.scores, result.num_crashes        # [1.0, 0.0], 0

A worker loads the function itself (`loader`: picklable, no arguments; a
user's file is imported under a hashed module name, so its function cannot
be pickled by reference) and scores chunks of calls, each under the SIGALRM
limit of `scoring.score_one` (a Python-level hang costs no restart), sending
one result per call: so this process knows which call each worker is on and
since when. A call still running GRACE_S past timeout_s (C code, SIGALRM
blocked) has its worker killed; one whose worker dies (segfault, os._exit)
is a crash. Either costs that sample (0.0, counted); the rest of the chunk
goes to a fresh worker. `num_workers=0` scores in this process (`in_process`:
as a run being debugged does).
An empty response scores 0.0 without a call.

Workers (posttrain.runtime.processes) are spawned on first use and stay for the run;
they ignore SIGINT and SIGTERM (the trainer stops after its step, which
needs them) and end with this process, even stuck in C code (ps -o comm
shows them as reward-worker). A script that starts a run needs
`if __name__ == "__main__":` (workers import it).
"""

from __future__ import annotations

import functools
import multiprocessing.util
import time
from collections import deque
from multiprocessing.connection import wait

from posttrain.errors import RewardError
from posttrain.runtime.processes import LOAD_TIMEOUT_S, WorkerProcess, stop_all
from posttrain.rewards.scoring import (
    CRASH, TIMEOUT, UNSCORED, ScoreResult, failure, parallel_calls, score_one, tally,
)
from posttrain.text.lines import one_line

GRACE_S = 0.5  # past timeout_s, for the worker's own alarm to stop the call before it is killed
MAX_CHUNK = 32  # calls per message: fewer messages, but a killed worker's chunk is resent


def builtin_rewards():
    """Loader of the built-in rewards (`posttrain.rewards.compute_score`, by data_source)."""
    from posttrain.rewards import compute_score

    return compute_score


def reward_loader(custom_fn: str | None, sandbox=None, functions: dict | None = None):
    """The picklable loader of reward.custom_fn=FILE.py:FUNCTION (its path made
    absolute: a worker may start in another directory), of reward.functions'
    weighted sum (rewards.vlm.scorer), or of the built-ins.
    sandbox (rewards.sandbox.SandboxSettings): the process that loads them sends
    code sources there, also when a custom file calls the built-ins' dispatcher."""
    loader = builtin_rewards
    if functions:
        from posttrain.rewards.vlm import scorer

        loader = functools.partial(scorer, dict(functions))
    if custom_fn:
        from posttrain.rewards.custom import load_reward_fn, parse_spec

        path, name = parse_spec(custom_fn)
        loader = functools.partial(load_reward_fn, f"{path.resolve()}:{name}")
    return functools.partial(with_sandbox, sandbox, loader) if sandbox else loader


def with_sandbox(settings, loader):
    """Loader: configure this process's sandbox (rewards.sandbox), then loader()."""
    from posttrain.rewards import sandbox

    sandbox.configure(settings)
    return loader()


def in_process(fn, data_source: str | None = None) -> RewardPool:
    """The pool of a run being debugged (trainer.debug): `fn` called in this process (it need not be
    picklable), so a breakpoint() in it stops in this terminal; no time limit (the alarm would cut a
    debugging session short); a call that raises, or returns no number, raises (post-mortem at its frame)."""
    return RewardPool(lambda: fn, num_workers=0, timeout_s=None, raise_errors=True, data_source=data_source)


class RewardPool:
    """score_batch(...) -> ScoreResult, as `scoring.score_batch`, in num_workers processes."""

    def __init__(self, loader, num_workers: int, timeout_s: float | None, raise_errors: bool = False,
                 data_source: str | None = None):
        self.loader, self.num_workers, self.timeout_s = loader, num_workers, timeout_s
        self.raise_errors = raise_errors  # num_workers=0 only: see in_process
        self.data_source = data_source  # reward.data_source: every row scored as this source (None: its own)
        self._fn = None
        self._workers: list[_Worker] = []  # changed in place: the finalizer below holds this list
        # if close() is missed: stopped when collected, or at exit before multiprocessing joins (forever) its children
        multiprocessing.util.Finalize(self, stop_all, args=(self._workers,), exitpriority=10)

    def load(self):
        """The reward function loaded in this process: the one num_workers=0 calls,
        and build_run's early check that it loads (RewardError) before workers try."""
        if self._fn is None:
            self._fn = self.loader()
        return self._fn

    def score_batch(self, data_sources, solution_strs, ground_truths, extra_infos, prompts=None) -> ScoreResult:
        """prompts: each response's prompt, unused here (a reward model reads them: rewards.model)."""
        if self.data_source is not None:
            data_sources = [self.data_source] * len(data_sources)
        calls = parallel_calls(data_sources, solution_strs, ground_truths, extra_infos)
        outcomes = [UNSCORED] * len(calls)
        todo = [i for i, call in enumerate(calls) if call[1] != ""]  # only EOS/special tokens: nothing to score
        if self.num_workers == 0:
            for i in todo:
                outcomes[i] = score_one(self.load(), calls[i], self.timeout_s, self.raise_errors)
        elif todo:
            self._run(calls, todo, outcomes)
        return tally(data_sources, outcomes)

    def _run(self, calls, todo, outcomes) -> None:
        """Fill outcomes[i] for each i in todo, in worker processes."""
        try:
            self._dispatch(calls, deque(todo), outcomes)
        except BaseException:  # workers still on this batch would answer the next one: start afresh
            self.close()
            raise

    def _dispatch(self, calls, queue: deque, outcomes) -> None:
        chunk = max(1, min(MAX_CHUNK, len(queue) // (4 * self.num_workers)))  # ~4 chunks a worker: balance
        while True:
            self._hand_out(calls, queue, chunk, outcomes)
            busy = [w for w in self._workers if w.calls]
            if not busy:
                return
            deadline = min(w.deadline(self.timeout_s) for w in busy)
            for conn in wait([w.conn for w in busy], timeout=max(0.0, deadline - time.monotonic())):
                w = next(w for w in busy if w.conn is conn)
                try:
                    while w.calls and conn.poll():  # drain: results come one per call
                        self._receive(w, conn.recv(), outcomes)
                except (EOFError, OSError):
                    self._lost(w, queue, outcomes, calls, CRASH, f"crashed: worker process died ({w.exit_reason()})")
            now = time.monotonic()
            for w in busy:
                if w.calls and now >= w.deadline(self.timeout_s):
                    if not w.ready:
                        raise RewardError(f"reward worker did not load the reward function in {LOAD_TIMEOUT_S:.0f} "
                                          "s; make it import faster, or set reward.num_workers=0")
                    self._lost(w, queue, outcomes, calls, TIMEOUT,
                               f"ran past {self.timeout_s} s and its worker process was killed")

    def _hand_out(self, calls, queue: deque, chunk: int, outcomes) -> None:
        """A chunk of the queue to each idle worker, starting workers up to num_workers."""
        while queue:
            w = next((w for w in self._workers if not w.calls), None)
            if w is None:
                if len(self._workers) >= self.num_workers:
                    return
                w = _Worker(self.loader, self.timeout_s)
                self._workers.append(w)
            elif not w.proc.is_alive():  # died while idle (killed from outside): no call lost
                w.stop()
                self._workers.remove(w)
                continue
            w.calls = [queue.popleft() for _ in range(min(chunk, len(queue)))]
            w.since = time.monotonic()
            try:
                w.conn.send([calls[i] for i in w.calls])
            except OSError:  # it died just now: on its first call, as far as anyone can tell
                self._lost(w, queue, outcomes, calls, CRASH, f"crashed: worker process died ({w.exit_reason()})")

    def _receive(self, w: _Worker, message, outcomes) -> None:
        if not w.ready:  # its first message: None once loaded, else why not
            if message is not None:
                raise RewardError(f"reward worker could not load the reward function ({message}); "
                                  "check that it imports in a fresh process, or set reward.num_workers=0")
            w.ready = True
        else:
            outcomes[w.calls.pop(0)] = message
        w.since = time.monotonic()  # its next call starts now

    def _lost(self, w: _Worker, queue, outcomes, calls, kind: str, why: str) -> None:
        """w's current call fails (kind); the rest of its chunk goes back to the front of the queue."""
        if kind == CRASH and not w.ready:
            raise RewardError(f"reward worker died while loading the reward function ({w.exit_reason()}); check that "
                              "it imports in a fresh process and that the main script guards its run with `if "
                              "__name__ == '__main__':` (workers import it), or set reward.num_workers=0")
        w.stop()
        current, *rest = w.calls
        outcomes[current] = failure(kind, calls[current][0], why)
        queue.extendleft(reversed(rest))
        self._workers.remove(w)

    def close(self) -> None:
        """Stop the workers; the next score_batch starts new ones."""
        stop_all(self._workers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Worker(WorkerProcess):
    """A reward worker process, its chunk's calls not answered yet, and since when calls[0] runs."""

    def __init__(self, loader, timeout_s: float):
        super().__init__("reward", _serve, loader, timeout_s)
        self.calls: list[int] = []
        self.since = time.monotonic()
        self.ready = False

    def deadline(self, timeout_s: float) -> float:
        return self.since + (timeout_s + GRACE_S if self.ready else LOAD_TIMEOUT_S)


def _serve(conn, loader, timeout_s: float) -> None:
    """A worker's life: load the function, then score chunks until EOF."""
    try:
        fn = loader()
    except BaseException as e:  # noqa: BLE001  reported to the parent, which stops the run
        conn.send(one_line(e))
        return
    conn.send(None)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # the pool closed, or the trainer died
            return
        for call in chunk:
            conn.send(score_one(fn, call, timeout_s))

