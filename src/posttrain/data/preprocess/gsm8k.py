"""GSM8K: the original jsonl (or parquet) files -> train/test parquet rows with
the same content as verl's GSM8K preprocessing, so runs are comparable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq

from posttrain.data.schema import write_rows
from posttrain.errors import DataError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(solution: str) -> str:
    """The number after `####`, commas removed: '#### 1,234' -> '1234'."""
    m = _ANSWER.search(solution)
    if m is None:
        raise DataError(f"GSM8K answer has no '#### <number>' line: {solution[-80:]!r}")
    return m.group(1).replace(",", "")


def make_row(question: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def _read_split(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path, columns=["question", "answer"]).to_pylist()
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def find_splits(input_path: str | Path) -> dict[str, list[Path]]:
    """{'train': [...], 'test': [...]} from a directory (train*.jsonl/parquet,
    test*.jsonl/parquet, also in a `main/` subfolder as on the Hub) or one file
    (its split taken from its name)."""
    p = Path(input_path)
    if not p.exists():
        raise DataError(f"GSM8K input '{p}' does not exist; pass the directory holding train.jsonl and test.jsonl")
    files = [p] if p.is_file() else sorted(
        f for f in list(p.glob("*")) + list(p.glob("main/*")) if f.suffix in (".jsonl", ".parquet"))
    splits: dict[str, list[Path]] = {}
    for f in files:
        for split in ("train", "test"):
            if f.name.startswith(split):
                splits.setdefault(split, []).append(f)
    if not splits:
        raise DataError(f"no GSM8K train*/test* .jsonl or .parquet files found in '{p}'")
    return splits


def run(input_path: str | Path, output_dir: str | Path) -> list[Path]:
    written = []
    for split, files in find_splits(input_path).items():
        rows = [r for f in files for r in _read_split(f)]
        out = [make_row(r["question"], r["answer"], split, i) for i, r in enumerate(rows)]
        written.append(write_rows(out, Path(output_dir) / f"{split}.parquet"))
    return written
