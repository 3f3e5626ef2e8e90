"""Score a batch of responses with a reward function that may misbehave.

    result = score_batch(compute_score, ["arith", "arith"], ["68", "67"], ["68", "68"], [{}, {}])
    result.scores                    # [1.0, 0.0]
    result.num_errors, result.num_timeouts   # (0, 0)

A call that raises, returns something that is not a finite number, or runs
past `timeout_s` scores 0.0 and is counted; it never stops the run.
Accepted returns: a float, an int, a bool, or verl's dict with a "score" key
(its other keys are dropped here).

The time limit is a SIGALRM timer (signal.setitimer), so it applies only in
the main thread on platforms that have it (Linux, macOS); elsewhere calls
run without a limit. It interrupts Python code, not a call stuck inside C
code. Calls run one after another in this process; running them in worker
processes (parallel, and with a hard limit) is a later step.
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

MAX_MESSAGES = 5


class _Timeout(BaseException):
    """Raised by the alarm. A BaseException, so a reward function's own
    `except Exception:` cannot swallow it and return a score late."""


@dataclass
class ScoreResult:
    scores: list[float]  # one per response, 0.0 where the call failed
    num_errors: int = 0  # calls that raised or returned something not a finite number
    num_timeouts: int = 0  # calls stopped at timeout_s
    errors_by_source: dict[str, int] = field(default_factory=dict)  # data_source -> errors + timeouts
    messages: list[str] = field(default_factory=list)  # the first few distinct failures, one line each


def as_score(value) -> float:
    """A reward function's return value as a float, or TypeError.

        as_score(True) -> 1.0;  as_score({"score": 0.5, "acc": 1}) -> 0.5;  as_score("1") -> TypeError
    """
    if isinstance(value, dict):  # verl allows {"score": ..., other metrics}
        if "score" not in value:
            raise TypeError(f"reward returned a dict without a 'score' key (keys: {', '.join(map(str, value))})")
        value = value["score"]
    # numbers.Real also takes numpy scalars (np.float32, np.int64) and bool
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise TypeError(f"reward returned {value!r:.80}, not a finite number")


def _can_time_out() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _call_with_limit(fn, args, timeout_s: float | None):
    """fn(*args), raising _Timeout after timeout_s seconds when that can be done.
    The previous SIGALRM handler and timer (e.g. pytest-timeout's) are put back
    afterwards, the timer less the time this call took."""
    if not timeout_s or timeout_s <= 0 or not _can_time_out():
        return fn(*args)

    def on_alarm(signum, frame):
        raise _Timeout()

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    prev_delay, prev_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(*args)
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # nested: an alarm landing on the line above still gets the old handler back
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
            if prev_delay > 0:  # an outer timer that ran out meanwhile fires at once
                left = max(prev_delay - (time.monotonic() - start), 1e-6)
                signal.setitimer(signal.ITIMER_REAL, left, prev_interval)


def _summary(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def score_batch(fn, data_sources, solution_strs, ground_truths, extra_infos, timeout_s: float = 10.0) -> ScoreResult:
    """Call fn(data_source, solution_str, ground_truth, extra_info) for each
    response (verl's reward signature) and collect the scores. The four lists
    are parallel (one entry per response)."""
    n = len(solution_strs)
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(f"score_batch needs parallel lists, got {len(data_sources)} data_sources, {n} responses, "
                         f"{len(ground_truths)} ground truths, {len(extra_infos)} extra_infos")
    scores, failures, timeouts, messages = [], Counter(), 0, []
    for source, text, truth, extra in zip(data_sources, solution_strs, ground_truths, extra_infos):
        try:
            scores.append(as_score(_call_with_limit(fn, (source, text, truth, extra), timeout_s)))
            continue
        except _Timeout:
            timeouts += 1
            msg = f"reward for data_source '{source}' ran past {timeout_s} s"
        except Exception as e:  # noqa: BLE001  a reward bug costs that sample's score, not the run
            msg = f"reward for data_source '{source}' raised {_summary(e)}"
        failures[source] += 1
        scores.append(0.0)
        if len(messages) < MAX_MESSAGES and msg not in messages:
            messages.append(msg)
    return ScoreResult(scores, sum(failures.values()) - timeouts, timeouts, dict(failures), messages)
