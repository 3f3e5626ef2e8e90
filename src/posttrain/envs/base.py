"""What an environment is: a class that starts a conversation from a dataset row and answers each of the model's
turns.

    class GuessTheNumber:
        def __init__(self, low=1, high=10):            # rollout.multi_turn.environment_kwargs
            self.low, self.high = low, high

        def reset(self, row):                          # the row: prompt, data_source, reward_model, extra_info
            self.secret = int(row["reward_model"]["ground_truth"])
            return row["prompt"]                       # the messages the conversation starts with

        def step(self, action):                        # the model's turn, as text
            guess = int(action.strip()) if action.strip().isdigit() else None
            if guess == self.secret:
                return Step([], reward=1.0, done=True)
            hint = "higher" if guess is not None and guess < self.secret else "lower"
            return Step([{"role": "user", "content": hint}], reward=0.0, done=False)

`step` may also return gym's tuple (observation, reward, done, info), and an observation may be a string (one
user message), a message dict, or a list of messages. `close()` is called when the conversation ends, if the
class has one. An instance serves one conversation at a time; a run makes one per sample.

`reset(row)` returns the whole first observation: usually the row's prompt, perhaps with messages added (a game's
board). The model's turns, never re-tokenized, and the environment's messages in the chat template's rendering
make the response; the loss falls on the model's tokens only (rollout.multiturn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ROLES = ("user", "tool", "system")


@dataclass
class Step:
    """An environment's answer to one turn: what the model reads next, the turn's reward, whether the
    conversation is over, and anything to log (info: numbers are averaged into env/<key>/mean)."""

    observation: list = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


def as_messages(observation, what: str) -> list[dict]:
    """An observation as chat messages: a string is one user message; ValueError naming `what` otherwise."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if not isinstance(observation, (list, tuple)):
        raise ValueError(f"{what} returned a {type(observation).__name__} as its observation; return a string, a "
                         "message {'role': 'user', 'content': ...} or a list of them")
    out = []
    for m in observation:
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES + ("assistant",)):
            raise ValueError(f"{what} returned {str(m)[:80]!r} in its observation; a message is "
                             "{'role': 'user' | 'tool' | 'system', 'content': str}")
        out.append(dict(m))
    return out


def as_step(value, what: str = "step()") -> Step:
    """A step's return value as a Step: a Step, or gym's (observation, reward, done[, truncated], info) tuple.
    ValueError naming what is wrong (a reward that is not a finite number, a malformed observation)."""
    if isinstance(value, Step):
        observation, reward, done, info = value.observation, value.reward, value.done, value.info
    elif isinstance(value, tuple) and len(value) in (4, 5):
        observation, reward, done, *rest = value
        info = rest[-1]
        done = bool(done) or (len(rest) == 2 and bool(rest[0]))  # gymnasium: terminated, truncated
    else:
        raise ValueError(f"{what} returned {type(value).__name__}; return a posttrain.envs.Step or a tuple "
                         "(observation, reward, done, info)")
    try:
        reward = float(reward if reward is not None else 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"{what} returned the reward {str(reward)[:40]!r}; return a number") from None
    if not math.isfinite(reward):
        raise ValueError(f"{what} returned the reward {reward}; return a finite number")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"{what} returned info of type {type(info).__name__}; return a dict or None")
    return Step(as_messages(observation, what), reward, bool(done), dict(info or {}))
