"""Environments run in worker processes, many conversations at once, each call under a time limit, each worker under
a memory limit; whatever goes wrong in one conversation ends that conversation, never the run.

    pool = EnvPool(("class", "games.guess:GuessTheNumber", {"high": 10}), workers=2, timeout_s=10, memory_mb=2048)
    sessions = pool.reset(rows)                     # one conversation per row; session.messages: the first ones
    steps = pool.step(sessions, ["5", "7", ...])    # one Step per session, the calls spread over the workers
    pool.finish(sessions)                           # close() each environment
    pool.close()                                    # stop the workers

A conversation lives in one worker (its environment object is there); the conversations are spread over the
workers, which run their share one call after another, all workers at once. A call that raises, returns something
malformed, or runs past timeout_s (SIGALRM inside the worker) fails its conversation: the session's `error` says
why, its step is done with reward 0, and the other conversations go on. A worker that dies (a crash, the memory
limit in C code, a hang SIGALRM cannot interrupt: killed after timeout_s x its calls + 5 s) fails the
conversations it held, and the next reset starts a new one. Errors are counted (`errors`, by kind).

InProcessEnvs does the same in this process, without limits, for a run being debugged (trainer.debug).
"""

from __future__ import annotations

import bdb
import multiprocessing.util
import signal
import threading
from dataclasses import dataclass, field

from posttrain.envs.base import Step, as_messages, as_step
from posttrain.runtime.processes import LOAD_TIMEOUT_S, WorkerProcess, stop_all
from posttrain.text.lines import one_line

GRACE_S = 5.0
ERROR, TIMEOUT, CRASH = "error", "timeout", "crash"


