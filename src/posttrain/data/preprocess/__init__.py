"""`posttrain preprocess NAME`: write a dataset as parquet rows in verl's layout.

    posttrain preprocess gsm8k --input ../shared/data/gsm8k --output-dir data/gsm8k
    posttrain preprocess arith --output-dir data/arith --num-train 2000 --num-test 200
    posttrain preprocess arith --output-dir data/add15 --min-value 1 --max-value 15 --style question
    posttrain preprocess countdown --output-dir data/countdown --num-train 10000 --num-test 500
    posttrain preprocess math --input data/MATH --output-dir data/math
    posttrain preprocess products --output-dir data/products   # a * b with the calculator tool (multi-turn)
    posttrain preprocess sliding-puzzle --output-dir data/sliding_puzzle   # seeds of the sliding-puzzle game
    posttrain preprocess guess-number --output-dir data/guess_number       # secrets of the number-guessing game
    posttrain preprocess vision-digits --output-dir data/vision_digits     # 23 in an image, +45= in the text
    posttrain preprocess math --input raw/aime2024/data --split test --output-dir data/aime2024
    posttrain preprocess geo3k --input raw/geometry3k/data --output-dir data/geo3k   # verl's rows, with images
    posttrain preprocess clevr --train raw/clevr/data --test raw/clevr/valA/data --output-dir data/clevr-cogent
    posttrain preprocess refcoco --input raw/refcoco/data --images-dir raw/refcoco --output-dir data/refcoco

`register(subparsers)` adds these sub-commands; each sets `func(args) -> 0`,
which writes the files and prints one line per file with its row count.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq


def _report(paths: list[Path]) -> int:
    for p in paths:
        print(f"wrote {p} ({pq.read_metadata(p).num_rows} rows)")
    return 0


def _gsm8k(args) -> int:
    from posttrain.data.preprocess import gsm8k

    return _report(gsm8k.run(args.input, args.output_dir))


def _math(args) -> int:
    from posttrain.data.preprocess import math

    if args.sft is not None:
        return _report(math.run_sft(args.input, args.output_dir, args.sft, args.split, args.problem_key))
    return _report(math.run(args.input, args.output_dir, args.data_source, args.split, args.problem_key))


def _geo3k(args) -> int:
    from posttrain.data.preprocess import geo3k

    return _report(geo3k.run(args.input, args.output_dir, args.style, args.split))


def _clevr(args) -> int:
    from posttrain.data.preprocess import clevr

    return _report(clevr.run(args.train or (), args.test or (), args.output_dir))


def _refcoco(args) -> int:
    from posttrain.data.preprocess import refcoco

    return _report(refcoco.run(args.input, args.images_dir, args.output_dir, args.size, args.seed))


def _arith(args) -> int:
    from posttrain.data.preprocess import arith

    return _report(arith.run(args.output_dir, args.num_train, args.num_test, args.seed, args.min_value,
                             args.max_value, args.style))


def _countdown(args) -> int:
    from posttrain.data.preprocess import countdown

    return _report(countdown.run(args.output_dir, args.num_train, args.num_test, args.seed,
                                 (args.min_operands, args.max_operands), args.max_number, args.max_target,
                                 args.min_number))


def _sliding_puzzle(args) -> int:
    from posttrain.data.preprocess import sliding_puzzle

    return _report(sliding_puzzle.run(args.output_dir, args.num_train, args.num_test, args.seed))


def _guess_number(args) -> int:
    from posttrain.data.preprocess import guess_number

    return _report(guess_number.run(args.output_dir, args.num_train, args.num_test, args.seed, args.low, args.high))


def _products(args) -> int:
    from posttrain.data.preprocess import products

    return _report(products.run(args.output_dir, args.num_train, args.num_test, args.seed, args.digits,
                                not args.no_system_prompt))


def _vision_digits(args) -> int:
    from posttrain.data.preprocess import vision_digits

    return _report(vision_digits.run(args.output_dir, args.num_train, args.num_test, args.seed))


def _generated(subparsers, name: str, help: str, num_train: int, num_test: int):
    """A generated dataset's sub-command with the arguments they all take: where, how many rows, the seed."""
    p = subparsers.add_parser(name, help=help)
    p.add_argument("--output-dir", required=True, help="writes train.parquet and test.parquet here")
    p.add_argument("--num-train", type=int, default=num_train)
    p.add_argument("--num-test", type=int, default=num_test)
    p.add_argument("--seed", type=int, default=0)
    return p


