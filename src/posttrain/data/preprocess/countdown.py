"""Countdown, the task TinyZero trains on: reach a target with the given
numbers, each used exactly once, with + - * / and parentheses.

Every generated instance is solvable: the target is the value of a random
expression over the numbers (a random binary tree of random operations),
kept when it is a whole number in 1..max_target. Rows have TinyZero's
layout; the prompt asks what TinyZero's asks (in our own words) as one user
message, and the model's chat template adds the assistant turn.

    run("data/countdown", num_train=1000, num_test=100, seed=0)

A row:

    {"data_source": "countdown",
     "prompt": [{"role": "user", "content": "Using the numbers [44, 19, 35], create an equation that equals 98. ..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": {"target": 98, "numbers": [44, 19, 35]}},
     "extra_info": {"split": "train", "index": 0}}
"""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path

from posttrain.data.schema import write_rows
from posttrain.errors import DataError

DATA_SOURCE = "countdown"
_MAX_TRIES = 10_000  # per instance; a target range that is hard to hit gives up with a message


def prompt_text(numbers: list[int], target: int) -> str:
    # the reward reads the last <answer>...</answer> of the response's last line
    return (
        f"Using the numbers {numbers}, create an equation that equals {target}. You can use +, -, * and / "
        "and parentheses, and each number must be used exactly once. Think it through inside <think> </think> "
        "tags, then end with the equation alone inside <answer> </answer> tags on the last line, "
        "for example <answer> (1 + 2) / 3 </answer>."
    )


def random_instance(rng: random.Random, num_operands: int, max_number: int = 99, max_target: int = 1000,
                    min_number: int = 1) -> tuple[list[int], int, str]:
    """-> (numbers, target, expression) with `expression` over exactly
    `numbers` evaluating to the integer target in 1..max_target.

        random_instance(random.Random(0), 3, 99)  # -> ([75, 28, 65], 168, '(28 + 75) + 65')
    """
    for _ in range(_MAX_TRIES):
        numbers = [rng.randint(min_number, max_number) for _ in range(num_operands)]
        terms = [(Fraction(n), str(n)) for n in numbers]
        while len(terms) > 1:
            # two random terms, not the last two: every tree shape can come up
            i, j = sorted(rng.sample(range(len(terms)), 2), reverse=True)
            (y, ey), (x, ex) = terms.pop(i), terms.pop(j)
            if rng.random() < 0.5:
                (x, ex), (y, ey) = (y, ey), (x, ex)
            op = rng.choice("+-*/")
            if op == "/" and y == 0:
                op = "+"
            value = {"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else None}[op]
            terms.append((value, f"({ex} {op} {ey})"))
        value, expr = terms[0]
        if value.denominator == 1 and 1 <= value <= max_target:
            return numbers, int(value), expr[1:-1] if num_operands > 1 else expr
    raise DataError(
        f"found no countdown instance with {num_operands} numbers in {min_number}..{max_number} and a target "
        f"in 1..{max_target} after {_MAX_TRIES} tries; widen --max-number or --max-target"
    )


def make_row(numbers: list[int], target: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt_text(numbers, target)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
        "extra_info": {"split": split, "index": index},
    }


def _operand_range(num_operands) -> tuple[int, int]:
    lo, hi = (num_operands, num_operands) if isinstance(num_operands, int) else tuple(num_operands)
    if not 2 <= lo <= hi:
        raise DataError(f"countdown num_operands={num_operands} must be 2 or more (lo <= hi); e.g. 3 4")
    return lo, hi


def run(output_dir, num_train: int = 10000, num_test: int = 500, seed: int = 0,
        num_operands: int | tuple[int, int] = (3, 4), max_number: int = 99, max_target: int = 1000,
        min_number: int = 1) -> list[Path]:
    """Write output_dir/{train,test}.parquet (a split of 0 rows is not
    written) and return the paths. Each instance has between num_operands[0]
    and num_operands[1] numbers (inclusive). Each split has an RNG of its own
    drawn from the seed, so the test set does not change with num_train; a
    test instance equal to a train one (same numbers and target) is redrawn."""
    lo, hi = _operand_range(num_operands)
    if not 1 <= min_number <= max_number:
        raise DataError(f"countdown numbers range {min_number}..{max_number} is empty; use 1 <= min <= max")
    if num_train < 0 or num_test < 0:
        raise DataError(f"countdown row counts must be >= 0, got --num-train {num_train} --num-test {num_test}")
    seen: set[tuple] = set()
    written = []
    for split, count in (("train", num_train), ("test", num_test)):
        rng = random.Random(f"countdown-{split}-{seed}")  # str seeds are hashed stably across processes
        rows, redrawn = [], 0
        while len(rows) < count:
            numbers, target, _ = random_instance(rng, rng.randint(lo, hi), max_number, max_target, min_number)
            key = (tuple(sorted(numbers)), target)
            if split == "test" and key in seen:
                redrawn += 1
                if redrawn > _MAX_TRIES:
                    raise DataError(f"too few distinct countdown instances to keep {count} test rows apart from "
                                    "the train rows; widen --max-number or lower --num-test")
                continue
            if split == "train":
                seen.add(key)
            rows.append(make_row(numbers, target, split, len(rows)))
        if rows:
            written.append(write_rows(rows, Path(output_dir) / f"{split}.parquet"))
    return written
