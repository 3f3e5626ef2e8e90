"""The arith task: two-number addition, the embedded default's task.

One definition of the prompt and answer text, shared by the preprocessor
(RL data), the tiny model's supervised warm-up and the reward.

    >>> prompt_text(23, 45), answer_text(23, 45)
    ('23+45=', '68')
    >>> prompt_text(7, 12, style="question")
    'What is 7 + 12?'

The "symbols" style is the tiny model's (its byte tokenizer was warmed up on
it); "question" is how a chat model is asked, for real pretrained models.
"""

from __future__ import annotations

import random

DATA_SOURCE = "arith"


PROMPT_STYLES = {"symbols": "{a}+{b}=", "question": "What is {a} + {b}?"}


def prompt_text(a: int, b: int, style: str = "symbols") -> str:
    return PROMPT_STYLES[style].format(a=a, b=b)


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def split_pairs(
    seed: int, min_value: int = 10, max_value: int = 99, test_fraction: float = 0.2
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All (a, b) pairs with both operands in [min_value, max_value], shuffled
    by seed and split into disjoint (train, test) lists, so held-out prompts
    are never seen in training."""
    pairs = [(a, b) for a in range(min_value, max_value + 1) for b in range(min_value, max_value + 1)]
    random.Random(seed).shuffle(pairs)
    n_test = max(1, int(len(pairs) * test_fraction))
    return pairs[n_test:], pairs[:n_test]
