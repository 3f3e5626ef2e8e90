"""Countdown (as TinyZero defines it): reach a target with the given numbers,
each used exactly once, with + - * /. Every generated instance is solvable:
the target is the value of a random expression over the numbers."""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path

from posttrain.data.schema import write_rows

DATA_SOURCE = "countdown"


def prompt_text(numbers: list[int], target: int) -> str:
    return (
        f"Using the numbers {numbers}, create an equation that equals {target}. You may use +, -, * and / "
        "and each number exactly once. Think inside <think> </think> tags, then give only the equation "
        "inside <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
    )


def random_instance(rng: random.Random, num_operands: int, max_number: int, max_target: int = 1000):
    """-> (numbers, target, expression) with an integer target in 1..max_target."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(num_operands)]
        terms = [(Fraction(n), str(n)) for n in numbers]
        rng.shuffle(terms)
        while len(terms) > 1:
            (x, ex), (y, ey) = terms.pop(), terms.pop()
            op = rng.choice("+-*/")
            if op == "/" and y == 0:
                op = "+"
            value = {"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else None}[op]
            terms.append((value, f"({ex} {op} {ey})"))
        value, expr = terms[0]
        if value.denominator == 1 and 1 <= value <= max_target:
            return numbers, int(value), expr[1:-1]


def make_row(numbers, target, split, index) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt_text(numbers, target)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
        "extra_info": {"split": split, "index": index},
    }


def run(output_dir: str | Path, num_train: int = 10000, num_test: int = 500, seed: int = 0,
        min_operands: int = 3, max_operands: int = 4, max_number: int = 99) -> list[Path]:
    rng = random.Random(seed)
    written = []
    for split, count in (("train", num_train), ("test", num_test)):
        rows = []
        for i in range(count):
            numbers, target, _ = random_instance(rng, rng.randint(min_operands, max_operands), max_number)
            rows.append(make_row(numbers, target, split, i))
        written.append(write_rows(rows, Path(output_dir) / f"{split}.parquet"))
    return written
