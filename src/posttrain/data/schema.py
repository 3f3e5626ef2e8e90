"""The parquet row layout, as verl writes it, so existing datasets work:

    data_source   str                       picks the reward function
    prompt        list[{role, content}]     chat messages
    ability       str                       free-form tag (optional, default "")
    reward_model  {style, ground_truth}     ground_truth: a string (gsm8k, arith),
                                            or a struct (countdown: {target, numbers})
    extra_info    dict                      anything (optional, default {})

One row, as the gsm8k preprocessor writes it:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Janet's ducks lay 16 eggs ... Let's think step by step ..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "18"},
     "extra_info": {"split": "test", "index": 0, "answer": "...#### 18", "question": "Janet's ducks ..."}}
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import DataError

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
_FIX = (
    "check data.train_files / data.val_files, or make the file with "
    "`posttrain preprocess gsm8k|math|arith|countdown ... --output-dir DIR`"
)


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows (dicts of the layout above) to one parquet file, creating
    parent directories. Atomic: a reader never sees half a file, because the
    table goes to a temporary name in the same directory and is then renamed.

        write_rows([{"data_source": "arith", ...}], "data/train.parquet") -> Path("data/train.parquet")
    """
    path = Path(path)
    if not rows:
        raise DataError(f"no rows to write to '{path}'; ask the preprocessor for at least one row")
    try:
        table = pa.Table.from_pylist(_no_empty_structs(rows))
    except (pa.ArrowException, TypeError, ValueError) as e:
        # e.g. ground_truth a string in one row and a struct in another
        raise DataError(
            f"rows for '{path}' do not share one schema ({_first_line(e)}); "
            "give every row the same column types, or write separate files"
        ) from e
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _no_empty_structs(rows: list[dict]) -> list[dict]:
    """Parquet cannot store a struct without fields: a column whose values are
    all empty dicts (e.g. extra_info={}) is written as nulls; read_rows turns
    a null extra_info back into {}."""
    empty = [k for k in rows[0] if all(r.get(k) == {} for r in rows)]
    return [{**r, **{k: None for k in empty}} for r in rows] if empty else rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def read_rows(paths: str | Path | list, prompt_key: str = "prompt") -> list[dict]:
    """Rows of one or more parquet files, concatenated in the order given and
    checked against the layout above (`prompt_key` names the prompt column,
    as data.prompt_key does). Optional columns get their defaults.

        read_rows(["a.parquet", "b.parquet"]) -> [{"data_source": ..., "prompt": [...], ...}, ...]
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError(f"no data files given; {_FIX}")
    required = tuple(dict.fromkeys(c if c != "prompt" else prompt_key for c in REQUIRED_COLUMNS))
    rows: list[dict] = []
    for path in paths:
        rows.extend(_read_one(path, required))
    return rows


def _read_one(path: Path, required: tuple[str, ...]) -> list[dict]:
    if not path.exists():
        raise DataError(f"data file '{path}' does not exist; {_FIX}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data file '{path}' is not a readable parquet file ({_first_line(e)}); {_FIX}") from e
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise DataError(
            f"data file '{path}' lacks column(s) {', '.join(missing)} (it has: {', '.join(table.column_names)}); "
            f"rows need {', '.join(required)} (see `posttrain preprocess`), or set data.prompt_key to the prompt column"
        )
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise DataError(
                f"data file '{path}' row {i} has no reward_model.ground_truth; "
                "give every row reward_model={'style': 'rule', 'ground_truth': ...} or drop the row"
            )
        row["ability"] = row.get("ability") or ""
        row["extra_info"] = row.get("extra_info") or {}
    return rows
