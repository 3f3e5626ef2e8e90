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

A row that does not fit (check_row says why: a null or non-string message
content, an empty message list, no ground truth, an extra_info that is not a
dict, text that is not valid unicode, ...) is skipped when read, and counted
in one warning line per file; a file with no usable row is a DataError.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import DataError
from posttrain.text.lines import invalid_text

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
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not all(isinstance(k, str) for k in row):
            raise DataError(f"row {i} for '{path}' is not a dict of named columns; pass dicts with string keys")
        bad = invalid_text(row, "")
        if bad:  # pyarrow would say only "surrogates not allowed", without the row
            raise DataError(f"row {i} for '{path}': {bad}; fix the text (e.g. decode it with errors='replace')")
    try:
        table = pa.Table.from_pydict(_columns(_no_empty_structs(rows)))
    except OverflowError as e:
        raise DataError(f"rows for '{path}' hold an integer too large for parquet's int64 ({_first_line(e)}); "
                        "store it as a string") from e
    except (pa.ArrowException, TypeError, ValueError) as e:
        # e.g. ground_truth a string in one row and a struct in another
        raise DataError(
            f"rows for '{path}' do not share one schema ({_first_line(e)}); "
            "give every row the same column types, or write separate files"
        ) from e
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except (pa.ArrowException, OSError) as e:
        # e.g. a nested empty dict: parquet has no struct without fields
        raise DataError(f"cannot write rows to '{path}' ({_first_line(e)}); give every nested dict at least "
                        "one key (or None instead), and check that the directory is writable") from e
    finally:
        with contextlib.suppress(OSError):  # e.g. the parent is a file: the error above says so
            tmp.unlink(missing_ok=True)
    return path


def _columns(rows: list[dict]) -> dict[str, list]:
    """Column -> values, over the keys of every row (pa.Table.from_pylist
    reads the keys of the first row only, and would drop the others' silently)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: [r.get(k) for r in rows] for k in keys}


def _no_empty_structs(rows: list[dict]) -> list[dict]:
    """Parquet cannot store a struct without fields: a column whose values are
    all empty dicts (e.g. extra_info={}) is written as nulls; read_rows turns
    a null extra_info back into {}."""
    empty = [k for k in dict.fromkeys(k for r in rows for k in r) if all(r.get(k) == {} for r in rows)]
    return [{**r, **{k: None for k in empty}} for r in rows] if empty else rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


class Rows(list):
    """What read_rows gives: the usable rows (a plain list of dicts), plus
    `indices`, each row's index in the files as read (concatenated, skipped
    rows counted), and `num_invalid`, the rows skipped. A slice keeps them.

        rows = read_rows("a.parquet")      # rows 0..4, row 2 unusable
        rows.indices, rows.num_invalid     # [0, 1, 3, 4], 1
        rows[:2].indices                   # [0, 1]
    """

    def __init__(self, rows=(), indices=None, num_invalid: int = 0):
        super().__init__(rows)
        self.indices = list(range(len(self))) if indices is None else list(indices)
        self.num_invalid = num_invalid

    def __getitem__(self, i):
        if isinstance(i, slice):  # build.load_data cuts rows[:max_samples]
            return Rows(super().__getitem__(i), self.indices[i], self.num_invalid)
        return super().__getitem__(i)


def read_rows(paths: str | Path | list, prompt_key: str = "prompt") -> Rows:
    """Rows of one or more parquet files, concatenated in the order given and
    checked against the layout above (`prompt_key` names the prompt column,
    as data.prompt_key does). Optional columns get their defaults. Rows that
    check_row refuses are skipped, with one warning line per file; a file
    without a usable row is a DataError.

        read_rows(["a.parquet", "b.parquet"]) -> [{"data_source": ..., "prompt": [...], ...}, ...]
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError(f"no data files given; {_FIX}")
    required = tuple(dict.fromkeys(c if c != "prompt" else prompt_key for c in REQUIRED_COLUMNS))
    rows = Rows()
    for path in paths:
        offset = len(rows.indices) + rows.num_invalid
        good, indices, skipped = _read_one(path, required, prompt_key)
        rows.extend(good)
        rows.indices.extend(offset + i for i in indices)
        rows.num_invalid += skipped
    return rows


