"""GSM8K: the original jsonl (or Hugging Face parquet) files -> train/test
parquet rows with the same content as verl's examples/data_preprocess/gsm8k.py,
so runs and scores are comparable with verl's.

    run("../shared/data/gsm8k", "data/gsm8k")   # -> [data/gsm8k/train.parquet, data/gsm8k/test.parquet]

One input line {"question": "Q", "answer": "...\\n#### 1,234"} at index 5 of
train.jsonl becomes

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Q " + INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "1234"},
     "extra_info": {"split": "train", "index": 5, "answer": "...\\n#### 1,234", "question": "Q"}}
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.data.schema import write_rows
from posttrain.errors import DataError

DATA_SOURCE = "openai/gsm8k"
# verl's instruction sentence, appended after one space; its reward looks for "#### <number>"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# verl takes the first "#### <number>" of the reference answer and drops its commas
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
SPLITS = ("train", "test")
_SUFFIXES = (".jsonl", ".parquet")
_HOW = "pass the GSM8K directory (train.jsonl and test.jsonl, or the Hub's main/train-*.parquet) or those files"


def extract_answer(solution: str) -> str:
    """The number after the first `####`, commas removed: '... #### 1,234' -> '1234'."""
    m = _ANSWER.search(solution)
    if m is None:
        raise DataError(f"GSM8K answer has no '#### <number>' line ({solution[-60:]!r}); is this GSM8K's 'main' data?")
    return m.group(1).replace(",", "")


def make_row(question: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_split_file(path: Path) -> list[dict]:
    """[{question, answer}, ...] from one .jsonl or .parquet file."""
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path, columns=["question", "answer"]).to_pylist()
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"GSM8K file '{path}' is unreadable or lacks question/answer ({str(e)[:120]}); {_HOW}") from e
    for i, r in enumerate(rows):
        if not (isinstance(r, dict) and isinstance(r.get("question"), str) and isinstance(r.get("answer"), str)):
            raise DataError(f"GSM8K file '{path}' line {i + 1} is not {{\"question\": str, \"answer\": str}}; {_HOW}")
    return rows


def _split_of(f: Path, strict: bool) -> str | None:
    """'train' / 'test' from a file name, else None. In a directory only
    train.jsonl, train.parquet and shards like train-00000-of-00001.parquet
    count (strict), so GSM8K's train_socratic.jsonl beside them is not mixed in;
    a file named by the user needs only to start with the split's name."""
    if f.suffix not in _SUFFIXES:
        return None
    for s in SPLITS:
        if (f.stem == s or f.stem.startswith(s + "-")) if strict else f.name.startswith(s):
            return s
    return None


def find_splits(input_path) -> dict[str, list[Path]]:
    """{'train': [...], 'test': [...]} from a directory (train/test .jsonl or
    .parquet, also in a `main/` subfolder as on the Hub), one file or a list
    of files (each file's split read from its name)."""
    inputs = [Path(p) for p in (input_path if isinstance(input_path, (list, tuple)) else [input_path])]
    splits: dict[str, list[Path]] = {}
    for p in inputs:
        if not p.exists():
            raise DataError(f"GSM8K input '{p}' does not exist; {_HOW}")
        if p.is_file():
            split = _split_of(p, strict=False)
            if split is None:
                raise DataError(f"cannot tell the split of GSM8K file '{p}'; name it train*.jsonl|parquet "
                                "or test*.jsonl|parquet")
            splits.setdefault(split, []).append(p)
            continue
        for f in sorted(f for f in [*p.glob("*"), *p.glob("main/*")] if f.is_file()):
            split = _split_of(f, strict=True)
            if split is not None:
                splits.setdefault(split, []).append(f)
    if not splits:
        raise DataError(f"no GSM8K train/test .jsonl or .parquet files in {', '.join(map(str, inputs))}; {_HOW}")
    return {s: splits[s] for s in SPLITS if s in splits}


def run(input_path, output_dir) -> list[Path]:
    """Write output_dir/{train,test}.parquet (each split found in the input)
    and return their paths. Rows are numbered from 0 within a split, in file
    order, as verl's `index`."""
    written = []
    for split, files in find_splits(input_path).items():
        raw = [r for f in files for r in read_split_file(f)]
        rows = [make_row(r["question"], r["answer"], split, i) for i, r in enumerate(raw)]
        written.append(write_rows(rows, Path(output_dir) / f"{split}.parquet"))
    return written
