"""Products of two numbers (3-digit by default), a task where a tool is the way to the answer: the
prompt tells the model about the calculator tool and how to call it (hermes format); the reward
(rewards/products.py) is the arith rule (the last integer of the final answer is the product) and
also reports whether a tool call returned the product (`tool_correct`).

    run("data/products", num_train=2, num_test=1)   # -> [data/products/train.parquet, .../test.parquet]

A row (train pair 347, 829 at index 0):

    {"data_source": "products",
     "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 347 * 829?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "287663"},
     "extra_info": {"split": "train", "index": 0, "a": 347, "b": 829}}

Train with rollout.multi_turn.enable=true rollout.multi_turn.tools=[calculator]; evaluate with
`posttrain eval ... --tools calculator`.
"""

from __future__ import annotations

import random
from pathlib import Path

from posttrain.data.schema import write_rows
from posttrain.errors import DataError

DATA_SOURCE = "products"  # scored by rewards/products.py

SYSTEM = ("You can use a calculator. To use it, write exactly\n"
          '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
          "and stop; its result comes back in the next message. Then answer with the number alone.")


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def tool_call(a: int, b: int) -> str:
    """The call that answers question(a, b), in the system prompt's (hermes) format."""
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%d * %d"}}</tool_call>' % (a, b)


def make_row(a: int, b: int, split: str, index: int, system: bool = True) -> dict:
    messages = ([{"role": "system", "content": SYSTEM}] if system else []) + [
        {"role": "user", "content": question(a, b)}]
    return {"data_source": DATA_SOURCE, "prompt": messages, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "a": a, "b": b}}


def split_pairs(num_train: int = 2000, num_test: int = 100, seed: int = 0, digits: int = 3
                ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, test): distinct (a, b) pairs of `digits`-digit numbers, seeded; no test pair is in train."""
    if digits < 1 or digits > 9:
        raise DataError(f"products --digits {digits} must be in 1..9")
    if num_train < 0 or num_test < 0:
        raise DataError("products --num-train / --num-test must be >= 0")
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    available = (high - low + 1) ** 2
    if num_train + num_test > available:
        raise DataError(f"products has only {available} distinct {digits}-digit pairs, {num_train + num_test} "
                        "asked; lower --num-train/--num-test or raise --digits")
    rng, pairs = random.Random(seed), []
    seen: set = set()
    while len(pairs) < num_train + num_test:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs[:num_train], pairs[num_train:]


def run(output_dir, num_train: int = 2000, num_test: int = 100, seed: int = 0, digits: int = 3,
        system: bool = True) -> list[Path]:
    """Write train.parquet and test.parquet of split_pairs(...)."""
    written = []
    for split, chosen in zip(("train", "test"), split_pairs(num_train, num_test, seed, digits)):
        if chosen:
            rows = [make_row(a, b, split, i, system) for i, (a, b) in enumerate(chosen)]
            written.append(write_rows(rows, Path(output_dir) / f"{split}.parquet"))
    return written
