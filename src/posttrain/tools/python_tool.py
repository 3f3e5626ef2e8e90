"""The `python` tool: the model's code run in a fresh Python process on this machine, with limits.

    run_python("print(sum(range(10)))", timeout_s=10, memory_mb=1024)   # "45\\n"
    run_python("1/0", 10, 1024)        # ToolFailure: "error: ZeroDivisionError: division by zero"
    run_python("while True: pass", 2, 1024)   # ToolTimeout, the process killed after 2 s

Each call runs the code as a script (`__name__ == "__main__"`) in a new
interpreter (this one's, `-I -B`: no user site, no PYTHON* variables) in a
temporary directory that is removed afterwards, and answers with what it
printed to stdout, cut at MAX_OUTPUT_CHARS. Code that fails (an exception,
a non-zero exit, a signal) is a ToolFailure whose text is that output and
then "error: " with the last line of the traceback. The limits:

- time: killed (its whole process group) at timeout_s, a ToolTimeout;
- memory: RLIMIT_AS of memory_mb (an allocation past it raises MemoryError);
- no network: an audit hook (sys.addaudithook, installed before the code
  runs and impossible to remove from Python) refuses socket connect, bind,
  sendto and name lookups, starting processes (subprocess, os.system,
  os.exec*, os.fork, os.posix_spawn), signals to other processes, and
  writing, removing or renaming files outside its directory;
- environment: only PATH, LANG and one thread per math library; HOME and
  TMPDIR are its directory (no credentials from the trainer's environment);
- it dies with the trainer (PR_SET_PDEATHSIG) and ignores its Ctrl-C (a
  session of its own).

This is a guard against a model's mistakes, not a security boundary:
ctypes, reading files, and a CPU-heavy loop until the time limit stay
possible. Code from untrusted sources belongs in a container or a VM
(verl's SandboxFusion service, which posttrain does not call for tools).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from posttrain.tools.toolset import ToolFailure, ToolTimeout

MAX_CODE_CHARS = 100_000
MAX_OUTPUT_CHARS = 4000
_KEPT_BYTES = 4 * MAX_OUTPUT_CHARS  # of stdout, read; the rest is counted and dropped
_TAIL_BYTES = 4096  # of stderr: its last line names the error

SCHEMA = {
    "name": "python",
    "description": "Run Python code in a fresh process and return what it prints (use print). Time and memory "
                   "are limited; there is no network.",
    "parameters": {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python program to run"}},
        "required": ["code"],
    },
}

# Run by the child (python -I -B -c _RUNNER main.py LIMIT_BYTES PARENT_PID): limits and the audit hook, then the code.
_RUNNER = r'''
import os, sys

def _setup():
    import ctypes, resource, signal
    path, limit, parent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer
        libc.prctl(15, b"python-tool")  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the trainer ended before the line above
        os._exit(70)
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    work = os.path.realpath(os.path.dirname(path))
    me = os.getpid()
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    network = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
    processes = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                 "os.forkpty", "os.startfile"}
    paths = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.chmod": (0,),
             "os.chown": (0,), "os.truncate": (0,), "os.symlink": (1,), "os.link": (0, 1), "os.utime": (0,),
             "shutil.rmtree": (0,)}
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

    def inside(p):
        if isinstance(p, int):  # a file descriptor already open
            return True
        real = realpath(fsdecode(p))
        return real == work or real.startswith(work + sep) or real == "/dev/null"

    def hook(event, args):
        if event in network:
            raise PermissionError("network access is disabled in the python tool")
        if event in processes:
            raise PermissionError("starting processes is disabled in the python tool")
        if event in ("os.kill", "os.killpg") and args[0] not in (0, me, -me):
            raise PermissionError("signals to other processes are disabled in the python tool")
        if event == "open" and args[2] & write and not inside(args[0]):
            raise PermissionError(f"writing outside the working directory is disabled in the python tool: {args[0]}")
        if event in paths and not all(inside(args[i]) for i in paths[event] if i < len(args)):
            raise PermissionError("changing files outside the working directory is disabled in the python tool")

    sys.addaudithook(hook)
    return path

_path = _setup()
del _setup
sys.argv = [_path]
sys.path.insert(0, os.path.dirname(_path))
with open(_path, encoding="utf-8") as _file:
    _source = _file.read()
exec(compile(_source, _path, "exec"), {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__})
'''


def run_python(code: str, timeout_s: float, memory_mb: int) -> str:
    """What the code printed; ToolFailure when it failed, ToolTimeout when it ran past timeout_s (see the module)."""
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"the code has {len(code)} characters, more than {MAX_CODE_CHARS}")
    with tempfile.TemporaryDirectory(prefix="posttrain-python-tool-", ignore_cleanup_errors=True) as work:
        path = os.path.join(work, "main.py")
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(code)
        limit = int(memory_mb * 2**20) if memory_mb and memory_mb > 0 else 0
        deadline = time.monotonic() + timeout_s
        proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _RUNNER, path, str(limit), str(os.getpid())],
                                cwd=work, env=_environment(work), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, total, err, finished = _collect(proc, deadline)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            proc.stdout.close()
            proc.stderr.close()
    text = out.decode("utf-8", errors="replace")
    if total > len(out) or len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + f"\n[... output cut: {total} bytes in all]\n"
    if not finished:
        raise ToolTimeout(_then(text, f"error: the code ran past {timeout_s:g} s; it was killed"))
    if proc.returncode == 0:
        return text if text else "(no output: the code printed nothing; use print)"
    raise ToolFailure(_then(text, f"error: {_why(proc.returncode, err, memory_mb)}"))


def _environment(work: str) -> dict:
    env = {"HOME": work, "TMPDIR": work, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "LANG": os.environ.get("LANG", "C.UTF-8"), "PYTHONIOENCODING": "utf-8"}
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[name] = "1"  # a math library's threads each reserve address space: the memory limit would bite first
    return env


def _collect(proc: subprocess.Popen, deadline: float) -> tuple[bytes, int, bytes, bool]:
    """(stdout's first _KEPT_BYTES, its length in all, stderr's last _TAIL_BYTES, whether it ended by the deadline)."""
    out, err, total = bytearray(), bytearray(), 0
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), total, bytes(err), False
            for key, _ in selector.select(left):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                elif key.fileobj is proc.stdout:
                    total += len(data)
                    out += data[:max(0, _KEPT_BYTES - len(out))]
                else:
                    err = (err + data)[-_TAIL_BYTES:]
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # closed its output but runs on
        return bytes(out), total, bytes(err), False
    return bytes(out), total, bytes(err), True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session's group: anything it started goes too
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _why(code: int, err: bytes, memory_mb: int) -> str:
    """Why the code failed, on one line: its traceback's last line, its signal, or its exit status."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the code was killed by {name}" + (" (over its memory limit?)" if name in ("SIGKILL", "SIGSEGV")
                                                   else "")
    lines = [line.strip() for line in err.decode("utf-8", errors="replace").splitlines() if line.strip()]
    if not lines:
        return f"the code exited with status {code}"
    last = lines[-1][:300]
    return last + (f" (the memory limit is {memory_mb} MB)" if last.startswith("MemoryError") else "")


def _then(output: str, line: str) -> str:
    """The output, then the line (on a line of its own)."""
    if not output:
        return line
    return output + ("" if output.endswith("\n") else "\n") + line
