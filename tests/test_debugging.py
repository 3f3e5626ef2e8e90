"""A run to debug (trainer.debug, `posttrain train --debug`): rewards, tools and the policy in the driver
process, so breakpoint() stops in the user's terminal and a crash opens pdb post-mortem; Ray's debugger
settings reach the workers. The terminal sessions are driven through a pseudo-terminal."""

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.driver.build import build_run
from posttrain.driver.placement import uses_ray
from posttrain.config import load_config
from posttrain.data.schema import read_rows, write_rows
from posttrain.distributed.group import worker_env
from posttrain.rewards.pool import in_process
from posttrain.tools import ToolCall, ToolResult, load_tools
from posttrain.worker.verbs import Worker

POSTTRAIN = str(Path(sys.executable).with_name("posttrain"))
WAIT_S = 240.0  # for the first prompt: the run imports torch and builds its model first, on a busy 2-core machine


def tiny_overrides(tmp_path: Path, model_dir) -> list[str]:
    """One GRPO step on 8 prompts x 2 samples of 4 tokens, no validation."""
    from posttrain.driver.build_data import embedded_data_files

    write_rows(read_rows(embedded_data_files()[1])[:8], tmp_path / "train.parquet")
    return [f"model.path={model_dir}", f"data.train_files={tmp_path / 'train.parquet'}", "data.train_batch_size=8",
            "data.max_prompt_length=64", "data.max_response_length=4", "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size=16", "rollout.n=2", "trainer.total_training_steps=1",
            "trainer.val_before_train=false", "trainer.val_at_end=false", f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.logger=[]"]


# ---- in a terminal

class Terminal:
    """`posttrain ARGS` with a pseudo-terminal as its stdin, stdout and stderr."""

    def __init__(self, args: list[str], cwd: Path):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONBREAKPOINT"}  # a Ray driver's hook may be set
        env.update(PYTHONUNBUFFERED="1", TERM="dumb")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: nothing but exec (a failure ends it at once)
            try:
                os.chdir(cwd)
                os.execve(POSTTRAIN, [POSTTRAIN, *args], env)
            finally:
                os._exit(127)
        self.seen, self.pos = b"", 0

    def expect(self, pattern: bytes, timeout: float = 60.0) -> str:
        """Read until `pattern` appears; -> what came since the last expect, up to the pattern's end."""
        deadline = time.monotonic() + timeout
        while pattern not in self.seen[self.pos:]:
            chunk = self._read(deadline)
            assert chunk, f"no {pattern!r} within {timeout:.0f} s; the terminal showed:\n{self.text()[-4000:]}"
            self.seen += chunk
        end = self.seen.index(pattern, self.pos) + len(pattern)
        out, self.pos = self.seen[self.pos:end], end
        return out.decode(errors="replace")

    def send(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\n")

    def finish(self, timeout: float = 120.0) -> int:
        """Read to the end; -> the exit status."""
        deadline = time.monotonic() + timeout
        while True:
            chunk = self._read(deadline)
            if not chunk:
                break
            self.seen += chunk
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def _read(self, deadline: float) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.fd], [], [], left)[0]:
            return b""
        try:
            return os.read(self.fd, 65536)
        except OSError:  # EIO: the child has closed the terminal
            return b""

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def text(self) -> str:
        return self.seen.decode(errors="replace")


@pytest.fixture
def terminal():
    started = []

    def start(args, cwd):
        started.append(Terminal(args, cwd))
        return started[-1]

    yield start
    for t in started:
        t.kill()


REWARD_WITH_A_BREAKPOINT = """
stopped = False

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global stopped
    if not stopped:
        stopped = True
        with open(SEEN, "w") as f:
            f.write(repr(solution_str))
        breakpoint()
    return float(solution_str.strip() == ground_truth)
"""


