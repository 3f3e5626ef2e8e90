"""CLEVR-CoGenT, as NeMo-RL's clevr-cogent dataset reads it, -> parquet rows
with images in verl's layout. NeMo-RL trains on the Hub dataset
MMInstruction/Clevr_CoGenT_TrainA_70K_Complex and validates on
MMInstruction/Clevr_CoGenT_ValA (or ValB); each holds columns image,
problem and solution (`<answer> 3 </answer>`), in files all named train-*.

    run(train=["raw/clevr-cogent/data"], test=["raw/clevr-cogent/valA/data"], output_dir="data/clevr-cogent")
    # -> [data/clevr-cogent/train.parquet, data/clevr-cogent/test.parquet]

One Hub row {"image": {"bytes": PNG, "path": None}, "problem": "How many cubes are there?",
"solution": "<answer> 3 </answer>"} at index 5 of the training files becomes

    {"data_source": "clevr-cogent",
     "prompt": [{"role": "user", "content": "<image>" + PROMPT.format("How many cubes are there?")}],
     "images": [{"bytes": PNG, "path": None}],
     "ability": "visual_reasoning",
     "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"split": "train", "index": 5, "problem": "How many cubes are there?",
                    "solution": "<answer> 3 </answer>"}}

As NeMo-RL: the ground truth is the solution's text inside its first
`<answer>...</answer>` on one line, stripped (the whole solution, stripped,
when there is none); the image comes first, then the text of NeMo-RL's
examples/prompts/clevr_cogent_cot.txt around the problem (a `<think>` block,
then the answer in `<answer>` tags). data_source "clevr-cogent" is NeMo-RL's
task name: rewards.vlm scores it with its 0.2 format + 0.8 exact_alnum weights.
The image's bytes are kept unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.data.preprocess.vision import IMAGE, find_parquet, image_entry, read_table, write_batches
from posttrain.errors import DataError

DATA_SOURCE = "clevr-cogent"
# NeMo-RL's examples/prompts/clevr_cogent_cot.txt: a str.format template, its {} the problem
PROMPT = ("Think step-by-step to solve the following problem, and answer in the following format: <think> "
          "step-by-step thought process </think> <answer> final answer </answer>\nNote that your final answer must "
          "only contain a single numerical output (e.g. 2, 12, 45) for numerical solutions, and only the strings "
          "\"yes\" or \"no\" for yes/no type questions.\n\nLet's think step-by-step: \n{}\n")
COLUMNS = ("image", "problem", "solution")
_ANSWER = re.compile(r"<answer>(.*?)</answer>")  # NeMo-RL's: the first one, within a line
_HOW = ("pass the parquet files (or their folders) of the Hub datasets MMInstruction/Clevr_CoGenT_TrainA_70K_Complex "
        "as --train and MMInstruction/Clevr_CoGenT_ValA (or ValB) as --test; their columns: image, problem, solution")


def answer_of(solution: str) -> str:
    """'<answer> 3 </answer>' -> '3'; a solution without the tags, stripped."""
    m = _ANSWER.search(solution)
    return (m.group(1) if m else solution).strip()


def make_row(raw: dict, split: str, index: int, where: str = "") -> dict:
    problem, solution = raw.get("problem"), raw.get("solution")
    if problem is None or not str(problem).strip() or solution is None or not answer_of(str(solution)):
        raise DataError(f"{where or 'CLEVR row'} has no problem or no answer in its solution; {_HOW}")
    problem, solution = str(problem), str(solution)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": IMAGE + PROMPT.format(problem)}],
        "images": [image_entry(raw.get("image"), where)],
        "ability": "visual_reasoning",
        "reward_model": {"style": "rule", "ground_truth": answer_of(solution)},
        "extra_info": {"split": split, "index": index, "problem": problem, "solution": solution},
    }


def run(train=(), test=(), output_dir=".") -> list[Path]:
    """Write output_dir/train.parquet from `train`'s files and output_dir/test.parquet
    from `test`'s (at least one of the two given); -> their paths."""
    if not train and not test:
        raise DataError(f"no CLEVR input; {_HOW}")
    written = []
    for split, inputs in (("train", train), ("test", test)):
        if inputs:
            files = [f for f, _ in find_parquet(inputs, "CLEVR", _HOW)]  # all checked before any is read
            written.append(write_batches(_batches(files, split), Path(output_dir) / f"{split}.parquet"))
    return written


def _batches(files: list[Path], split: str):
    """One list of rows per input file (the train set is ~9 GB of images: never whole in memory)."""
    index = 0
    for f in files:
        batch = []
        for i, raw in enumerate(read_table(f, COLUMNS, "CLEVR", _HOW)):
            batch.append(make_row(raw, split, index, f"CLEVR file '{f}' row {i}"))
            index += 1
        yield batch
