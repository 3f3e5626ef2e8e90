"""Rows for the number-guessing game (posttrain.envs.games:GuessTheNumber): one game a row, its secret the
row's ground truth; the environment asks the question itself, so a row's prompt is only a label.

    run("data/guess_number", num_train=10000, num_test=64, seed=0, low=1, high=16)

A row:

    {"data_source": "guess_number", "prompt": [{"role": "user", "content": "Guess the number: game 17"}],
     "ability": "game", "reward_model": {"style": "env", "ground_truth": "11"},
     "extra_info": {"split": "train", "index": 17}}

Train secrets are drawn uniformly (seeded); the test rows hold every secret from low to high in turn, so a
held-out score weighs each secret the same.
"""

from __future__ import annotations

import random
from pathlib import Path

from posttrain.data.schema import write_rows
from posttrain.errors import DataError

DATA_SOURCE = "guess_number"


def run(output_dir, num_train: int = 10000, num_test: int = 64, seed: int = 0, low: int = 1,
        high: int = 16) -> list[Path]:
    if num_train < 0 or num_test < 0:
        raise DataError(f"guess-number row counts must be >= 0, got --num-train {num_train} --num-test {num_test}")
    if high <= low:
        raise DataError(f"guess-number needs --low below --high, got --low {low} --high {high}")
    rng = random.Random(seed)
    secrets = {"train": [rng.randint(low, high) for _ in range(num_train)],
               "test": [low + i % (high - low + 1) for i in range(num_test)]}
    written = []
    for split, values in secrets.items():
        rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"Guess the number: game {i}"}],
                 "ability": "game", "reward_model": {"style": "env", "ground_truth": str(v)},
                 "extra_info": {"split": split, "index": i}} for i, v in enumerate(values)]
        if rows:
            path = Path(output_dir) / f"{split}.parquet"
            write_rows(rows, path)
            written.append(path)
    return written
