"""Agent programs as rollouts: each sample of a prompt is one run of the user's agent function, which talks to
the policy through the OpenAI-compatible endpoint (agents.server); its tokens, as served, are the sample.

    def agent(row, client):            # rollout.multi_turn.agent=pkg.module:agent
        llm = openai.OpenAI(base_url=client["base_url"], api_key=client["api_key"])
        ...                             # any loop: tools, environments, sub-calls; one conversation
        return 1.0                      # its reward; None: the reward function scores the last answer

Runs go in threads of this process (they wait on HTTP; the engine samples their requests together), at most
`workers` at once, each at most `timeout_s`. A run that raises, times out or made no request fails its sample
(counted: agent/num_errors, agent/num_timeouts; its response mask zero, so it trains nothing), never the run.
"""

from __future__ import annotations

import bdb
import math
import queue
import threading
import time

from posttrain.rollout.base import RolloutOutput
from posttrain.rollout.hf import left_pad
from posttrain.rollout.multiturn import Trajectory, assemble
from posttrain.text.lines import one_line


def rollout_with_agent(server, agent, rows: list[dict], n: int, workers: int, timeout_s: float,
                       fallback_prompts: list[list[int]], errors: dict) -> tuple[RolloutOutput, list[Trajectory]]:
    """n runs of `agent` per row -> (their RolloutOutput, prompt-major, and trajectories); `fallback_prompts[i]`:
    row i's own prompt ids, the prompt of a run that made no request. `errors` counts failures by kind."""
    runs = [rows[i // n] for i in range(len(rows) * n)]
    keys = [server.open_session() for _ in runs]
    results: list = [None] * len(runs)
    finished = [threading.Event() for _ in runs]

    starts: list = [None] * len(runs)
    lock = threading.Lock()  # a run's result is written once: by the run, or as a timeout by the waiter

    def one(i: int) -> None:
        starts[i] = time.monotonic()
        server.agent_started(keys[i])
        try:
            outcome = ("ok", agent(dict(runs[i]), {"base_url": server.base_url, "api_key": keys[i],
                                                   "model": server.model_name}))
        except bdb.BdbQuit:
            outcome = ("error", "stopped at a breakpoint")
        except BaseException as e:  # noqa: BLE001  the agent's fault: its sample fails
            outcome = ("error", one_line(e))
        with lock:
            if results[i] is None:
                results[i] = outcome
        server.agent_done(keys[i])
        finished[i].set()

    todo = queue.SimpleQueue()
    for i in range(len(runs)):
        todo.put(i)

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            one(i)

    # daemon threads, not an executor's: a hung agent must not keep the trainer from exiting
    for _ in range(max(1, min(workers, len(runs)))):
        threading.Thread(target=worker, name="posttrain-agent", daemon=True).start()
    started = time.monotonic()
    for i in range(len(runs)):  # each run's clock starts when it does; waited for in order
        while not finished[i].wait(0.05):
            if starts[i] is not None and time.monotonic() - starts[i] > timeout_s:
                with lock:
                    if results[i] is None:
                        results[i] = ("timeout", f"the agent ran past {timeout_s:g} s")
                server.agent_done(keys[i])
                break
            if starts[i] is None and time.monotonic() - started > timeout_s * len(runs):
                break
    sessions = [server.close_session(k) for k in keys]
    trajs = []
    for i, (s, result) in enumerate(zip(sessions, results)):
        t = Trajectory(messages=s.messages, turns=s.completions, generated_tokens=sum(s.gen),
                       tool_tokens=len(s.gen) - sum(s.gen))
        status, value = result or ("timeout", f"the agent ran past {timeout_s:g} s")
        if status == "ok" and s.completions == 0:
            status, value = "error", "the agent made no request to the endpoint"
        if status == "ok" and value is not None and not _number(value):
            status, value = "error", f"the agent returned {str(value)[:40]!r}; return a number or None"
        if status != "ok":
            t.env_error, t.ended = value, "agent_error"
            errors[status] = errors.get(status, 0) + 1
        else:
            t.rewards = None if value is None else [float(value)]  # None: the reward function scores it
            t.ended = "length" if s.truncated else "answer"
        t.infos = [{"broken_chains": float(s.broken)}]
        trajs.append(t)
        if not s.prompt_ids:  # no request: the row's own prompt, an empty response
            s.prompt_ids = list(fallback_prompts[i // n])
    return _output(sessions, server.tokenizer.pad_token_id), trajs


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _output(sessions, pad: int) -> RolloutOutput:
    """The sessions' chains as one RolloutOutput: prompts left-padded, responses right-padded."""
    prompt_ids, prompt_mask = left_pad([s.prompt_ids for s in sessions], pad, max(len(s.prompt_ids) for s in sessions))
    return assemble(prompt_ids, prompt_mask, [s.seq for s in sessions], [s.gen for s in sessions],
                    [s.logp for s in sessions], [s.truncated for s in sessions], pad)
