"""The arith task (two-number addition) as parquet rows; the embedded default's data."""

from __future__ import annotations

from pathlib import Path

from posttrain.data import arith
from posttrain.data.schema import write_rows
from posttrain.errors import DataError


def make_row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": arith.DATA_SOURCE,
        "prompt": [{"role": "user", "content": arith.prompt_text(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": arith.answer_text(a, b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def run(output_dir: str | Path, num_train: int | None = None, num_test: int | None = None, seed: int = 0,
        min_value: int = 10, max_value: int = 99) -> list[Path]:
    """Train rows from the train pairs, test rows from the disjoint test
    pairs (None = all of them)."""
    train_pairs, test_pairs = arith.split_pairs(seed, min_value, max_value)
    written = []
    for split, pairs, wanted in (("train", train_pairs, num_train), ("test", test_pairs, num_test)):
        if wanted is not None and wanted > len(pairs):
            raise DataError(f"arith has only {len(pairs)} distinct {split} pairs for values {min_value}..{max_value}; "
                            f"ask for fewer rows or widen --max-value")
        chosen = pairs if wanted is None else pairs[:wanted]
        rows = [make_row(a, b, split, i) for i, (a, b) in enumerate(chosen)]
        written.append(write_rows(rows, Path(output_dir) / f"{split}.parquet"))
    return written
