"""Built-in environments: small games that need several turns, for demonstrations and tests.

    rollout.multi_turn.environment=posttrain.envs.games:AnswerWithHints    # the row's question, "higher"/"lower"
    rollout.multi_turn.environment=posttrain.envs.games:GuessTheNumber     # a secret number, "higher"/"lower"

AnswerWithHints: the row's own prompt (any task whose ground truth is an integer: the embedded arith task,
GSM8K); a wrong answer (the last integer in the turn) gets "higher" or "lower" and another try, `tries` in all.
Reward: 1 for a right first answer, `discount` times less for each try after (0 when none was right).
info: first_try (on the first turn), solved and tries (on the last).

GuessTheNumber: the environment asks ("I am thinking of a number from 1 to 16 ...") and answers each guess with
"higher" or "lower"; the secret is the row's ground truth when it is an integer in range, else drawn from the
row's prompt text (so a row always plays the same game). Reward 1 when found within `tries` guesses, else 0.
info: consistent (each guess: 1 when it lies between the bounds the answers so far allow, else 0; the share of
guesses that use the feedback), solved and guesses (on the last).
"""

from __future__ import annotations

import random

from posttrain.envs.base import Step
from posttrain.rewards.arith import last_integer  # a turn's answer, read as the arith reward reads it


class AnswerWithHints:
    def __init__(self, tries: int = 3, discount: float = 0.5):
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        self.tries, self.discount = tries, discount

    def reset(self, row: dict) -> list[dict]:
        self.answer = int(str((row.get("reward_model") or {}).get("ground_truth")).strip())
        self.turn = 0
        return row["prompt"]

    def step(self, action: str) -> Step:
        self.turn += 1
        guess = last_integer(action)
        info = {"first_try": float(guess == self.answer)} if self.turn == 1 else {}
        if guess == self.answer:
            return Step([], self.discount ** (self.turn - 1), True, {**info, "solved": 1.0, "tries": self.turn})
        if self.turn >= self.tries:
            return Step([], 0.0, True, {**info, "solved": 0.0, "tries": self.turn})
        hint = "no number" if guess is None else ("higher" if guess < self.answer else "lower")
        return Step([{"role": "user", "content": hint}], 0.0, False, info)


class GuessTheNumber:
    def __init__(self, low: int = 1, high: int = 16, tries: int = 5):
        if high <= low or tries < 1:
            raise ValueError(f"need low < high and tries >= 1, got low={low}, high={high}, tries={tries}")
        self.low, self.high, self.tries = low, high, tries

    def reset(self, row: dict) -> list[dict]:
        truth = str((row.get("reward_model") or {}).get("ground_truth", "")).strip()
        if truth.lstrip("-").isdigit() and self.low <= int(truth) <= self.high:
            self.secret = int(truth)
        else:
            self.secret = random.Random(str(row.get("prompt"))).randint(self.low, self.high)
        self.turn, self.bounds = 0, (self.low, self.high)
        ask = (f"I am thinking of a number from {self.low} to {self.high}. Guess it: answer with one number, and I "
               f"will say higher or lower. You have {self.tries} guesses.")
        return [{"role": "user", "content": ask}]

    def step(self, action: str) -> Step:
        self.turn += 1
        guess = last_integer(action)
        lo, hi = self.bounds
        info = {"consistent": float(guess is not None and lo <= guess <= hi)}
        if guess == self.secret:
            return Step([], 1.0, True, {**info, "solved": 1.0, "guesses": self.turn})
        if self.turn >= self.tries:
            return Step([], 0.0, True, {**info, "solved": 0.0, "guesses": self.turn})
        if guess is None:
            return Step([{"role": "user", "content": "no number"}], 0.0, False, info)
        higher = guess < self.secret
        self.bounds = (max(lo, guess + 1), hi) if higher else (lo, min(hi, guess - 1))
        return Step([{"role": "user", "content": "higher" if higher else "lower"}], 0.0, False, info)
