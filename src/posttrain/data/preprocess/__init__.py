"""`posttrain preprocess NAME`: write datasets as parquet rows."""

from __future__ import annotations


import pyarrow.parquet as pq


def _report(paths) -> int:
    for p in paths:
        print(f"wrote {p} ({pq.read_metadata(p).num_rows} rows)")
    return 0


def register(subparsers) -> None:
    """Add one sub-command per preprocessor to an argparse subparsers object."""
    from posttrain.data.preprocess import arith, countdown, gsm8k

    g = subparsers.add_parser("gsm8k", help="GSM8K jsonl/parquet -> train/test parquet (verl's row content)")
    g.add_argument("--input", required=True, help="directory (or file) of GSM8K train*/test* .jsonl or .parquet")
    g.add_argument("--output-dir", required=True)
    g.set_defaults(func=lambda a: _report(gsm8k.run(a.input, a.output_dir)))

    ar = subparsers.add_parser("arith", help="two-number addition (the embedded default task)")
    ar.add_argument("--output-dir", required=True)
    ar.add_argument("--num-train", type=int, default=None, help="default: every train pair")
    ar.add_argument("--num-test", type=int, default=None, help="default: every held-out pair")
    ar.add_argument("--seed", type=int, default=0)
    ar.add_argument("--min-value", type=int, default=10)
    ar.add_argument("--max-value", type=int, default=99)
    ar.set_defaults(func=lambda a: _report(arith.run(a.output_dir, a.num_train, a.num_test, a.seed,
                                                     a.min_value, a.max_value)))

    c = subparsers.add_parser("countdown", help="Countdown: reach a target with given numbers (TinyZero's task)")
    c.add_argument("--output-dir", required=True)
    c.add_argument("--num-train", type=int, default=10000)
    c.add_argument("--num-test", type=int, default=500)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--min-operands", type=int, default=3)
    c.add_argument("--max-operands", type=int, default=4)
    c.add_argument("--max-number", type=int, default=99)
    c.set_defaults(func=lambda a: _report(countdown.run(a.output_dir, a.num_train, a.num_test, a.seed,
                                                        a.min_operands, a.max_operands, a.max_number)))


__all__ = ["register"]
