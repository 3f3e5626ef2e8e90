"""Score a batch of responses with a reward function that may misbehave.

    result = score_batch(compute_score, ["arith", "arith"], ["68", "67"], ["68", "68"], [{}, {}])
    result.scores                    # [1.0, 0.0]
    result.num_errors, result.num_timeouts   # (0, 0)

A call that raises, returns something that is not a finite number, or runs
past `timeout_s` scores 0.0 and is counted; it never stops the run.
Accepted returns: a float, an int, a bool, or verl's dict with a "score" key;
the dict's other keys that hold a finite number (verl's `acc`, ...) are kept
per response in `ScoreResult.extras`, the run logs their means
(`reward/<key>/mean`, `val/<key>/mean`), and the rest (`pred` text, ...) are
dropped.

The time limit is a SIGALRM timer (signal.setitimer), so it applies only in
the main thread on platforms that have it (Linux, macOS); elsewhere calls
run without a limit. It interrupts Python code, not a call stuck inside C
code. `score_batch` calls the function in this process, one call after
another; a run scores in worker processes instead (`rewards.pool.RewardPool`),
each call with this soft limit inside its worker and a hard one (the worker
killed) around it, so a hang in C code or a crash costs one sample. Both
paths share `score_one` (one call -> an Outcome) and `tally` (-> ScoreResult).
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from posttrain.text.lines import one_line

MAX_MESSAGES = 5

# what became of one call: (score, kind, message, extras); kind is one of these, message "" when OK,
# extras the numbers a dict return held beside "score" ({} otherwise)
OK, ERROR, TIMEOUT, CRASH = "ok", "error", "timeout", "crash"
Outcome = tuple[float, str, str, dict]
UNSCORED: Outcome = (0.0, OK, "", {})  # nothing to score (an empty response)


class _Timeout(BaseException):
    """Raised by the alarm. A BaseException, so a reward function's own
    `except Exception:` cannot swallow it and return a score late."""


@dataclass
class ScoreResult:
    scores: list[float]  # one per response, 0.0 where the call failed
    num_errors: int = 0  # calls that raised or returned something not a finite number
    num_timeouts: int = 0  # calls stopped at timeout_s
    num_crashes: int = 0  # calls whose worker process died (segfault, os._exit, killed): see rewards.pool
    errors_by_source: dict[str, int] = field(default_factory=dict)  # data_source -> errors + timeouts + crashes
    messages: list[str] = field(default_factory=list)  # the first few distinct failures, one line each
    model_scores: list[float] | None = None  # a reward model's score of each response (rewards.model), if any
    extras: list[dict] = field(default_factory=list)  # per response, a dict return's other numbers ({} if none)

    def extra_means(self) -> dict[str, float]:
        """The mean of each extra key over the responses that returned it."""
        found: dict[str, list[float]] = {}
        for extra in self.extras:
            for key, value in extra.items():
                found.setdefault(key, []).append(value)
        return {key: sum(values) / len(values) for key, values in sorted(found.items())}


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




def extra_numbers(value) -> dict[str, float]:
    """A dict return's finite numbers other than "score" (verl's extra reward infos), as floats.

        extra_numbers({"score": 1.0, "acc": True, "pred": "68"})   # {"acc": 1.0}
    """
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in value.items()
            if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))}


def failure(kind: str, source, detail: str) -> Outcome:
    """The Outcome of a failed call, its message one line naming the data source.

        failure(ERROR, "gsm8k", "raised ValueError: x")
        # -> (0.0, "error", "reward for data_source 'gsm8k' raised ValueError: x", {})
    """
    return 0.0, kind, f"reward for data_source '{source}' {detail}", {}


def score_one(fn, call: tuple, timeout_s: float | None, raise_errors: bool = False) -> Outcome:
    """fn(*call) for call = (data_source, solution_str, ground_truth, extra_info), as an Outcome:
    (score, OK, "", extras) or (0.0, ERROR / TIMEOUT, message, {}). raise_errors (a run being debugged,
    rewards.pool.in_process): a call that raises, or returns no number, raises instead."""
    try:
        value = _call_with_limit(fn, call, timeout_s)
        return as_score(value), OK, "", extra_numbers(value)
    except _Timeout:
        return failure(TIMEOUT, call[0], f"ran past {timeout_s} s")
    except Exception as e:  # noqa: BLE001  a reward bug costs that sample's score, not the run
        if raise_errors:
            raise
        return failure(ERROR, call[0], f"raised {one_line(e)}")


def parallel_calls(data_sources, solution_strs, ground_truths, extra_infos) -> list[tuple]:
    """The four parallel lists (one entry per response) as one call tuple per response, or ValueError."""
    n = len(solution_strs)
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(f"score_batch needs parallel lists, got {len(data_sources)} data_sources, {n} responses, "
                         f"{len(ground_truths)} ground truths, {len(extra_infos)} extra_infos")
    return list(zip(data_sources, solution_strs, ground_truths, extra_infos))


def tally(data_sources, outcomes: list[Outcome]) -> ScoreResult:
    """One Outcome per response -> the ScoreResult: failures counted by kind
    and by data source, the first MAX_MESSAGES distinct messages kept."""
    kinds, failures, messages = Counter(), Counter(), []
    for source, (_, kind, msg, _) in zip(data_sources, outcomes):
        if kind == OK:
            continue
        kinds[kind] += 1
        failures[source] += 1
        if len(messages) < MAX_MESSAGES and msg not in messages:
            messages.append(msg)
    return ScoreResult([o[0] for o in outcomes], num_errors=kinds[ERROR], num_timeouts=kinds[TIMEOUT],
                       num_crashes=kinds[CRASH], errors_by_source=dict(failures), messages=messages,
                       extras=[o[3] for o in outcomes])


def score_batch(fn, data_sources, solution_strs, ground_truths, extra_infos, timeout_s: float = 10.0) -> ScoreResult:
    """Call fn(data_source, solution_str, ground_truth, extra_info) for each
    response (verl's reward signature), in this process, and collect the
    scores. The four lists are parallel (one entry per response)."""
    calls = parallel_calls(data_sources, solution_strs, ground_truths, extra_infos)
    return tally(data_sources, [score_one(fn, call, timeout_s) for call in calls])
