"""Rows for the sliding-puzzle environment (posttrain.envs.sliding_puzzle): one puzzle a row, named by its seed;
the environment draws the puzzle from the seed and shows the board itself, so a row's prompt is only a label.

    run("data/sliding_puzzle", num_train=10000, num_test=64, seed=0)

A row:

    {"data_source": "sliding_puzzle", "prompt": [{"role": "user", "content": "Sliding puzzle 17"}],
     "ability": "game", "reward_model": {"style": "env", "ground_truth": ""},
     "extra_info": {"split": "train", "index": 17, "seed": 17}}

Train seeds are seed*10**6 + index, test seeds the same plus 500_000: the splits never share a puzzle seed.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.data.schema import write_rows
from posttrain.errors import DataError

DATA_SOURCE = "sliding_puzzle"


def run(output_dir, num_train: int = 10000, num_test: int = 64, seed: int = 0) -> list[Path]:
    if num_train < 0 or num_test < 0 or num_train + num_test > 500_000:
        raise DataError(f"sliding-puzzle row counts must be >= 0 and at most 500000 together, got --num-train "
                        f"{num_train} --num-test {num_test}")
    written = []
    for split, count, offset in (("train", num_train, 0), ("test", num_test, 500_000)):
        rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"Sliding puzzle {i}"}],
                 "ability": "game", "reward_model": {"style": "env", "ground_truth": ""},
                 "extra_info": {"split": split, "index": i, "seed": seed * 10**6 + offset + i}}
                for i in range(count)]
        if rows:
            path = Path(output_dir) / f"{split}.parquet"
            write_rows(rows, path)
            written.append(path)
    return written
