"""Code rewards scored by a SandboxFusion service (verl's reward_model.sandbox_fusion.*).

    configure(SandboxSettings("http://127.0.0.1:8080/run_code", max_concurrent=8))  # this process's sandbox
    truth = '{"inputs": ["3\\n", "5\\n"], "outputs": ["6\\n", "10\\n"]}'
    compute_score("```python\\nprint(int(input()) * 2)\\n```", truth)       # 1.0
    compute_score("```python\\nprint(6)\\n```", truth)                      # 0.5 (one of two cases)
    compute_score("print(6)", truth)                                      # 0.0 (no code block)

SandboxFusion (github.com/bytedance/SandboxFusion) runs one program per POST
to its /run_code endpoint and answers with its exit status and output. The
semantics are verl's (verl.utils.reward_score.default_compute_score sends
codecontests, apps, codeforces and taco to it, with continuous=True):

- code: the last ```python block; else the first ``` block, a language name
  on its first line dropped; no ``` at all scores 0.0;
- ground_truth: JSON text (or a dict) {"inputs": [...], "outputs": [...]},
  optionally "fn_name" (the code defines that function, or a method of a
  class Solution: each line of a case's input is one JSON argument, and the
  result is printed, as JSON for lists, tuples, dicts, None and bools; common
  standard-library names, typing's included, need no import); or
  {"assert_case": [...]}: each case runs the code with that text appended,
  and passes when it exits 0;
- a case passes when the program exits 0 and its stdout equals str(output),
  both with trailing newlines removed (an output of null: any stdout);
  a compile failure (compiled languages) fails that case and all later ones;
- score: the fraction of the first SCORED_CASES (10) cases passed. verl runs
  every case and scores the first ten; here only those ten are sent.

A response's cases run concurrently, at most `max_concurrent` requests of
this process in flight. Where verl scores a case the service failed on as
not passed, here the service's failure (unreachable, an HTTP error, a reply
that is not SandboxFusion's JSON, its own SandboxError) raises SandboxError
naming the URL: the scoring path then counts the response as an error and
scores it 0 (rewards.scoring). Like verl, HTTP 504 is retried twice, 1 s
then 2 s later. A ground_truth that is not test cases raises ValueError.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from posttrain.text.redact import redact_url
from posttrain.text.lines import one_line

SCORED_CASES = 10  # verl's continuous score: the first ten cases
RUN_TIMEOUT_S = 10  # verl's compile and run limit for each case, in the service
RETRY_DELAYS_S = (1, 2)  # after an HTTP 504 (a gateway in front of the service timed out), as verl
_FIX = "check reward.sandbox_fusion.url"
PASS, FAIL, COMPILE_FAIL = "pass", "fail", "compile_fail"

# names an fn_name solution may use without importing them (LeetCode-style `List[int]`, `Counter`, `inf`)
_FN_PREAMBLE = """\
import bisect, collections, functools, heapq, itertools, json, math, re, string, sys
from bisect import *
from collections import *
from functools import *
from heapq import *
from itertools import *
from math import *
from typing import *
from builtins import *  # math's pow and friends must not shadow the built-ins
_BEFORE_SOLUTION = dict(globals())
"""
_FN_CALL = """
if __name__ == "__main__":
    import json as _json, sys as _sys
    _args = [_json.loads(_line) for _line in _sys.stdin.read().splitlines() if _line.strip()]
    _fn = globals().get(FN_NAME)
    if _fn is None or _fn is _BEFORE_SOLUTION.get(FN_NAME):  # not the solution's own (heapq's merge, ...)
        _fn = getattr(globals()["Solution"](), FN_NAME)
    _result = _fn(*_args)
    print(_json.dumps(_result) if _result is None or isinstance(_result, (bool, list, tuple, dict)) else _result)