class EnvFailure(Exception):
    """One conversation's environment failed: `kind` is error | timeout | crash, the message says what."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Session:
    """One conversation: which worker holds it, its first messages, and its end (error: why it failed)."""

    worker: int
    sid: int
    messages: list = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def make_factory(factory: tuple):
    """factory -> a callable that makes one environment: ("class", spec, kwargs) or ("interactions", entries)."""
    kind = factory[0]
    if kind == "class":
        from posttrain.tools.functions import import_function

        cls, kwargs = import_function(factory[1], "environment class", want_class=True), dict(factory[2] or {})
        return lambda: cls(**kwargs)
    if kind == "interactions":
        from posttrain.envs.interactions import Interactions

        return Interactions(factory[1]).new
    raise ValueError(f"unknown environment factory {kind!r}")


class Conversations:
    """The environments of one process, by session id: reset / step / finish, each returning plain data."""

    def __init__(self, factory: tuple):
        self.new = make_factory(factory)
        self.envs: dict[int, object] = {}

    def call(self, op: str, sid: int, arg):
        if op == "reset":
            env = self.new()
            self.envs[sid] = env
            return as_messages(env.reset(arg), "reset()")
        if op == "step":
            s = as_step(self.envs[sid].step(arg))
            return s.observation, s.reward, s.done, _plain(s.info)
        env = self.envs.pop(sid, None)  # finish
        if env is not None and callable(getattr(env, "close", None)):
            env.close()
        return None


class EnvPool:
    """Conversations in `workers` worker processes (see the module)."""

    def __init__(self, factory: tuple, workers: int = 2, timeout_s: float = 30.0, memory_mb: int = 0):
        self.factory, self.timeout_s, self.memory_mb = factory, timeout_s, memory_mb
        self.size = max(1, int(workers))
        self._workers: list[WorkerProcess | None] = [None] * self.size
        self._all: list[WorkerProcess] = []
        self._next_sid = 0
        self.errors: dict[str, int] = {}
        multiprocessing.util.Finalize(self, stop_all, args=(self._all,), exitpriority=10)

    def reset(self, rows: list[dict]) -> list[Session]:
        sessions = []
        for i, row in enumerate(rows):
            self._next_sid += 1
            sessions.append(Session(i % self.size, self._next_sid))
        for s, messages in zip(sessions, self._run(sessions, "reset", rows)):
            if not s.failed:
                s.messages = messages
        return sessions

    def step(self, sessions: list[Session], actions: list[str]) -> list[Step]:
        out = []
        for s, value in zip(sessions, self._run(sessions, "step", actions)):
            out.append(Step([], 0.0, True, {}) if s.failed else Step(*value))
        return out

    def finish(self, sessions: list[Session]) -> None:
        self._run([s for s in sessions if not s.failed], "finish", [None] * len(sessions), count=False)

    def close(self) -> None:
        self._workers = [None] * self.size
        stop_all(self._all)

    def _run(self, sessions: list[Session], op: str, args: list, count: bool = True) -> list:
        """op on each live session, each worker's share in a thread of its own; failures marked on the sessions."""
        results = [None] * len(sessions)
        shares: dict[int, list[int]] = {}
        for j, s in enumerate(sessions):
            if not s.failed:
                shares.setdefault(s.worker, []).append(j)
        for w, js in list(shares.items()):  # started here: a worker dies with the thread that started it
            try:
                self._worker(w, op)
            except EnvFailure as e:
                for j in shares.pop(w):
                    self._fail(sessions[j], e.kind, str(e), count)
        threads = [threading.Thread(target=self._share, args=(w, js, sessions, op, args, results, count))
                   for w, js in shares.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def _share(self, w: int, js: list[int], sessions, op, args, results, count: bool) -> None:
        worker = self._workers[w]
        try:
            try:
                worker.conn.send([(op, sessions[j].sid, args[j]) for j in js])
            except (OSError, ValueError):
                raise EnvFailure(CRASH, f"its worker process died ({worker.exit_reason()})") from None
            limit = self.timeout_s * len(js) + GRACE_S
            if not worker.conn.poll(limit):
                raise EnvFailure(TIMEOUT, f"its worker process did not answer in {limit:g} s (a hang that the "
                                 f"{self.timeout_s:g} s limit could not interrupt) and was killed")
            try:
                replies = worker.conn.recv()
            except (EOFError, OSError):
                raise EnvFailure(CRASH, f"its worker process died ({worker.exit_reason()})") from None
        except EnvFailure as e:
            self._drop(w)
            for j in js:
                self._fail(sessions[j], e.kind, str(e), count)
            return
        for j, (status, value) in zip(js, replies):
            if status == "ok":
                results[j] = value
            else:
                self._fail(sessions[j], status, value, count)

    def _fail(self, s: Session, kind: str, message: str, count: bool) -> None:
        s.error, s.error_kind = message, kind
        if count:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def _worker(self, w: int, op: str) -> WorkerProcess:
        worker = self._workers[w]
        if worker is not None and worker.proc.is_alive():
            return worker
        if worker is not None:
            self._drop(w)
        if op != "reset":  # the conversations it held are gone with it
            raise EnvFailure(CRASH, "its worker process died between two turns")
        try:
            worker = WorkerProcess("env", _serve, self.factory, self.timeout_s, self.memory_mb)
        except Exception as e:  # noqa: BLE001  e.g. a script without `if __name__ == "__main__":`
            raise EnvFailure(ERROR, f"its worker process could not start ({one_line(e)})") from None
        self._all.append(worker)
        try:
            message = worker.conn.recv() if worker.conn.poll(LOAD_TIMEOUT_S) else f"not ready in {LOAD_TIMEOUT_S:.0f} s"
        except (EOFError, OSError):
            message = f"it died ({worker.exit_reason()})"
        if message is not None:
            worker.stop()
            self._all.remove(worker)
            raise EnvFailure(ERROR, f"the environment could not start in its worker process: {message}")
        self._workers[w] = worker
        return worker

    def _drop(self, w: int) -> None:
        worker, self._workers[w] = self._workers[w], None
        if worker is not None:
            worker.stop()
            if worker in self._all:
                self._all.remove(worker)


class InProcessEnvs(EnvPool):
    """EnvPool's conversations in this process, one after another, without limits (trainer.debug): a
    breakpoint() in an environment stops in this terminal; `q` there ends the run."""

    def __init__(self, factory: tuple, *args, **kwargs):
        super().__init__(factory, 1)
        self.conversations = Conversations(factory)

    def _run(self, sessions, op, args, count: bool = True) -> list:
        results = [None] * len(sessions)
        for j, s in enumerate(sessions):
            if s.failed:
                continue
            try:
                results[j] = self.conversations.call(op, s.sid, args[j])
            except bdb.BdbQuit:
                raise
            except Exception as e:  # noqa: BLE001  the environment's fault: this conversation ends
                self._fail(s, ERROR, one_line(e), count)
        return results

    def close(self) -> None:
        pass


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _serve(conn, factory: tuple, timeout_s: float, memory_mb: int) -> None:
    """A worker's life: the memory limit, the environment class, then batches of calls until EOF."""
    if memory_mb and memory_mb > 0:
        import resource

        limit = int(memory_mb * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        conversations = Conversations(factory)
    except BaseException as e:  # noqa: BLE001  reported to the caller
        conn.send(one_line(e))
        return
    conn.send(None)
    signal.signal(signal.SIGALRM, _alarm)
    while True:
        try:
            calls = conn.recv()
        except (EOFError, OSError):
            return
        replies = []
        for op, sid, arg in calls:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                try:
                    replies.append(("ok", conversations.call(op, sid, arg)))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except _Timeout:
                conversations.envs.pop(sid, None)
                replies.append((TIMEOUT, f"{op}() ran past {timeout_s:g} s and was stopped"))
            except MemoryError:
                conversations.envs.pop(sid, None)
                replies.append((ERROR, f"{op}() ran out of memory (the limit is {memory_mb} MB)"))
            except BaseException as e:  # noqa: BLE001  the environment's fault (sys.exit() included)
                conversations.envs.pop(sid, None)
                replies.append((ERROR, f"{op}(): {one_line(e)}"))
        try:
            conn.send(replies)
        except Exception as e:  # noqa: BLE001  a reply that cannot be pickled: say so for each call
            conn.send([(ERROR, f"its reply could not be sent back ({one_line(e)})")] * len(calls))


def _plain(info: dict) -> dict:
    """info with values a pipe carries and a log reads: numbers, text, booleans (others as text)."""
    return {str(k): v if isinstance(v, (int, float, str, bool)) or v is None else str(v)[:200] for k, v in info.items()}