def test_a_breakpoint_in_a_custom_reward_stops_in_pdb_in_the_terminal(tmp_path, tiny_model_dir, terminal):
    seen = tmp_path / "seen.txt"
    (tmp_path / "my_reward.py").write_text(f"SEEN = {str(seen)!r}\n" + REWARD_WITH_A_BREAKPOINT)
    t = terminal(["train", "--debug", *tiny_overrides(tmp_path, tiny_model_dir), "reward.custom_fn=my_reward.py"],
                 tmp_path)
    before = t.expect(b"(Pdb) ", timeout=WAIT_S)
    assert "posttrain: debug: rewards, tools and the policy run in this process" in before
    assert "posttrain: debug: reward.timeout_s and the tools' time limits do not hold" in before
    assert re.search(r"my_reward\.py\(\d+\)compute_score\(\)", before), before[-2000:]  # pdb's where-line
    t.send("p solution_str")
    assert seen.read_text() in t.expect(b"(Pdb) ")  # the local, as the reward saw it
    t.send("c")
    assert t.finish() == 0, t.text()[-3000:]
    assert "done: 1 step in" in t.text()
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_reward_that_raises_stops_a_debugged_run_in_pdb_post_mortem(tmp_path, tiny_model_dir, terminal):
    """Under the switch a failing reward call is fatal (else it scores 0 and is counted): the post-mortem
    opens at the reward's frame, its locals there to read."""
    (tmp_path / "bad_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('cannot score ' + repr(solution_str))\n")
    t = terminal(["train", *tiny_overrides(tmp_path, tiny_model_dir), "trainer.debug=true",
                  "reward.custom_fn=bad_reward.py"], tmp_path)
    before = t.expect(b"(Pdb) ", timeout=WAIT_S)
    raised = re.search(r"ValueError: cannot score ('.*?')\r?\n", before)
    assert raised and "Traceback (most recent call last)" in before, before[-3000:]
    assert "posttrain: debug: post-mortem" in before and "bad_reward.py" in before
    t.send("p solution_str")
    assert raised.group(1) in t.expect(b"(Pdb) ")
    t.send("q")
    assert t.finish() == 1


