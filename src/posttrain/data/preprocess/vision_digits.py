"""The vision-digits task (data/vision_digits.py) as parquet rows in verl's layout, with their images.

    run("data/vision_digits", num_train=3, num_test=1)   # -> [.../train.parquet, .../test.parquet]

A row (train pair 23, 45 at index 0; the image shows 23, 56x28 pixels):

    {"data_source": "arith", "prompt": [{"role": "user", "content": "<image>+45="}], "ability": "math",
     "images": [{"bytes": b"\\x89PNG...", "path": None}],
     "reward_model": {"style": "rule", "ground_truth": "68"},
     "extra_info": {"split": "train", "index": 0, "a": 23, "b": 45}}
"""

from __future__ import annotations

from pathlib import Path

from posttrain.data import vision_digits
from posttrain.data.schema import write_rows
from posttrain.errors import DataError


def make_row(a: int, b: int, split: str, index: int, seed: int = 0) -> dict:
    return {
        "data_source": vision_digits.DATA_SOURCE,
        "prompt": [{"role": "user", "content": vision_digits.prompt_text(b)}],
        "ability": "math",
        "images": [{"bytes": vision_digits.number_png(a, seed, split, index), "path": None}],
        "reward_model": {"style": "rule", "ground_truth": vision_digits.answer_text(a, b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def run(output_dir, num_train: int | None = 2000, num_test: int | None = 200, seed: int = 0) -> list[Path]:
    """Train rows from arith's train pairs, test rows from its disjoint held-out pairs (operands 10..99; None =
    every pair of that split, 0 = no file). `seed` shuffles the pairs and draws the images."""
    train_pairs, test_pairs = vision_digits.split_pairs(seed)
    written = []
    for split, pairs, wanted in (("train", train_pairs, num_train), ("test", test_pairs, num_test)):
        if wanted is not None and not 0 <= wanted <= len(pairs):
            raise DataError(f"vision-digits --num-{split} {wanted}: give 0 to {len(pairs)} rows (the distinct "
                            f"{split} pairs)")
        chosen = pairs if wanted is None else pairs[:wanted]
        if chosen:
            rows = [make_row(a, b, split, i, seed) for i, (a, b) in enumerate(chosen)]
            written.append(write_rows(rows, Path(output_dir) / f"{split}.parquet"))
    return written
