"""Which sockets a process tree listens on (tests check that posttrain binds to loopback only)."""

import glob
import os
import re
import subprocess
from pathlib import Path


def process_tree(root: int | None = None) -> set[int]:
    """`root` (default: this process) and every descendant's pid."""
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    tree, todo = set(), [os.getpid() if root is None else root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def non_loopback_listeners(pids: set[int]) -> list[str]:
    """`ss` lines of TCP/UDP sockets owned by `pids` that listen beyond loopback."""
    out = subprocess.run(["ss", "-Hltnup"], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        local = line.split()[4]
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids and not local.startswith(("127.", "[::1]", "[::ffff:127.", "localhost")):
            bad.append(line)
    return bad