def test_without_a_terminal_a_debugged_run_prints_the_traceback_and_exits(tmp_path, tiny_model_dir):
    """No terminal (a batch job, CI): no pdb waiting for input; the traceback and a non-zero status."""
    (tmp_path / "bad_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('cannot score this')\n")
    proc = subprocess.run([POSTTRAIN, "train", "--debug", *tiny_overrides(tmp_path, tiny_model_dir),
                           "reward.custom_fn=bad_reward.py"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 1
    assert "ValueError: cannot score this" in proc.stderr and "(Pdb)" not in proc.stdout + proc.stderr


# ---- what the switch builds

def test_the_switch_builds_everything_in_this_process_at_world_size_1(tmp_path, tiny_model_dir, capsys):
    """A config asking for 2 Ray workers runs as one Worker in this process, with a line saying so;
    the rewards are called here without a time limit, and raise."""
    overrides = [*tiny_overrides(tmp_path, tiny_model_dir), "trainer.n_gpus_per_node=2"]
    assert uses_ray(load_config(None, overrides))
    cfg = load_config(None, [*overrides, "trainer.debug=true"])
    assert not uses_ray(cfg)
    run = build_run(cfg)
    try:
        assert isinstance(run.actor, Worker)
        assert (run.rewards.num_workers, run.rewards.timeout_s, run.rewards.raise_errors) == (0, None, True)
    finally:
        run.rewards.close()
    err = capsys.readouterr().err
    assert "posttrain: debug: the config asks for 2 Ray workers; this run has one, in this process" in err


def test_an_in_process_reward_that_fails_raises():
    pool = in_process(lambda source, text, truth, extra=None: 1.0 if text == "1" else {"no": "score"})
    assert pool.score_batch(["a"], ["1"], ["1"], [{}]).scores == [1.0]
    with pytest.raises(TypeError, match="dict without a 'score' key"):
        pool.score_batch(["a"], ["2"], ["1"], [{}])
    with pytest.raises(ZeroDivisionError):
        in_process(lambda *args: 1 / 0).score_batch(["a"], ["x"], ["1"], [{}])


TOOLS = """
import os

def pid():
    return os.getpid()

def fail(why: str):
    raise ValueError(f"cannot do {why}")

def quit_debugger():
    import bdb
    raise bdb.BdbQuit
"""


def test_tools_run_in_this_process_with_the_workers_answers(tmp_path):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    specs = [f"{tmp_path / 'my_tools.py'}:{name}" for name in ("pid", "fail", "quit_debugger")]
    with load_tools(functions=specs, in_process=True) as tools:
        here, failed = tools.run([ToolCall("pid", {}), ToolCall("fail", {"why": "that"})])
        assert here.content == str(os.getpid())
        # what a worker answers (tests/test_tools.py: test_a_tool_that_raises_is_an_error_result)
        assert failed == ToolResult("fail", "error: ValueError: cannot do that", "error")
        import bdb

        with pytest.raises(bdb.BdbQuit):  # `q` at a breakpoint in a tool ends the run
            tools.run([ToolCall("quit_debugger", {})])


# ---- Ray's debugger

def test_workers_get_the_drivers_ray_debugger_settings(monkeypatch):
    monkeypatch.delenv("RAY_DEBUG", raising=False)
    monkeypatch.delenv("RAY_DEBUG_POST_MORTEM", raising=False)
    assert worker_env({}, one_cpu_node=False) == {}
    assert worker_env({"A": "1"}, one_cpu_node=True) == {"A": "1", "GLOO_SOCKET_IFNAME": "lo"}
    monkeypatch.setenv("RAY_DEBUG", "legacy")
    monkeypatch.setenv("RAY_DEBUG_POST_MORTEM", "1")
    assert worker_env({}, one_cpu_node=False) == {"RAY_DEBUG": "legacy", "RAY_DEBUG_POST_MORTEM": "1"}
    assert worker_env({"RAY_DEBUG": "0"}, one_cpu_node=False)["RAY_DEBUG"] == "0"  # the spec's own wins


@pytest.mark.ray
def test_a_breakpoint_in_a_ray_worker_opens_ray_debug_on_loopback(ray_cluster, monkeypatch):
    """RAY_DEBUG=legacy in the driver only (the cluster was started without it): with the workers'
    runtime_env (worker_env) a breakpoint() in a remote function opens Ray's remote pdb, which `ray debug`
    would list; it listens on 127.0.0.1 only; this test connects to it as `ray debug` does, reads a local
    and continues."""
    import socket

    import ray
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    from posttrain.distributed.cluster import connect

    connect(ray_cluster["address"])
    monkeypatch.setenv("RAY_DEBUG", "legacy")

    @ray.remote(num_cpus=0, runtime_env={"env_vars": worker_env({}, one_cpu_node=True)})
    def stops():
        answer = 41
        breakpoint()
        return answer + 1

    ref = stops.remote()
    deadline, sessions = time.monotonic() + 120, []
    while not sessions:
        assert time.monotonic() < deadline, "no breakpoint registered in 120 s"
        sessions = _internal_kv_list("RAY_PDB_", namespace=ray_constants.KV_NAMESPACE_PDB)
        sessions = [s for s in sessions if not s.startswith(b"RAY_PDB_CONTINUE")]
        time.sleep(0.2)
    data = json.loads(_internal_kv_get(sessions[0], namespace=ray_constants.KV_NAMESPACE_PDB))
    port = int(data["pdb_address"].rsplit(":", 1)[1])
    listening = [line.split()[3] for line in subprocess.run(["ss", "-Hltn"], capture_output=True, text=True,
                                                            check=True).stdout.splitlines()
                 if line.split()[3].endswith(f":{port}")]
    assert listening == [f"127.0.0.1:{port}"], listening
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        def until_prompt() -> str:
            got = b""
            while b"(Pdb) " not in got:
                chunk = conn.recv(4096)
                assert chunk, got
                got += chunk
            return got.decode(errors="replace")

        until_prompt()
        conn.sendall(b"p answer\n")
        assert "41" in until_prompt()
        conn.sendall(b"c\n")
    assert ray.get(ref, timeout=60) == 42