def _read_one(path: Path, required: tuple[str, ...], prompt_key: str) -> tuple[list[dict], list[int], int]:
    """-> (usable rows, their row indices in the file, number skipped)."""
    if not path.exists():
        raise DataError(f"data file '{path}' does not exist; {_FIX}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"data file '{path}' is not a readable parquet file ({_first_line(e)}); {_FIX}") from e
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise DataError(
            f"data file '{path}' lacks column(s) {', '.join(missing)} (it has: {', '.join(table.column_names)}); "
            f"rows need {', '.join(required)} (see `posttrain preprocess`), or set data.prompt_key to the prompt column"
        )
    if table.num_rows == 0:
        raise DataError(f"data file '{path}' holds no rows; {_FIX}")
    good, indices, skipped = [], [], []
    for i, row in enumerate(_decoded_rows(table)):
        reason = row if isinstance(row, str) else check_row(row, prompt_key)
        if reason is not None:
            skipped.append((i, reason))
            continue
        row["ability"] = row.get("ability") or ""
        row["extra_info"] = row.get("extra_info") or {}
        good.append(row)
        indices.append(i)
    if not good:
        raise DataError(f"data file '{path}' has no usable row: {describe_skipped(skipped, table.num_rows)}; "
                        "fix the rows (see `posttrain preprocess`) or pick another file")
    if skipped:
        what = f"rows of '{path}'"
        print(f"posttrain: warning: {describe_skipped(skipped, table.num_rows, what)}; fix or drop them",
              file=sys.stderr)
    return good, indices, len(skipped)


def _decoded_rows(table: pa.Table) -> list:
    """The table's rows as dicts; a row pyarrow cannot turn into Python
    values (invalid UTF-8 in a string column, a timestamp out of range)
    becomes the reason, a str, so that it is skipped and not the whole file."""
    try:
        return table.to_pylist()
    except (pa.ArrowException, ValueError, OverflowError):
        pass
    out = []
    for i in range(table.num_rows):  # slow, but only for a file that has such a row
        try:
            out.append(table.slice(i, 1).to_pylist()[0])
        except (pa.ArrowException, ValueError, OverflowError) as e:
            kind = "invalid UTF-8 text" if isinstance(e, UnicodeDecodeError) else type(e).__name__
            out.append(f"cannot be decoded ({kind}: {_first_line(e)[:80]})")
    return out


def describe_skipped(skipped: list[tuple[int, str]], total: int, what: str = "rows", shown: int = 5) -> str:
    """One phrase for a warning or an error: how many rows were skipped and why (the first `shown`).

        describe_skipped([(4, "no data_source")], 120) -> "skipped 1 of 120 rows (row 4: no data_source)"
    """
    reasons = "; ".join(f"row {i}: {reason}" for i, reason in skipped[:shown])
    more = f"; and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return f"skipped {len(skipped)} of {total} {what} ({reasons}{more})"


def check_row(row, prompt_key: str = "prompt") -> str | None:
    """Why `row` cannot be trained on, or None when it can: the one place
    that decides. Rows read from parquet and rows given to
    PromptDataset.build both pass through it.

        check_row({"data_source": "arith", "prompt": [{"role": "user", "content": None}], ...})
            -> "prompt message 0 content is None, not a string"

    Refused: a data_source that is not a non-empty string; a prompt that is
    missing, blank, an empty list, or not a list of {role: str, content: str
    or a list of {type, ...} content parts} dicts with some non-blank content; a reward_model without ground_truth;
    an extra_info that is neither null nor a dict (skipped, not coerced: a
    reward function reads it, and {} in its place would change the reward
    silently); text that is not valid unicode (a lone surrogate such as
    '\\ud800' cannot be encoded to UTF-8, for the tokenizer or for parquet).
    Valid unicode of any kind (emoji, RTL marks, NUL, CJK) is fine.
    """
    if not isinstance(row, dict):
        return f"row is {_kind(row)}, not a dict of columns"
    source = row.get("data_source")
    if not isinstance(source, str) or not source.strip():
        return "data_source is empty" if isinstance(source, str) else f"data_source is {_kind(source)}, not a string"
    reason = _check_prompt(row.get(prompt_key), prompt_key)
    if reason:
        return reason
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        return f"reward_model is {_kind(reward_model)}, not a dict with a ground_truth"
    if reward_model.get("ground_truth") is None:
        return "no reward_model.ground_truth"
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        return f"extra_info is {_kind(extra_info)}, not a dict"
    return invalid_text({k: row.get(k) for k in ("data_source", prompt_key, "reward_model", "extra_info")}, "")


def _check_prompt(prompt, key: str) -> str | None:
    if isinstance(prompt, str):
        return f"{key} is blank" if not prompt.strip() else None
    if not isinstance(prompt, (list, tuple)):
        return f"{key} is {_kind(prompt)}, not a list of {{role, content}} messages or a string"
    if not prompt:
        return f"{key} is an empty list of messages"
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"{key} message {j} is {_kind(m)}, not a {{role, content}} dict"
        if not isinstance(m.get("role"), str):
            return f"{key} message {j} role is {_kind(m.get('role'))}, not a string"
        content = m.get("content")
        if isinstance(content, (list, tuple)):  # content parts (TRL's and the chat templates' multimodal layout)
            reason = _check_parts(content)
            if reason:
                return f"{key} message {j} {reason}"
        elif not isinstance(content, str):
            return f"{key} message {j} content is {_kind(content)}, not a string"
    if not any(_has_content(m["content"]) for m in prompt):
        return f"every {key} message is blank"
    return None


def _check_parts(parts) -> str | None:
    """Why a message's content parts ([{"type": "text", "text": ...}, {"type": "image"}, ...]) are unusable."""
    for k, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return f"content part {k} is {_kind(part)}, not a {{type, ...}} dict"
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return f"content part {k} text is {_kind(part.get('text'))}, not a string"
    return None


def _has_content(content) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] != "text" or p["text"].strip() for p in content)




def _kind(value) -> str:
    return "None" if value is None else type(value).__name__
