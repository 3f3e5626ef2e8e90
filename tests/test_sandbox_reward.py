"""Code rewards scored by a SandboxFusion service (verl's reward_model.sandbox_fusion.*),
against a fake SandboxFusion on loopback that really runs the posted Python."""

import http.server
import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from posttrain.driver.build import make_rewards
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.rewards import compute_score, sandbox
from posttrain.rewards.pool import RewardPool, builtin_rewards, reward_loader
from posttrain.rewards.sandbox import SandboxSettings, extract_code

DOUBLE = "Read a number, print twice it."
GOOD = "Here you go:\n```python\nn = int(input())\nprint(n * 2)\n```\nDone."
HALF = "```python\nn = int(input())\nprint(6)\n```"  # right for 3 only
CRASH = "```python\nraise SystemExit(3)\n```"
TRUTH = json.dumps({"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10"]})


class FakeSandbox(http.server.BaseHTTPRequestHandler):
    """POST /run_code as SandboxFusion: runs the code (python only), answers its RunCodeResponse.
    /slow/run_code sleeps first (and counts requests in flight); /flaky/run_code answers 504 once;
    /error500 and /garbage answer what they say."""

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append((self.path, body))
        if self.path == "/error500":
            return self._send(500, b"Internal Server Error", "text/plain")
        if self.path == "/garbage":
            return self._send(200, b"<html>hello</html>", "text/html")
        if self.path == "/flaky/run_code" and not server.flaked:
            server.flaked = True
            return self._send(504, b"Gateway Timeout", "text/plain")
        with server.lock:
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
        try:
            if self.path == "/slow/run_code":
                time.sleep(0.3)
            reply = run_python(body)
        finally:
            with server.lock:
                server.in_flight -= 1
        self._send(200, json.dumps(reply).encode(), "application/json")

    def _send(self, code, data: bytes, kind: str):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def run_python(body: dict) -> dict:
    assert body["language"] == "python" and body["files"] == {} and body["fetch_files"] == []
    try:
        done = subprocess.run([sys.executable, "-I", "-c", body["code"]], input=body["stdin"] or "",
                              capture_output=True, text=True, timeout=body["run_timeout"])
    except subprocess.TimeoutExpired:
        run = {"status": "TimeLimitExceeded", "execution_time": body["run_timeout"], "return_code": None,
               "stdout": "", "stderr": ""}
        return {"status": "Failed", "message": "", "compile_result": None, "run_result": run, "files": {}}
    run = {"status": "Finished", "execution_time": 0.01, "return_code": done.returncode, "stdout": done.stdout,
           "stderr": done.stderr}
    return {"status": "Success" if done.returncode == 0 else "Failed", "message": "", "compile_result": None,
            "run_result": run, "executor_pod_name": None, "files": {}}


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeSandbox)
    httpd.daemon_threads = True
    httpd.lock = threading.Lock()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def fake(server, monkeypatch):
    """The fake service, its counters fresh; this process configured with no sandbox afterwards."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    server.requests, server.in_flight, server.peak, server.flaked = [], 0, 0, False
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    sandbox.configure(None)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_solution_scores_the_fraction_of_cases_it_passes(fake):
    url = f"{fake.url}/run_code"
    assert compute_score("apps", GOOD, TRUTH, sandbox_fusion_url=url) == 1.0  # verl's keyword, as a verl file passes it
    path, sent = fake.requests[0]
    assert path == "/run_code" and sent["memory_limit_MB"] == 1024 and sent["stdin"] in ("3\n", "5\n")
    assert "print(n * 2)" in sent["code"] and "Here you go" not in sent["code"]
    sandbox.configure(SandboxSettings(url, memory_limit_mb=256))  # what a reward worker is given
    assert compute_score("taco", HALF, TRUTH) == 0.5  # as verl: passed / cases, not all-or-nothing
    assert compute_score("codeforces", CRASH, TRUTH) == 0.0
    assert fake.requests[-1][1]["memory_limit_MB"] == 256
    count = len(fake.requests)
    assert compute_score("codecontests", "n = int(input())\nprint(n * 2)", TRUTH) == 0.0  # no code block: not run
    assert len(fake.requests) == count


def test_code_is_extracted_as_verl_does():
    assert extract_code("a\n```python\nprint(1)\n```\nb\n```python\nprint(2)\n```") == "\nprint(2)\n"  # the last
    assert extract_code("```py\nprint(1)\n```") == "print(1)\n"  # a language line dropped
    assert extract_code("```\nprint(1)\n```") == "\nprint(1)\n"
    assert extract_code("```c++\nint x;\n```") == "c++\nint x;\n"  # not a plain name: kept, as verl
    assert extract_code("print(1)") is None


def test_fn_name_cases_call_the_function_with_json_arguments(fake):
    sandbox.configure(SandboxSettings(f"{fake.url}/run_code"))
    truth = {"fn_name": "merge", "inputs": ["[1, 3]\n[2]", "[]\n[5, 4]", "[0]\n[]"],
             "outputs": ["[1, 2, 3]", "[4, 5]", "[0]"]}
    method = "```python\nclass Solution:\n    def merge(self, a: List[int], b: List[int]) -> List[int]:\n" \
             "        return sorted(a + b)\n```"
    assert compute_score("apps", method, json.dumps(truth)) == 1.0  # a LeetCode-style class, typing names given
    function = "```python\ndef merge(a, b):\n    return a + b\n```"
    assert compute_score("apps", function, truth) == pytest.approx(1 / 3)  # [0] only; the others unsorted
    stdin = fake.requests[-1][1]["stdin"]
    assert stdin in truth["inputs"]


def test_only_the_first_ten_cases_count_and_a_compile_failure_fails_the_rest(monkeypatch):
    sent = []

    def fake_run(url, code, stdin, memory_limit_mb):  # case "2" fails to compile; the others echo their input
        sent.append(stdin)
        compiled = {"status": "Finished", "return_code": 1 if stdin == "2" else 0}
        run = {"status": "Finished", "return_code": 0, "stdout": stdin + "\n"}
        return {"status": "Failed" if stdin == "2" else "Success", "compile_result": compiled, "run_result": run}

    monkeypatch.setattr(sandbox, "run_code", fake_run)
    truth = {"inputs": [str(i) for i in range(12)], "outputs": [str(i) for i in range(12)]}
    assert sandbox.compute_score("```python\npass\n```", truth, url="http://sandbox/run_code") == 0.2  # 0 and 1
    assert sorted(sent, key=int) == [str(i) for i in range(10)]


def test_assert_cases_and_bad_ground_truths():
    cases = sandbox.parse_cases("def f(x): return x", {"assert_case": ["assert f(1) == 1", "assert f(2) == 2"]})
    assert cases[1] == sandbox.Case("def f(x): return x\n\nassert f(2) == 2", "", None)  # any output passes
    with pytest.raises(ValueError, match="ground_truth is not JSON test cases: 'x = 1'"):
        sandbox.parse_cases("pass", "x = 1")
    with pytest.raises(ValueError, match=r"ground_truth is int, not test cases \{'inputs'"):
        sandbox.parse_cases("pass", "18")
    with pytest.raises(ValueError, match="ground_truth has 2 inputs but 1 outputs"):
        sandbox.parse_cases("pass", {"inputs": ["1", "2"], "outputs": ["1"]})


def test_max_concurrent_bounds_requests_in_flight(fake):
    sandbox.configure(SandboxSettings(f"{fake.url}/slow/run_code", max_concurrent=2))
    truth = {"inputs": [f"{i}\n" for i in range(6)], "outputs": [str(2 * i) for i in range(6)]}
    start = time.monotonic()
    assert compute_score("apps", GOOD, truth) == 1.0
    assert fake.peak == 2  # the cases run concurrently, two at a time
    assert time.monotonic() - start >= 3 * 0.3
    assert SandboxSettings("http://x", 128).per_process(8).max_concurrent == 16  # shared by 8 reward workers
    assert SandboxSettings("http://x", 4).per_process(8).max_concurrent == 1
    assert SandboxSettings("http://x", 128).per_process(0).max_concurrent == 128  # scored in the trainer


@pytest.mark.parametrize("where, problem", [
    ("closed", r"unreachable \(\[Errno 111\] Connection refused\)"),
    ("/error500", r"answered HTTP 500 Internal Server Error \(Internal Server Error\)"),
    ("/garbage", r"answered with something that is not JSON \(b'<html>hello</html>'\)"),
])
def test_a_failing_service_is_a_counted_error_naming_the_url(fake, where, problem):
    url = f"http://127.0.0.1:{closed_port()}/run_code" if where == "closed" else fake.url + where
    one_case = json.dumps({"inputs": ["3\n"], "outputs": ["6\n"]})  # one request: a failed case does not wait for
    # its siblings, whose requests could otherwise reach the server during the next test
    with RewardPool(reward_loader(None, SandboxSettings(url)), 0, timeout_s=20) as pool:
        result = pool.score_batch(["apps", "arith"], [GOOD, "4"], [one_case, "4"], [{}, {}])
    assert result.scores == [0.0, 1.0] and result.num_errors == 1 and result.errors_by_source == {"apps": 1}
    [message] = result.messages
    assert message.startswith(f"reward for data_source 'apps' raised SandboxError: sandbox {url} ")
    assert "check reward.sandbox_fusion.url" in message and "\n" not in message
    assert re.search(problem, message), message


def test_a_gateway_timeout_is_retried(fake, monkeypatch):
    monkeypatch.setattr(sandbox, "RETRY_DELAYS_S", (0.01, 0.01))
    assert compute_score("apps", GOOD, {"inputs": ["4"], "outputs": ["8"]},
                         sandbox_fusion_url=f"{fake.url}/flaky/run_code") == 1.0
    assert [path for path, _ in fake.requests] == ["/flaky/run_code"] * 2


def test_without_a_url_a_code_source_says_how_to_score_it():
    with RewardPool(builtin_rewards, 0, timeout_s=5) as pool:
        result = pool.score_batch(["apps"], [GOOD], [TRUTH], [{}])
    assert result.scores == [0.0] and result.num_errors == 1
    assert "set reward.sandbox_fusion.url (verl's reward_model.sandbox_fusion.url)" in result.messages[0]


def test_verls_keys_reach_the_reward_worker_processes(fake):
    url = f"{fake.url}/run_code"
    cfg = load_config(None, [f"reward_model.sandbox_fusion.url={url}", "reward_model.sandbox_fusion.max_concurrent=128",
                             "reward.num_workers=1"])
    sf = cfg.reward.sandbox_fusion
    assert (sf.url, sf.max_concurrent, sf.memory_limit_mb) == (url, 128, 1024)
    with make_rewards(cfg) as pool:  # one spawned worker process
        result = pool.score_batch(["apps", "taco", "arith"], [GOOD, HALF, "4"], [TRUTH, TRUTH, "5"], [{}] * 3)
    assert result.scores == [1.0, 0.5, 0.0] and result.messages == []
    assert len(fake.requests) == 4


def test_a_custom_file_falling_back_on_the_dispatcher_uses_the_sandbox(fake, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("from posttrain.rewards import compute_score as builtin\n\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 0.25 if data_source == 'mine' else builtin(data_source, solution_str, ground_truth)\n")
    with RewardPool(reward_loader(f"{path}:compute_score", SandboxSettings(f"{fake.url}/run_code")), 0, 20) as pool:
        result = pool.score_batch(["mine", "apps"], ["x", GOOD], ["-", TRUTH], [{}, {}])
    assert result.scores == [0.25, 1.0]


@pytest.mark.parametrize("override, message", [
    ("reward_model.sandbox_fusion.url=127.0.0.1:8080/run_code",
     "reward.sandbox_fusion.url must be an http:// or https:// URL (a SandboxFusion /run_code endpoint), "
     "got 127.0.0.1:8080/run_code"),
    ("reward_model.sandbox_fusion.max_concurrent=0", "reward.sandbox_fusion.max_concurrent must be > 0, got 0"),
    ("reward.sandbox_fusion.memory_limit_mb=-1", "reward.sandbox_fusion.memory_limit_mb must be > 0, got -1"),
])
def test_bad_sandbox_settings_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == message
