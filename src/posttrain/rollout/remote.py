"""A rollout engine in a process of its own: the sampling side of asynchronous training.

`RemoteEngine(build, threads)` starts a child process (spawned: nothing of the trainer's state is
inherited), calls `build()` there to make the engine (the HF engine over a model of its own, or vLLM's),
and then serves the `RolloutEngine` verbs over a pipe, one at a time, in the order they come:

    engine = RemoteEngine(functools.partial(make_engine, ...), threads=1)
    engine.load_weights(named_full_weights(policy))       # the weights travel as shared-memory tensors
    out = engine.generate(prompts, params)                 # runs in the child; the caller waits
    state = engine.generator.get_state()                   # the child's sampling stream, for checkpoints
    engine.close()

The trainer goes on in its own process meanwhile: the two never share a thread pool. A child that dies (killed,
out of memory) makes the waiting call raise `RolloutProcessError` with its exit status, never a hang; an error
inside the child is raised in the caller with the child's traceback.
"""

from __future__ import annotations

import threading
import traceback
from typing import Callable, Iterable

import torch
import torch.multiprocessing as mp

from posttrain.rollout.base import RolloutOutput, SamplingParams

POLL_S = 0.5  # how often a waiting call checks that the child is alive


def on_cpu(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs to send to the child: CPU tensors, which travel as shared memory."""
    return [(name, t.detach().cpu()) for name, t in weights]


def min_version_of(engine, params: SamplingParams) -> int | None:
    """In flight: the weights' version a generate waits for: a streamed piece's own (params.weights_version), else
    the one the engine was last told (its `min_version`)."""
    return params.weights_version if params.weights_version is not None else engine.min_version


class RolloutProcessError(RuntimeError):
    """The rollout process died, or did not start. `how`: the death in a phrase ("the rollout process (pid 7)
    was killed by signal 9 during generate"), without what to do about it."""

    def __init__(self, message: str, how: str | None = None):
        super().__init__(message)
        self.how = how or message


class InFlight:
    """The rollout side of in-flight weight updates: (version, weights) come while the engine generates (from
    their own pipe here, or a Ray actor's method: worker/rollout_actors.py); the engine's `weights_hook` loads the
    newest at its next forward (rollout/hf.py), or, on vLLM's engine, between two steps once `weights_pending()`
    says one waits (rollout/vllm_partial.py)."""

    def __init__(self, engine, conn=None):
        self.engine = getattr(engine, "engine", engine)  # the HF engine inside any wrapper
        self.pending: tuple | None = None
        self.lock = threading.Condition()
        self.engine.weights_hook = self.apply
        self.engine.weights_pending = lambda: self.pending is not None  # asked without loading (vLLM's engine)
        if conn is not None:
            threading.Thread(target=self._receive, args=(conn,), name="posttrain-weights", daemon=True).start()

    def _receive(self, conn) -> None:
        while True:
            try:
                update = conn.recv()
            except (EOFError, OSError):
                return
            self.offer(update)

    def offer(self, update: tuple) -> None:
        """(version, weights): loaded at the engine's next forward; a newer one replaces one not loaded yet."""
        with self.lock:
            self.pending = update
            self.lock.notify_all()

    def wait_for(self, version: int, timeout_s: float = 600.0) -> None:
        """Before a generate: the weights pipe and the command pipe keep no order between them, so wait until
        `version` (or a newer one) has come, then load it."""
        with self.lock:
            if not self.lock.wait_for(lambda: self.engine.weights_version >= version or (
                    self.pending is not None and self.pending[0] >= version), timeout_s):
                raise RuntimeError(f"weights version {version} did not arrive within {timeout_s:.0f} s")
        self.apply()

    def apply(self) -> None:
        with self.lock:
            update, self.pending = self.pending, None
        if update is not None:
            version, weights = update
            self.engine.load_weights(iter(weights))
            self.engine.weights_version = version


class EngineServer:
    """An engine's verbs as a rollout process of its own (here) or a Ray rollout actor
    (worker/rollout_actors.py) answers them, by name: `getattr(server, verb)(*args)`."""

    VERBS = ("generate", "load_weights", "get_rng_state", "set_rng_state")

    def __init__(self, engine, in_flight: InFlight | None = None):
        self.engine, self.in_flight = engine, in_flight

    def generate(self, prompts, params, min_version):
        """In flight: first wait for `min_version` of the weights (or a newer one), then sample."""
        if self.in_flight is not None and min_version is not None:
            self.in_flight.wait_for(min_version)
        return self.engine.generate(prompts, params)

    def load_weights(self, weights) -> None:
        self.engine.load_weights(iter(weights))

    def get_rng_state(self) -> torch.Tensor:
        return self.engine.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.engine.generator.set_state(state)

    def shutdown(self) -> None:
        stop = getattr(getattr(self.engine, "engine", self.engine), "shutdown", None)
        if stop is not None:  # vLLM's engine-core process: a spawned child exits without atexit handlers
            stop()


def _serve(conn, weights_conn, build: Callable, threads: int | None) -> None:
    """The child: build the engine, then answer (verb, args) until "close" or the parent is gone."""
    if threads:
        torch.set_num_threads(threads)
    try:
        engine = build()
        server = EngineServer(engine, InFlight(engine, weights_conn) if weights_conn is not None else None)
    except BaseException:  # noqa: BLE001  any failure to build is the parent's to report
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"generator": getattr(engine, "generator", None) is not None}))
    while True:
        try:
            verb, args = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if verb == "close":
            server.shutdown()
            conn.send(("ok", None))
            return
        try:
            if verb not in EngineServer.VERBS:
                raise ValueError(f"unknown verb {verb!r}")
            result = getattr(server, verb)(*args)
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))


