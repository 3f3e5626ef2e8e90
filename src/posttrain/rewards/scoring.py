"""Score a batch of responses with a reward function that may misbehave.

A call that raises, returns something that is not a finite number, or runs
past `timeout_s` scores 0 and is counted; it never stops the run. The time
limit uses SIGALRM, so it applies in the main thread of a Unix process and
interrupts Python code (not a call stuck inside C code); elsewhere calls run
without a limit.
"""

from __future__ import annotations

import math
import signal
import threading
from collections import Counter
from dataclasses import dataclass, field


class _Timeout(Exception):
    pass


@dataclass
class ScoreResult:
    scores: list[float]
    num_errors: int = 0
    num_timeouts: int = 0
    errors_by_source: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)  # the first few, for a log line


def _as_score(value) -> float:
    if isinstance(value, dict):  # verl allows {"score": ..., other metrics}
        value = value.get("score")
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    raise TypeError(f"reward returned {value!r}, not a finite number")


def _can_time_out() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _call_with_limit(fn, args, timeout_s: float):
    if not timeout_s or timeout_s <= 0 or not _can_time_out():
        return fn(*args)

    def on_alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score_batch(fn, data_sources, solution_strs, ground_truths, extra_infos, timeout_s: float = 10.0) -> ScoreResult:
    scores, errors, timeouts, messages = [], Counter(), 0, []
    for source, text, truth, extra in zip(data_sources, solution_strs, ground_truths, extra_infos):
        try:
            scores.append(_as_score(_call_with_limit(fn, (source, text, truth, extra), timeout_s)))
            continue
        except _Timeout:
            timeouts += 1
            msg = f"reward for data_source '{source}' ran past {timeout_s} s"
        except Exception as e:  # a reward bug costs that sample's score, not the run
            msg = f"reward for data_source '{source}' raised {type(e).__name__}: {e}"
        errors[source] += 1
        scores.append(0.0)
        if len(messages) < 5 and msg not in messages:
            messages.append(msg)
    return ScoreResult(scores, sum(errors.values()) - timeouts, timeouts, dict(errors), messages)
