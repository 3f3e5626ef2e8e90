"""Helper processes that end with the trainer: the reward pool's (rewards.pool) and the tool functions'
(tools.workers) workers.

    w = WorkerProcess("reward", serve, loader, timeout_s)   # serve(conn, loader, timeout_s) in a new process
    w.conn.send(...); w.conn.recv()
    w.exit_reason()          # after its pipe closed: "SIGSEGV", "exit code 1", ...
    stop_all([w])            # EOF first, then kill what still runs after a second

A worker is spawned, never forked: the trainer runs torch threads. A
forkserver would start one ~25 ms sooner, but its children keep the
forkserver alive, so a stuck worker would outlive a killed trainer. Workers
are not daemons (a reward or tool function may start processes of its own),
and they ignore SIGINT and SIGTERM: Ctrl-C and a batch system's stop reach
the whole process group, and the trainer finishes its step (which needs
them) before it stops. They end with the trainer: an idle one reads EOF from
its pipe, and on Linux the kernel SIGKILLs any, even one stuck in C code,
when the thread that started it ends (PR_SET_PDEATHSIG); ps and top name it
`<kind>-worker`. Like any spawned process, a worker imports the main script:
a script that starts a run needs `if __name__ == "__main__":`.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
import time

START_METHOD = "spawn"  # see the module docstring
LOAD_TIMEOUT_S = 120.0  # a worker that has not loaded its functions by then is an error
STOP_WAIT_S = 1.0  # stop_all: how long workers have to exit at EOF before they are killed


class WorkerProcess:
    """A spawned process running target(conn, *args), and this end of its pipe (`conn`)."""

    def __init__(self, kind: str, target, *args):
        ctx = multiprocessing.get_context(START_METHOD)
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_run, args=(kind, target, child_end, *args), name=f"posttrain-{kind}")
        self.proc.start()
        child_end.close()

    def exit_reason(self) -> str:
        """Why a worker whose pipe closed is gone: its signal or exit code."""
        self.proc.join(1.0)  # its pipe closes a moment before its exit status is known
        code = self.proc.exitcode
        if code is None:
            return "closed its pipe"
        return signal.Signals(-code).name if code < 0 else f"exit code {code}"

    def stop(self) -> None:
        """Kill it (if it still runs), reap it, close its pipe."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


def stop_all(workers: list) -> None:
    """Stop and forget these WorkerProcesses (the list is emptied first): each exits at EOF on its pipe;
    any still running after STOP_WAIT_S are killed."""
    stopping = list(workers)
    workers.clear()
    for w in stopping:
        w.conn.close()
    end = time.monotonic() + STOP_WAIT_S
    for w in stopping:
        w.proc.join(max(0.0, end - time.monotonic()))
        w.stop()


def _run(kind: str, target, conn, *args) -> None:
    """A worker's first lines, then its life (target)."""
    # Ctrl-C and a batch system's SIGTERM reach the whole process group: the trainer finishes its step
    # (which needs its workers) and saves; the workers end with it (EOF, or the kernel's SIGKILL below)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with_parent(f"{kind}-worker")
    target(conn, *args)


def _end_with_parent(title: str) -> None:
    """Linux: the kernel SIGKILLs this process when the thread that started it ends, so a call stuck in
    C code cannot outlive the run; ps/top show `title`. Elsewhere: EOF on the pipe still ends an idle one."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, title.encode())  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