class RemoteGenerator:
    """The engine's torch.Generator in another process (a child's, a Ray actor's), as checkpoints see one:
    get_state / set_state, over its `call`."""

    def __init__(self, engine):
        self.engine = engine

    def get_state(self) -> torch.Tensor:
        return self.engine.call("get_rng_state").clone()

    def set_state(self, state: torch.Tensor) -> None:
        self.engine.call("set_rng_state", state)


class RemoteEngine:
    """`RolloutEngine` verbs answered by an engine in a child process (module docstring). Calls from several
    threads are served one at a time."""

    def __init__(self, build: Callable, threads: int | None = None, name: str = "rollout", in_flight: bool = False):
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # in-flight weight updates travel on a pipe of their own, while the command pipe waits on a generate
        self._weights, child_weights = ctx.Pipe(duplex=False)[::-1] if in_flight else (None, None)
        # not a daemon: vLLM's engine starts processes of its own, which a daemonic process may not
        self.process = ctx.Process(target=_serve, args=(child, child_weights, build, threads),
                                   name=f"posttrain-{name}")
        self.process.start()
        child.close()
        if child_weights is not None:
            child_weights.close()
        self._lock, self._weights_lock = threading.Lock(), threading.Lock()
        self.min_version: int | None = None  # in flight: the next generate waits for this version of the weights
        with self._lock:
            started = self._reply("start")
        # the child engine's sampling stream, if it has one to save (the hf engine's; vLLM seeds its requests)
        self.generator = RemoteGenerator(self) if started["generator"] else None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def call(self, verb: str, *args):
        with self._lock:
            if not self.process.is_alive():
                raise self._death(verb)
            self._conn.send((verb, args))
            return self._reply(verb)

    def _reply(self, verb: str):
        while not self._conn.poll(POLL_S):
            if not self.process.is_alive():
                raise self._death(verb)
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise self._death(verb) from None
        if status == "error":
            raise RuntimeError(f"the {self.name} process (pid {self.pid}) failed in {verb}:\n{value.rstrip()}")
        return value

    def _death(self, verb: str) -> RolloutProcessError:
        code = self.process.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with status {code}" if code is not None else "is gone")
        how = f"the {self.name} process (pid {self.pid}) {how} during {verb}"
        return RolloutProcessError(
            f"{how}: the run stops here; its last checkpoint holds every update up to it: run the same command again "
            "to resume (a signal 9 with no one sending it is usually the out-of-memory killer: give the machine more "
            "memory, or the engine less)", how)

    # ------------------------------------------------------------ the RolloutEngine verbs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        return self.call("generate", prompts, params, min_version_of(self, params))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.call("load_weights", on_cpu(weights))

    def send_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In-flight: hand the child `version` of the weights now, even while it generates; it loads them before
        its next forward (the sequences in flight go on with them)."""
        if not self.process.is_alive():
            raise self._death("a weight update")
        with self._weights_lock:
            self._weights.send((version, on_cpu(weights)))

    def update_weights(self, model: torch.nn.Module) -> None:
        raise TypeError("an engine in its own process takes weights with load_weights, not a module")

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to stop; kill it if it does not within `timeout_s` (or is busy with another thread's
        call that long)."""
        if self.process.is_alive() and self._lock.acquire(timeout=timeout_s):
            try:
                self._conn.send(("close", None))
                if self._conn.poll(timeout_s):
                    self._conn.recv()
            except (EOFError, OSError):
                pass
            finally:
                self._lock.release()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()
        if self._weights is not None:
            self._weights.close()