def register(subparsers) -> None:
    """Add one sub-command per preprocessor to an argparse subparsers object."""
    g = subparsers.add_parser("gsm8k", help="GSM8K jsonl/parquet -> train/test parquet (verl's row content)")
    g.add_argument("--input", required=True, nargs="+", metavar="FILE_OR_DIR",
                   help="directory with train.jsonl/test.jsonl (or the Hub's main/train-*.parquet), or such files")
    g.add_argument("--output-dir", required=True, help="writes train.parquet and test.parquet here")
    g.set_defaults(func=_gsm8k)

    m = subparsers.add_parser("math", help="MATH / MATH-500 / DeepScaleR / AIME / OpenMathInstruct-2 / NuminaMath / "
                                           "OpenR1-Math problems with \\boxed{} answers")
    m.add_argument("--input", required=True, nargs="+", metavar="FILE_OR_DIR",
                   help=".jsonl/.json/.parquet files or directories; train/test is read from the names")
    m.add_argument("--output-dir", required=True, help="writes train.parquet, test.parquet (or <name>.parquet) here")
    m.add_argument("--data-source", default="DigitalLearningGmbH/MATH-lighteval",
                   help="the rows' data_source (default: verl's MATH name, scored by the math reward)")
    m.add_argument("--split", default=None, metavar="NAME",
                   help="write every row to NAME.parquet (e.g. test for AIME, whose Hub file is named train), "
                        "instead of the split read from each file's path")
    m.add_argument("--problem-key", default="problem", metavar="COLUMN",
                   help="the column that holds the problem (default: problem; AIME2025's is question)")
    m.add_argument("--sft", default=None, metavar="COLUMN",
                   help="write SFT rows instead, for posttrain sft: problem, the response COLUMN and "
                        "expected_answer, to sft_<split>.parquet (OpenMathInstruct-2's: generated_solution)")
    m.set_defaults(func=_math)

    g3 = subparsers.add_parser("geo3k", help="Geometry3K (hiyouga/geometry3k's parquet files, with images) as verl's "
                                             "geo3k rows, or NeMo-RL's geometry3k rows (--style nemo-rl)")
    g3.add_argument("--input", required=True, nargs="+", metavar="FILE_OR_DIR",
                    help="the Hub's train-*/validation-*/test-*.parquet files, or their folder")
    g3.add_argument("--output-dir", required=True, help="writes train.parquet, validation.parquet, test.parquet here")
    g3.add_argument("--style", default="verl", choices=["verl", "nemo-rl"],
                    help="verl: data_source hiyouga/geometry3k, verl's \\boxed{} instruction and reward (default); "
                         "nemo-rl: data_source geometry3k, NeMo-RL's <think>/<answer> prompt and reward")
    g3.add_argument("--split", default=None, metavar="NAME", help="write every row to NAME.parquet")
    g3.set_defaults(func=_geo3k)

    cl = subparsers.add_parser("clevr", help="CLEVR-CoGenT (NeMo-RL's clevr-cogent: MMInstruction/Clevr_CoGenT_* "
                                             "parquet files, with images)")
    cl.add_argument("--train", nargs="+", metavar="FILE_OR_DIR",
                    help="Clevr_CoGenT_TrainA_70K_Complex's parquet files, or their folder -> train.parquet")
    cl.add_argument("--test", nargs="+", metavar="FILE_OR_DIR",
                    help="Clevr_CoGenT_ValA's (or ValB's) parquet files, or their folder -> test.parquet")
    cl.add_argument("--output-dir", required=True)
    cl.set_defaults(func=_clevr)

    rc = subparsers.add_parser("refcoco", help="RefCOCO (NeMo-RL's refcoco: jxu124/refcoco's parquet files and "
                                               "COCO's train2014 images; needs Pillow)")
    rc.add_argument("--input", required=True, nargs="+", metavar="FILE_OR_DIR",
                    help="the Hub's train-*/validation-*/test-*.parquet files, or their folder")
    rc.add_argument("--images-dir", required=True, metavar="DIR",
                    help="the folder holding train2014/ (what the rows' image_path calls coco/)")
    rc.add_argument("--output-dir", required=True, help="writes <split>.parquet here, one per split found")
    rc.add_argument("--size", type=int, default=256, help="images are resized to SIZE x SIZE (NeMo-RL's 256)")
    rc.add_argument("--seed", type=int, default=0, help="draws each training row's caption")
    rc.set_defaults(func=_refcoco)

    ar = subparsers.add_parser("arith", help="two-number addition (the embedded default task)")
    ar.add_argument("--output-dir", required=True, help="writes train.parquet and test.parquet here")
    ar.add_argument("--num-train", type=int, default=None, help="rows (default: every train pair)")
    ar.add_argument("--num-test", type=int, default=None, help="rows (default: every held-out pair)")
    ar.add_argument("--seed", type=int, default=0, help="shuffles the pairs before the train/test split")
    ar.add_argument("--min-value", type=int, default=10, help="smallest operand (default 10)")
    ar.add_argument("--max-value", type=int, default=99, help="largest operand (default 99)")
    ar.add_argument("--style", default="symbols", choices=["symbols", "question"],
                    help="prompt wording: 23+45= (symbols, the tiny model's) or 'What is 23 + 45?' (question, "
                         "for a chat model)")
    ar.set_defaults(func=_arith)

    pr = _generated(subparsers, "products", "a * b of 3-digit numbers, with the calculator tool described "
                                            "(a multi-turn task: rollout.multi_turn.tools=[calculator])", 2000, 100)
    pr.add_argument("--digits", type=int, default=3, help="digits of each operand (default 3)")
    pr.add_argument("--no-system-prompt", action="store_true",
                    help="leave out the system message that describes the calculator (a chat template with tool "
                         "support describes it from the tools themselves)")
    pr.set_defaults(func=_products)

    c = _generated(subparsers, "countdown", "Countdown: reach a target with given numbers (TinyZero's task)", 10000,
                   500)
    c.add_argument("--min-operands", type=int, default=3, help="fewest numbers per instance (default 3)")
    c.add_argument("--max-operands", type=int, default=4, help="most numbers per instance (default 4)")
    c.add_argument("--min-number", type=int, default=1)
    c.add_argument("--max-number", type=int, default=99)
    c.add_argument("--max-target", type=int, default=1000, help="targets are whole numbers in 1..this")
    c.set_defaults(func=_countdown)

    _generated(subparsers, "sliding-puzzle", "seeds of puzzles for the sliding-puzzle environment "
               "(posttrain.envs.sliding_puzzle; NeMo-RL's game)", 10000, 64).set_defaults(func=_sliding_puzzle)

    gn = _generated(subparsers, "guess-number", "secrets for the number-guessing game "
                    "(posttrain.envs.games:GuessTheNumber)", 10000, 64)
    gn.add_argument("--low", type=int, default=1, help="smallest secret (default 1; the game's low)")
    gn.add_argument("--high", type=int, default=16, help="largest secret (default 16; the game's high)")
    gn.set_defaults(func=_guess_number)

    _generated(subparsers, "vision-digits", "the arith task with its first number drawn in a 56x28 image (the tiny "
               "vision model's task; needs Pillow)", 2000, 200).set_defaults(func=_vision_digits)


__all__ = ["register"]
