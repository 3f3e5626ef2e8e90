"""What the image datasets' preprocessors share: finding the Hub's parquet
files and their splits, and images as verl's rows carry them.

    find_parquet(["raw/geometry3k/data"], "geometry3k", HOW)
        -> [(Path(".../train-00000-of-00001.parquet"), "train"), (..."validation-..."), "validation"), ...]
    image_entry({"bytes": b"\\x89PNG...", "path": "1.png"}, "geometry3k row 0")
        -> {"bytes": b"\\x89PNG...", "path": "1.png"}

An image is kept as the Hub stores it, a {"bytes", "path"} struct (the
`datasets` library's Image column), bytes unchanged: the model's processor
decodes them, so nothing here needs an image library. The prompt marks
where each image goes with IMAGE, verl's `<image>` placeholder, one per image.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import DataError
from posttrain.text.lines import invalid_text

IMAGE = "<image>"  # verl's placeholder: the prompt's Nth one is the row's Nth image
# an images column's type: the Hub's Image struct, path a string even when every path of the first batch is null
IMAGES_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
SPLITS = ("train", "validation", "test", "testA", "testB", "val", "valA", "valB")


def split_of(path: Path) -> str | None:
    """The split a Hub file's name gives: `train-00000-of-00027.parquet` -> "train",
    `validation-00000-of-00001.parquet` -> "validation"; None for another name."""
    head = re.split(r"[-_.]", path.name, maxsplit=1)[0]
    return head if head in SPLITS else None


def find_parquet(inputs, what: str, how: str) -> list[tuple[Path, str | None]]:
    """(file, its split or None) for every .parquet file of the inputs: files,
    or folders searched recursively (hidden ones, such as a download's .cache/, skipped)."""
    found = []
    for p in (Path(x) for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])):
        if not p.exists():
            raise DataError(f"{what} input '{p}' does not exist; {how}")
        if p.is_file():
            if p.suffix != ".parquet":
                raise DataError(f"{what} input '{p}' is not a .parquet file; {how}")
            found.append(p)
            continue
        files = sorted(f for f in p.rglob("*.parquet")
                       if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise DataError(f"no .parquet files under '{p}'; {how}")
        found.extend(files)
    return [(f, split_of(f)) for f in found]


def read_table(path: Path, columns: tuple[str, ...], what: str, how: str) -> list[dict]:
    """The rows of one parquet file, the named columns at least, as dicts."""
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{what} file '{path}' is not a readable parquet file ({str(e).splitlines()[0][:120]}); "
                        f"{how}") from e
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(f"{what} file '{path}' lacks column(s) {', '.join(missing)} (it has: {', '.join(names)}); "
                        f"{how}")
    return pq.read_table(path).to_pylist()


def image_entry(value, where: str) -> dict:
    """One image as verl's rows hold it, {"bytes": ..., "path": ...}, from the
    Hub's struct (or bare bytes); a DataError naming the row for anything else."""
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value), "path": None}
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)) and value["bytes"]:
        path = value.get("path")
        return {"bytes": bytes(value["bytes"]), "path": path if isinstance(path, str) else None}
    raise DataError(f"{where}: its image is {type(value).__name__} without bytes, not the Hub's {{bytes, path}} "
                    "struct; download the dataset's parquet files (hf download ... --repo-type dataset), which "
                    "embed the images")


def write_batches(batches: Iterable[list[dict]], path) -> Path:
    """Write rows batch by batch (one batch per input file) to one parquet file,
    so a set of many GB (CLEVR's 70K images) is never whole in memory; atomic
    as schema.write_rows. Every batch must have the first one's columns and types.

        write_batches(rows_of_each_file(), "data/clevr-cogent/train.parquet") -> Path(...)
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer, total = None, 0
    try:
        for batch in batches:
            if not batch:
                continue
            for i, row in enumerate(batch):
                bad = invalid_text(row, "")
                if bad:
                    raise DataError(f"row {total + i} for '{path}': {bad}; fix the text")
            if writer is None:
                schema = pa.Table.from_pylist(batch).schema
                if "images" in schema.names:
                    schema = schema.set(schema.get_field_index("images"), pa.field("images", IMAGES_TYPE))
                path.parent.mkdir(parents=True, exist_ok=True)
                writer = pq.ParquetWriter(tmp, schema)
            try:
                table = pa.Table.from_pylist(batch, schema=writer.schema)
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise DataError(f"rows {total}.. for '{path}' differ from the first rows' columns "
                                f"({str(e).splitlines()[0][:160]}); the input files do not share one layout") from e
            writer.write_table(table)
            total += len(batch)
        if writer is None:
            raise DataError(f"no rows to write to '{path}'; the inputs hold none")
        writer.close()
        writer = None
        os.replace(tmp, path)
    finally:
        if writer is not None:
            writer.close()
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return path


__all__ = ["IMAGE", "IMAGES_TYPE", "find_parquet", "image_entry", "read_table", "split_of", "write_batches"]
