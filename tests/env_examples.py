"""Environments for the tests (tests/test_envs.py): a guessing game that answers "higher" / "lower", and one
that misbehaves on request (the model's turn says how)."""

import os
import time

from posttrain.envs import Step


class GuessTheNumber:
    """The secret is the row's ground truth; a right guess ends the game with reward 1, a wrong one gets a hint."""

    def __init__(self, penalty: float = 0.0):
        self.penalty = penalty
        self.closed = False

    def reset(self, row):
        self.secret = int(row["reward_model"]["ground_truth"])
        return row["prompt"]

    def step(self, action):
        text = action.strip()
        if text == str(self.secret):
            return Step([], reward=1.0, done=True, info={"guesses_right": 1})
        hint = "higher" if text.isdigit() and int(text) < self.secret else "lower"
        return hint, self.penalty, False, {"guesses_right": 0}  # gym's tuple, a string observation

    def close(self):
        self.closed = True


class Misbehaving:
    """step(action): 'raise' raises, 'hang' sleeps, 'spin' loops in Python, 'crash' kills its process, 'hog'
    allocates 4 GB, 'nan' returns a NaN reward, 'junk' a malformed observation; anything else ends with reward 1."""

    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        if action == "raise":
            raise RuntimeError("the environment broke")
        if action == "hang":
            time.sleep(600)
        if action == "spin":
            while True:
                pass
        if action == "crash":
            os._exit(3)
        if action == "hog":
            return Step([{"role": "user", "content": str(len(bytearray(4 * 2**30)))}])
        if action == "nan":
            return Step([], float("nan"), True)
        if action == "junk":
            return Step([{"role": "narrator", "content": 1}])
        return Step([], 1.0, True)
