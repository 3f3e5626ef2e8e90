"""Geometry3K (the Hub's hiyouga/geometry3k: columns images, problem, answer)
-> parquet rows with images, as verl's examples/data_preprocess/geo3k.py
writes them, or as NeMo-RL's geometry3k recipes prompt them.

    run(["raw/geometry3k/data"], "data/geo3k")   # -> [.../train.parquet, .../validation.parquet, .../test.parquet]

One Hub row {"images": [{"bytes": PNG, "path": None}], "problem": "<image>Find x.", "answer": "3"}
at index 5 of the train split becomes (style "verl")

    {"data_source": "hiyouga/geometry3k",
     "prompt": [{"role": "user", "content": "<image>Find x. " + INSTRUCTION}],
     "images": [{"bytes": PNG, "path": None}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"split": "train", "index": 5, "answer": "3", "question": "<image>Find x."}}

scored by verl's geo3k reward (a `<think>` block, then the answer in
`\\boxed{}`). The Hub's problems start with verl's `<image>` placeholder
already; verl adds none, nor does this. Style "nemo-rl" (the named dataset
geometry3k) writes NeMo-RL's rows instead: data_source "geometry3k" (NeMo-RL's
task name, scored by its 0.1 format + 0.9 math_expr weights in rewards.vlm),
the first image only, and the prompt of its examples/prompts/geo3k.txt
(`<think>`, then `<answer>`) around the problem without its placeholder, the
image first, as NeMo-RL puts it:

    "prompt": [{"role": "user", "content": "<image>" + NEMO_RL_PROMPT.format("Find x.")}],
    "extra_info": {"split": "train", "index": 5, "answer": "3", "problem": "Find x."}

Both keep the images' bytes unchanged. A file's split is read from its Hub
name (train-*, validation-*, test-*); `split` puts every row in <split>.parquet.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.data.preprocess.vision import IMAGE, find_parquet, image_entry, read_table
from posttrain.data.schema import write_rows
from posttrain.errors import DataError

DATA_SOURCE = "hiyouga/geometry3k"  # verl's name, and its reward's
NEMO_RL_DATA_SOURCE = "geometry3k"  # NeMo-RL's task name (its env.geometry3k)
# verl's sentence, appended after one space
INSTRUCTION = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
               "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
               "BE put in \\boxed{}.")
# NeMo-RL's examples/prompts/geo3k.txt: a str.format template, its {} the problem
NEMO_RL_PROMPT = ("Think step-by-step to solve the following math problem, and answer in the following format: "
                  "<think> step-by-step thought process </think> <answer> only answer here </answer>.\n"
                  "Note that your final answer must only contain a number or mathematical expression \n\n"
                  "Let's think step-by-step: \n{}\n")
STYLES = ("verl", "nemo-rl")
COLUMNS = ("images", "problem", "answer")
_HOW = ("pass the Hub dataset hiyouga/geometry3k's parquet files (its data/ folder: train-*, validation-*, "
        "test-*.parquet, with columns images, problem, answer) or folders of them")


def make_row(raw: dict, split: str, index: int, style: str = "verl", where: str = "") -> dict:
    problem, answer = raw.get("problem"), raw.get("answer")
    if not isinstance(problem, str) or not problem.strip() or answer is None or not str(answer).strip():
        raise DataError(f"{where or 'geometry3k row'} has no problem or no answer; {_HOW}")
    answer = str(answer)
    images = raw.get("images")
    images = [image_entry(im, where) for im in (images if isinstance(images, list) else [images])]
    if style == "verl":
        return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
                "images": images, "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": problem}}
    text = problem.replace(IMAGE, "")  # NeMo-RL drops the placeholder and puts its one image first
    return {"data_source": NEMO_RL_DATA_SOURCE,
            "prompt": [{"role": "user", "content": IMAGE + NEMO_RL_PROMPT.format(text)}],
            "images": images[:1], "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "answer": answer, "problem": text}}


def run(inputs, output_dir, style: str = "verl", split: str | None = None) -> list[Path]:
    """Write output_dir/<split>.parquet for each split found; -> their paths.
    Rows are numbered from 0 within a split, in file order."""
    if style not in STYLES:
        raise DataError(f"geo3k style {style!r} is not one of {', '.join(STYLES)}; pick verl (verl's rows and "
                        "reward) or nemo-rl (NeMo-RL's geometry3k prompt and reward)")
    by_split: dict[str, list[dict]] = {}
    for f, found in find_parquet(inputs, "geometry3k", _HOW):
        name = split or found
        if name is None:
            raise DataError(f"cannot tell the split of geometry3k file '{f}'; name it train-*, validation-* or "
                            "test-*.parquet as the Hub does, or pass --split NAME")
        rows = by_split.setdefault(name, [])
        for i, raw in enumerate(read_table(f, COLUMNS, "geometry3k", _HOW)):
            rows.append(make_row(raw, name, len(rows), style, f"geometry3k file '{f}' row {i}"))
    order = sorted(by_split, key=lambda s: ({"train": 0, "validation": 1, "test": 2}.get(s, 3), s))
    return [write_rows(by_split[s], Path(output_dir) / f"{s}.parquet") for s in order]
