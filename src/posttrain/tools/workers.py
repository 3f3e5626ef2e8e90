"""Users' tool functions called in worker processes, so that a call that hangs can be killed.

    workers = FunctionWorkers(["mytools:lookup"])
    workers.call("mytools:lookup", {"query": "x"}, timeout_s=10.0, name="lookup")   # str(lookup(query="x"))
    workers.close()

A worker is spawned (never forked: the trainer runs torch threads) on first
use, imports every function once, and then answers one call at a time: the
function called with the arguments as keyword arguments, its return value
str()'d. A call that raises is a ToolFailure "error: <Type>: <message>"; one
that has not answered after timeout_s is a ToolTimeout, and its worker is
killed (a hang costs a restart: the next call spawns a fresh worker); a
worker that dies mid-call (segfault, os._exit) is a ToolFailure. Callers in
several threads each get a worker of their own (idle ones are reused).
InProcessFunctions answers the same calls in this process instead (a run
being debugged, trainer.debug), without a time limit.

Workers live as the reward pool's do (posttrain.runtime.processes): they ignore
SIGINT and SIGTERM (the trainer ends its step first), an idle one exits at
EOF on its pipe, and on Linux the kernel kills one whose starting thread
ended, even if stuck in C code (ps names it tool-worker); the next call
replaces a worker that died while idle. As any spawned process, a worker
imports the main script: a script that starts a run needs
`if __name__ == "__main__":`.

Why not the reward pool itself: RewardPool's protocol is built around
scores (each call's value is checked to be a finite number, failures counted
per data source, batches split in chunks across workers), and a tool's value
is text, one call at a time, each with its own function; the worker
processes themselves are the same (posttrain.runtime.processes).
"""

from __future__ import annotations

import bdb
import multiprocessing.util
import threading

from posttrain.runtime.processes import LOAD_TIMEOUT_S, WorkerProcess, stop_all
from posttrain.text.lines import one_line
from posttrain.tools.toolset import ToolFailure, ToolTimeout

MAX_REPLY_CHARS = 64_000  # of a return value sent back (the tool set cuts it further)
OK, FAILED = "ok", "failed"


class FunctionWorkers:
    """call(spec, arguments, timeout_s) in a worker process that has imported every spec."""

    def __init__(self, specs):
        self.specs = tuple(specs)
        self._lock = threading.Lock()
        self._idle: list[WorkerProcess] = []
        self._all: list[WorkerProcess] = []  # changed in place: the finalizer below holds this list
        # if close() is missed: stopped when collected, or at exit before multiprocessing joins (forever) its children
        multiprocessing.util.Finalize(self, stop_all, args=(self._all,), exitpriority=10)

    def call(self, spec: str, arguments: dict, timeout_s: float, name: str = "tool") -> str:
        w = self._take(name)
        try:
            w.conn.send((spec, arguments))
        except Exception as e:  # noqa: BLE001  it died just now; or arguments that cannot be pickled
            self._drop(w)
            raise ToolFailure(f"error: tool '{name}' could not be called in its worker process ({one_line(e)})"
                              ) from None
        if not w.conn.poll(timeout_s):
            self._drop(w)
            raise ToolTimeout(f"error: tool '{name}' ran past {timeout_s:g} s; it was stopped")
        try:
            status, text = w.conn.recv()
        except (EOFError, OSError):
            reason = w.exit_reason()
            self._drop(w)
            raise ToolFailure(f"error: tool '{name}' crashed: its worker process died ({reason})") from None
        with self._lock:
            self._idle.append(w)
        if status == OK:
            return text
        raise ToolFailure(f"error: {text}")

    def _take(self, name: str) -> WorkerProcess:
        """An idle worker, or a new one that has imported the functions (ToolFailure if it cannot)."""
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.proc.is_alive():
                    return w
                if w in self._all:  # died while idle (its starting thread ended, or killed from outside)
                    self._all.remove(w)
                w.stop()
        w = WorkerProcess("tool", _serve, self.specs)
        with self._lock:
            self._all.append(w)
        try:
            message = w.conn.recv() if w.conn.poll(LOAD_TIMEOUT_S) else f"not loaded in {LOAD_TIMEOUT_S:.0f} s"
        except (EOFError, OSError):
            message = f"it died ({w.exit_reason()}); check that they import in a fresh process and that the " \
                      "main script guards its run with `if __name__ == '__main__':`"
        if message is not None:
            self._drop(w)
            raise ToolFailure(f"error: tool '{name}' could not start: its worker process could not import the tool "
                              f"functions ({message})")
        return w

    def _drop(self, w: WorkerProcess) -> None:
        w.stop()
        with self._lock:
            if w in self._all:
                self._all.remove(w)

    def close(self) -> None:
        """Stop the workers; the next call starts new ones."""
        with self._lock:
            self._idle.clear()
        stop_all(self._all)


class InProcessFunctions:
    """FunctionWorkers' call in this process, for a run being debugged (trainer.debug): a breakpoint() in a
    tool function stops in this terminal. There is no time limit (no worker to kill); a call that raises
    is a ToolFailure the model reads, as from a worker, except `q` at a breakpoint, which ends the run."""

    def __init__(self, specs):
        from posttrain.tools.functions import import_function

        self.functions = {spec: import_function(spec) for spec in specs}

    def call(self, spec: str, arguments: dict, timeout_s: float, name: str = "tool") -> str:
        try:
            value = self.functions[spec](**arguments)
        except bdb.BdbQuit:
            raise
        except (Exception, SystemExit) as e:  # the tool's fault, as _serve words it
            raise ToolFailure(f"error: {one_line(e)}") from e
        return (value if isinstance(value, str) else str(value))[:MAX_REPLY_CHARS]

    def close(self) -> None:
        pass


def _serve(conn, specs: tuple[str, ...]) -> None:
    """A worker's life: import the functions, then answer calls until EOF."""
    from posttrain.tools.functions import import_function

    try:
        functions = {spec: import_function(spec) for spec in specs}
    except BaseException as e:  # noqa: BLE001  reported to the caller
        conn.send(one_line(e))
        return
    conn.send(None)
    while True:
        try:
            spec, arguments = conn.recv()
        except (EOFError, OSError):  # closed, or the trainer died
            return
        try:
            value = functions[spec](**arguments)
            reply = (OK, (value if isinstance(value, str) else str(value))[:MAX_REPLY_CHARS])
        except BaseException as e:  # noqa: BLE001  the tool's fault: the model reads it (sys.exit() included)
            reply = (FAILED, one_line(e))
        conn.send(reply)

