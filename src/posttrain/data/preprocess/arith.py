"""The arith task (two-number addition) as parquet rows: the embedded default's data.

    run("data/arith", num_train=3, num_test=1)   # -> [data/arith/train.parquet, data/arith/test.parquet]

A row (train pair 23, 45 at index 0):

    {"data_source": "arith", "prompt": [{"role": "user", "content": "23+45="}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "68"},
     "extra_info": {"split": "train", "index": 0, "a": 23, "b": 45}}
"""

from __future__ import annotations

from pathlib import Path

from posttrain.data import arith
from posttrain.data.schema import write_rows
from posttrain.errors import DataError


def make_row(a: int, b: int, split: str, index: int, style: str = "symbols") -> dict:
    return {
        "data_source": arith.DATA_SOURCE,
        "prompt": [{"role": "user", "content": arith.prompt_text(a, b, style)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": arith.answer_text(a, b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def run(output_dir, num_train: int | None = None, num_test: int | None = None, seed: int = 0,
        min_value: int = 10, max_value: int = 99, style: str = "symbols") -> list[Path]:
    """Train rows from the train pairs, test rows from the disjoint held-out
    pairs of `arith.split_pairs` (None = every pair of that split; 0 = no
    file). `style` picks the prompt's wording (arith.PROMPT_STYLES). Each pair appears at most once: asking for more rows than there
    are distinct pairs is an error rather than silent repetition."""
    if style not in arith.PROMPT_STYLES:
        raise DataError(f"arith --style {style!r} is not one of {sorted(arith.PROMPT_STYLES)}")
    if min_value > max_value:
        raise DataError(f"arith --min-value {min_value} is above --max-value {max_value}; swap them")
    train_pairs, test_pairs = arith.split_pairs(seed, min_value, max_value)
    written = []
    for split, pairs, wanted in (("train", train_pairs, num_train), ("test", test_pairs, num_test)):
        if wanted is not None and wanted < 0:
            raise DataError(f"arith --num-{split} {wanted} is negative; give 0 or more rows")
        if wanted is not None and wanted > len(pairs):
            raise DataError(
                f"arith has only {len(pairs)} distinct {split} pairs for values {min_value}..{max_value}, "
                f"{wanted} asked; lower --num-{split} or widen --min-value/--max-value"
            )
        chosen = pairs if wanted is None else pairs[:wanted]
        if chosen:
            rows = [make_row(a, b, split, i, style) for i, (a, b) in enumerate(chosen)]
            written.append(write_rows(rows, Path(output_dir) / f"{split}.parquet"))
    return written