"""


class SandboxError(RuntimeError):
    """The sandbox service could not run a program (not: the program failed)."""


@dataclass(frozen=True)
class SandboxSettings:
    """Where and how to run code (reward.sandbox_fusion.*); picklable, for reward worker processes."""

    url: str
    max_concurrent: int = 64  # requests in flight from one process
    memory_limit_mb: int = 1024  # per program, enforced by the service

    def per_process(self, processes: int) -> SandboxSettings:
        """These settings for one of `processes` processes sharing max_concurrent (each at least 1)."""
        return replace(self, max_concurrent=max(1, self.max_concurrent // max(1, processes)))


_configured: tuple[SandboxSettings, threading.BoundedSemaphore] | None = None


def configure(settings: SandboxSettings | None) -> None:
    """Send this process's code rewards to this sandbox (None: to none)."""
    global _configured
    _configured = (settings, threading.BoundedSemaphore(settings.max_concurrent)) if settings else None


def configured() -> SandboxSettings | None:
    return _configured[0] if _configured else None


def extract_code(response: str) -> str | None:
    """The code of a response, as verl finds it, or None when it has no ``` block.

        extract_code("Here:\\n```python\\nprint(1)\\n```")   # "\\nprint(1)\\n"
        extract_code("```cpp\\nint main() {}\\n```")        # "int main() {}\\n"
    """
    if "```python" in response:
        return response.rsplit("```python", 1)[1].split("```", 1)[0]
    if "```" not in response:
        return None
    block = response.split("```", 2)[1]
    first, newline, rest = block.partition("\n")
    return rest if newline and first.strip().isalpha() else block


@dataclass(frozen=True)
class Case:
    code: str  # the whole program sent
    stdin: str | None
    expected: object  # None: any output


def parse_cases(code: str, ground_truth) -> list[Case]:
    """One Case per test of the ground truth (JSON text or dict), or ValueError."""
    truth = ground_truth
    if isinstance(truth, (str, bytes)):
        try:
            truth = json.loads(truth)
        except ValueError:
            raise ValueError(f"ground_truth is not JSON test cases: {str(ground_truth)[:60]!r}") from None
    if not isinstance(truth, dict):
        raise ValueError(f"ground_truth is {type(truth).__name__}, not test cases "
                         "{'inputs': [...], 'outputs': [...]}")
    asserts = truth.get("assert_case")
    if isinstance(asserts, list):
        inputs, outputs = truth.get("inputs", [""] * len(asserts)), truth.get("outputs", [None] * len(asserts))
    else:
        inputs, outputs, asserts = truth.get("inputs"), truth.get("outputs"), None
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise ValueError(f"ground_truth has no test cases (it needs non-empty 'inputs' and 'outputs' lists; keys: "
                         f"{', '.join(map(str, truth)) or 'none'})")
    if len(inputs) != len(outputs) or (asserts is not None and len(asserts) != len(inputs)):
        raise ValueError(f"ground_truth has {len(inputs)} inputs but {len(outputs)} outputs"
                         + (f" and {len(asserts)} assert cases" if asserts is not None else ""))
    fn_name = truth.get("fn_name")
    if fn_name:
        code = _FN_PREAMBLE + code + _FN_CALL.replace("FN_NAME", repr(str(fn_name)))
    return [Case(code + ("\n\n" + str(asserts[i]) if asserts is not None else ""),
                 None if inputs[i] is None else str(inputs[i]), outputs[i]) for i in range(len(inputs))]


