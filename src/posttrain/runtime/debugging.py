"""A run to debug (trainer.debug=true, or `posttrain train --debug`): docs/debugging.md.

    announce(world_size=8, on_ray=True)   # stderr: what the switch changes in this run
    post_mortem_on_crash()                 # an uncaught exception opens pdb at its frame (stdin a terminal)

Under the switch, rewards, tools and the policy run in the driver process
(build.py: the reward pool in_process, tools.workers.InProcessFunctions, no
Ray), so a breakpoint() in a custom reward or tool stops in pdb in the
user's terminal. A reward call that raises stops the run there (it is
scored 0 and counted otherwise): the bug being hunted is the first one.
"""

from __future__ import annotations

import bdb
import pdb
import sys


def announce(world_size: int, on_ray: bool) -> None:
    """The lines a run being debugged starts with; world_size, on_ray: what the config asks for without it."""
    say("rewards, tools and the policy run in this process: a breakpoint() in them stops in this terminal, and a "
        "reward that raises stops the run")
    say("reward.timeout_s and the tools' time limits do not hold in this process (no worker to kill, and a "
        "breakpoint may wait); the python tool keeps its own")
    if world_size > 1 or on_ray:
        say(f"the config asks for {world_size} Ray worker{'s' if world_size > 1 else ''}; this run has one, in this "
            "process (world size 1, no Ray)")


def say(line: str) -> None:
    print(f"posttrain: debug: {line}", file=sys.stderr)


def post_mortem_on_crash() -> None:
    """From now on an exception that nothing catches prints its traceback and, when stdin is a terminal,
    opens pdb.post_mortem at the frame that raised it; `q` at a breakpoint ends the run with one line."""
    previous = sys.excepthook
    if getattr(previous, "posttrain_post_mortem", False):
        return

    def hook(kind, value, tb):
        if issubclass(kind, bdb.BdbQuit):
            print("posttrain: stopped from the debugger", file=sys.stderr)
            return
        previous(kind, value, tb)
        if issubclass(kind, Exception) and sys.stdin is not None and sys.stdin.isatty():
            say("post-mortem: pdb at the frame that raised (up/down to move, p NAME to look, q to quit)")
            pdb.post_mortem(tb)

    hook.posttrain_post_mortem = True
    sys.excepthook = hook
