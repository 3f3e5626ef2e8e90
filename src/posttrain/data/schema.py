"""The parquet row layout, as verl writes it, so existing datasets work:

    data_source   str                       picks the reward function
    prompt        list[{role, content}]     chat messages
    ability       str                       free-form tag (optional)
    reward_model  {style, ground_truth}     ground_truth: a string, or a struct (countdown)
    extra_info    dict                      anything (optional)
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import DataError

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
_FIX = "check data.train_files / data.val_files, or make the file with `posttrain preprocess NAME --output-dir DIR`"


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows to parquet atomically (a temp name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.Table.from_pylist(_no_empty_structs(rows)), tmp)
    os.replace(tmp, path)
    return path


def _no_empty_structs(rows: list[dict]) -> list[dict]:
    """Parquet cannot store a struct without fields: a column whose values are
    all empty dicts (e.g. extra_info={}) is written as nulls, read back as {}."""
    empty = [k for k in (rows[0] if rows else {}) if all(r.get(k) == {} for r in rows)]
    return [{**r, **{k: None for k in empty}} for r in rows] if empty else rows


def read_rows(paths: str | Path | list) -> list[dict]:
    """Rows of one or more parquet files, checked against the schema."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows: list[dict] = []
    for path in map(Path, paths):
        if not path.exists():
            raise DataError(f"data file '{path}' does not exist; {_FIX}")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"data file '{path}' is not a readable parquet file ({str(e).splitlines()[0]}); {_FIX}") from e
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise DataError(
                f"data file '{path}' lacks column(s) {', '.join(missing)} (it has: {', '.join(table.column_names)}); "
                f"rows need data_source, prompt (chat messages) and reward_model.ground_truth; {_FIX}"
            )
        for i, row in enumerate(table.to_pylist()):
            reward_model = row.get("reward_model") or {}
            if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
                raise DataError(f"data file '{path}' row {i} has no reward_model.ground_truth; {_FIX}")
            row.setdefault("ability", "")
            row["extra_info"] = row.get("extra_info") or {}
            rows.append(row)
    return rows