def run_code(url: str, code: str, stdin: str | None, memory_limit_mb: int) -> dict:
    """POST one Python program to SandboxFusion's /run_code; its reply (status Success or Failed), or SandboxError."""
    body = json.dumps({"code": code, "language": "python", "stdin": stdin, "compile_timeout": RUN_TIMEOUT_S,
                       "run_timeout": RUN_TIMEOUT_S, "memory_limit_MB": memory_limit_mb, "files": {},
                       "fetch_files": []}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    wait_s = 2 * RUN_TIMEOUT_S + 10  # compile + run + the trip
    shown = redact_url(url)
    for delay in (*RETRY_DELAYS_S, None):
        try:
            request = urllib.request.Request(url, data=body, method="POST", headers=headers)
            with urllib.request.urlopen(request, timeout=wait_s) as response:
                raw = response.read()
            break
        except urllib.error.HTTPError as e:
            if e.code == 504 and delay is not None:
                time.sleep(delay)
                continue
            raise SandboxError(f"sandbox {shown} answered HTTP {e.code} {e.reason}{_body(e)}; {_FIX}") from None
        except http.client.HTTPException as e:  # what answered does not speak HTTP
            raise SandboxError(f"sandbox {shown} did not answer in HTTP ({one_line(e)}); {_FIX}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:  # ValueError: not a URL urllib can open
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise SandboxError(f"sandbox {shown} did not answer within {wait_s} s; {_FIX}") from None
            raise SandboxError(f"sandbox {shown} unreachable ({reason}); {_FIX}") from None
    try:
        reply = json.loads(raw)
    except ValueError:
        raise SandboxError(f"sandbox {shown} answered with something that is not JSON ({raw[:60]!r}); "
                           f"is it a SandboxFusion /run_code endpoint? {_FIX}") from None
    status = reply.get("status") if isinstance(reply, dict) else None
    if status == "SandboxError":
        raise SandboxError(f"sandbox {shown} failed to run the program (SandboxError: {reply.get('message')!s:.100})")
    if status not in ("Success", "Failed"):
        raise SandboxError(f"sandbox {shown} answered JSON that is not a SandboxFusion /run_code reply "
                           f"({raw[:60]!r}); {_FIX}")
    return reply


def _body(e: urllib.error.HTTPError) -> str:
    """The start of an HTTP error's body, on one line (SandboxFusion explains a refused request there)."""
    try:
        text = " ".join(e.read(120).decode("utf-8", "replace").split())
    except (OSError, ValueError, http.client.HTTPException):
        return ""
    return f" ({text[:100]})" if text else ""


def verdict(reply: dict, expected) -> str:
    """PASS, FAIL or COMPILE_FAIL for one /run_code reply and the expected output."""
    compiled, run = reply.get("compile_result") or {}, reply.get("run_result") or {}
    if reply["status"] == "Failed" and compiled and (
            compiled.get("status") != "Finished" or compiled.get("return_code") != 0):
        return COMPILE_FAIL
    if reply["status"] != "Success" or run.get("status") != "Finished":
        return FAIL
    if expected is None or str(run.get("stdout") or "").rstrip("\n") == str(expected).rstrip("\n"):
        return PASS
    return FAIL


def compute_score(solution_str: str, ground_truth, url: str | None = None, memory_limit_mb: int | None = None,
                  semaphore=None) -> float:
    """The fraction of the first SCORED_CASES test cases the response's code passes (see the module docstring).
    url, memory_limit_mb, semaphore (anything usable as `with semaphore:`): None takes this process's
    configure()d settings."""
    settings, limiter = _configured or (None, None)
    url = url or (settings.url if settings else None)
    if not url:
        raise SandboxError("no sandbox to run code in: set reward.sandbox_fusion.url (verl's "
                           "reward_model.sandbox_fusion.url) to a SandboxFusion /run_code URL")
    memory_limit_mb = memory_limit_mb or (settings.memory_limit_mb if settings else SandboxSettings.memory_limit_mb)
    semaphore = semaphore if semaphore is not None else limiter
    code = extract_code(solution_str)
    if code is None:
        return 0.0
    cases = parse_cases(code, ground_truth)[:SCORED_CASES]

    def run(case: Case) -> str:
        if semaphore is None:
            return verdict(run_code(url, case.code, case.stdin, memory_limit_mb), case.expected)
        with semaphore:
            return verdict(run_code(url, case.code, case.stdin, memory_limit_mb), case.expected)

    # not `with`: that would wait for every case even when the reward's time limit interrupts this thread
    pool = ThreadPoolExecutor(max_workers=len(cases), thread_name_prefix="sandbox")
    try:
        verdicts = [f.result() for f in [pool.submit(run, case) for case in cases]]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if COMPILE_FAIL in verdicts:  # as verl: a compile failure fails every later case too
        verdicts = verdicts[:verdicts.index(COMPILE_FAIL)]
    return verdicts.count(PASS) / len(cases)
