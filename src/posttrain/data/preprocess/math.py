"""MATH-style problems (MATH / lighteval, MATH-500, DeepScaleR, the original
MATH tarball) -> train/test parquet rows in verl's layout, as verl's
examples/data_preprocess/math_dataset.py writes them.

    run(["data/MATH"], "data/math")   # -> [data/math/train.parquet, data/math/test.parquet]

One input row {"problem": "P", "solution": "... \\\\boxed{\\\\frac{1}{2}}", "level": "Level 2",
"type": "Algebra"} at index 5 of the train split becomes

    {"data_source": "DigitalLearningGmbH/MATH-lighteval",
     "prompt": [{"role": "user", "content": "P " + INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "\\\\frac{1}{2}"},
     "extra_info": {"split": "train", "index": 5, "problem": "P", "solution": "... \\\\boxed{...}",
                    "level": "Level 2", "subject": "Algebra"}}

extra_info keeps the problem, the reference solution, the level, the
subject (MATH's `type`, MATH-500's `subject`) and MATH-500's `unique_id`
where the input has them. The ground truth is the row's `answer` when it
has one (MATH-500, DeepScaleR), else the content of the last \\boxed{} (or
\\fbox{}) of its `solution`; a row with neither is skipped and counted.

Inputs: .jsonl, .json (a list of rows, or one row per file as in the MATH
tarball) and .parquet files, or directories of them (searched recursively;
hidden files and folders such as a download's .cache/ are not read). A
file's split is read from its path below the input given: `train` or
`test` as a word of a file or folder name (MATH's `train/algebra/1.json`,
the Hub's `data/train-00000-of-00001.parquet`, MATH-500's `test.jsonl`);
a file named neither gives `<its stem>.parquet` (DeepScaleR's
`deepscaler.json` -> deepscaler.parquet). Rows of one split are numbered
from 0 in file order.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.data.schema import write_rows
from posttrain.errors import DataError
from posttrain.rewards.math import last_boxed

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"  # verl's name: its reward routing and ours agree
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SUFFIXES = (".jsonl", ".json", ".parquet")
_HOW = ("pass MATH-style files (.jsonl, .json or .parquet rows with 'problem' and 'solution' holding a "
        "\\boxed{} answer, or 'problem' and 'answer'), or directories of them")


def split_of(path: Path, root: Path) -> str:
    """'train' or 'test' when a word of the file's name or of a folder below
    `root` (the input given) says so, else the file's stem."""
    parts = path.relative_to(root).parts if root != path else (path.name,)
    for part in reversed(parts):
        words = re.split(r"[^a-z]+", part.lower())
        for split in ("train", "test"):
            if split in words:
                return split
    return path.stem


def find_files(inputs) -> list[tuple[Path, Path]]:
    """-> (file, the input it came from) for every data file of the inputs."""
    files = []
    for p in (Path(x) for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])):
        if not p.exists():
            raise DataError(f"MATH input '{p}' does not exist; {_HOW}")
        if p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"MATH input '{p}' is not a .jsonl, .json or .parquet file; {_HOW}")
            files.append((p, p))
        else:
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise DataError(f"no .jsonl, .json or .parquet files under '{p}'; {_HOW}")
            files.extend((f, p) for f in found)
    return files


def read_file(path: Path) -> list[dict]:
    """The rows of one file, as dicts."""
    try:
        if path.suffix == ".parquet":
            rows = pq.read_table(path).to_pylist()
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
            rows = data if isinstance(data, list) else [data]
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"MATH file '{path}' is unreadable ({str(e).splitlines()[0][:120]}); {_HOW}") from e
    # the shape is checked by field names; a row whose values are missing or
    # hold no answer is skipped (and counted) by run()
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "problem" not in row:
            raise DataError(f"MATH file '{path}' row {i} has no 'problem' field; {_HOW}")
        if "answer" not in row and "solution" not in row:
            raise DataError(f"MATH file '{path}' row {i} has neither an 'answer' nor a 'solution' field; {_HOW}")
    return rows


def ground_truth(row: dict) -> str | None:
    """The row's `answer` (a string, or a number as AIME sets give it), else
    its solution's last boxed answer, else None."""
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    solution = row.get("solution")
    found = last_boxed(solution) if isinstance(solution, str) else None
    return found or None


def make_row(row: dict, truth: str, split: str, index: int, data_source: str) -> dict:
    extra = {"split": split, "index": index, "problem": row["problem"]}
    if isinstance(row.get("solution"), str):
        extra["solution"] = row["solution"]
    for ours, theirs in (("level", "level"), ("subject", "type"), ("subject", "subject"), ("unique_id", "unique_id")):
        if row.get(theirs) is not None:
            extra[ours] = str(row[theirs])
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": row["problem"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


def run(inputs, output_dir, data_source: str = DATA_SOURCE) -> list[Path]:
    """Write output_dir/<split>.parquet for each split found; -> their paths.
    Rows are numbered from 0 within a split, in file order. Prints how many
    rows had no answer to recover (skipped)."""
    by_split: dict[str, list[dict]] = {}
    skipped: dict[str, int] = {}
    for f, root in find_files(inputs):
        split = split_of(f, root)
        for row in read_file(f):
            truth = ground_truth(row)
            if truth is None or not isinstance(row["problem"], str) or not row["problem"].strip():
                skipped[split] = skipped.get(split, 0) + 1
                continue
            rows = by_split.setdefault(split, [])
            rows.append(make_row(row, truth, split, len(rows), data_source))
    for split, count in skipped.items():
        print(f"skipped {count} {split} row{'s' if count > 1 else ''} without an answer (an 'answer', or a "
              f"\\boxed{{}} in the 'solution') or without 'problem' text")
    if not by_split:
        names = ", ".join(map(str, inputs if isinstance(inputs, (list, tuple)) else [inputs]))
        raise DataError(f"no MATH rows with an answer in {names}; {_HOW}")
    order = sorted(by_split, key=lambda s: ({"train": 0, "test": 1}.get(s, 2), s))
    return [write_rows(by_split[s], Path(output_dir) / f"{s}.parquet") for s in order]
