"""RefCOCO, as NeMo-RL's refcoco dataset reads it, -> parquet rows with images
in verl's layout: find the region a phrase describes, answered as a box.
NeMo-RL reads the Hub dataset jxu124/refcoco (columns image_path, captions,
bbox [x1, y1, x2, y2] in pixels, split; files data/train-*, validation-*,
test-*, testB-*.parquet) and the COCO train2014 images its image_path names
(`coco/train2014/COCO_train2014_000000581857.jpg`: `coco/` is the images folder).

    run(["raw/refcoco/data"], "raw/refcoco", "data/refcoco")
    # -> [data/refcoco/train.parquet, data/refcoco/validation.parquet, ...]

One Hub row {"image_path": "coco/train2014/X.jpg", "captions": ["man left", "guy on the left in blue"],
"bbox": [64.0, 120.0, 320.0, 480.0], "split": "val"} of a 640x480 image becomes

    {"data_source": "refcoco",
     "prompt": [{"role": "user", "content": "<image>" + PROMPT.format(ASK + "guy on the left in blue")}],
     "images": [{"bytes": <the image, 256x256, as PNG>, "path": "coco/train2014/X.jpg"}],
     "ability": "grounding",
     "reward_model": {"style": "rule", "ground_truth": "[100, 250, 500, 1000]"},
     "extra_info": {"split": "validation", "index": 0, "problem": ASK + "guy on the left in blue",
                    "caption": "guy on the left in blue", "image_path": "coco/train2014/X.jpg"}}

As NeMo-RL: the image resized to 256x256 (`size`) and stored as PNG; the box
scaled to 0..1000 of the original width and height and rounded to integers,
written `[x1, y1, x2, y2]`, the ground truth rewards.vlm's bbox_giou compares
the answer's box with (data_source "refcoco", NeMo-RL's task name: 0.1 format
+ 0.9 bbox_giou); the phrase is the longest caption for a row whose split says
"val", else one caption drawn at random. NeMo-RL draws it each time the row is
used; here it is drawn once per row, seeded (`seed`). The prompt is NeMo-RL's
examples/prompts/refcoco.txt (a `<think>` block, then the box in `<answer>`
tags) around its question, the image first.

Reading JPEGs and resizing needs Pillow (`pip install pillow`); posttrain does
not depend on it, and only this preprocessor uses it.
"""

from __future__ import annotations

import io
import random
from functools import lru_cache
from pathlib import Path

from posttrain.data.preprocess.vision import IMAGE, find_parquet, read_table, write_batches
from posttrain.errors import DataError

DATA_SOURCE = "refcoco"
ASK = "Please provide the bounding box coordinate of the region described by the following phrase: "
# NeMo-RL's examples/prompts/refcoco.txt: a str.format template, its {} the question
PROMPT = ("Think step-by-step to solve the following problem, and answer in the following format: <think> "
          "step-by-step thought process </think> <answer> [x1, y1, x2, y2] </answer> \nYour answer must contain a "
          "bounding box with the following format: [x1, y1, x2, y2] where x1, y1 are the top left coordinates, and "
          "x2, y2 are the bottom right coordinates. The coordinates should be normalized from [0, 1000].\n\n"
          "Let's think step-by-step: \n{}\n")
COLUMNS = ("image_path", "captions", "bbox")
BATCH = 512  # rows per write: a PNG each, so the train split (42K rows) is never whole in memory
_HOW = ("pass the Hub dataset jxu124/refcoco's parquet files (its data/ folder) as --input and, as --images-dir, "
        "the folder holding COCO's train2014/ images (unzip http://images.cocodataset.org/zips/train2014.zip there)")


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("posttrain preprocess refcoco reads COCO's JPEGs and resizes them with Pillow, which is not "
                        "installed; pip install pillow") from None
    return Image


@lru_cache(maxsize=64)  # rows of one image often follow each other
def load_image(path: str, size: int) -> tuple[bytes, tuple[int, int]]:
    """(the image resized to size x size, as PNG bytes; its original (width, height))."""
    image_mod = _pil()
    try:
        with image_mod.open(path) as im:
            original = im.size
            small = im.resize((size, size))
    except (OSError, ValueError) as e:
        raise DataError(f"RefCOCO image '{path}' cannot be read ({type(e).__name__}: {str(e)[:100]}); "
                        f"{_HOW}") from None
    if small.mode not in ("RGB", "RGBA", "L"):  # e.g. a CMYK JPEG, which PNG cannot hold
        small = small.convert("RGB")
    out = io.BytesIO()
    small.save(out, format="PNG")
    return out.getvalue(), original


def box_of(bbox, width: int, height: int) -> str:
    """Pixels [x1, y1, x2, y2] -> '[x1, y1, x2, y2]' in 0..1000 of the image's width and height.

        box_of([64, 120, 320, 480], 640, 480) -> "[100, 250, 500, 1000]"
    """
    scaled = [bbox[0] / width * 1000, bbox[1] / height * 1000, bbox[2] / width * 1000, bbox[3] / height * 1000]
    return "[" + ", ".join(str(int(round(v))) for v in scaled) + "]"


def caption_of(captions: list[str], split: str, rng: random.Random) -> str:
    """The longest caption for a validation row (NeMo-RL's "descriptive"), else a random one."""
    return max(captions, key=len) if "val" in split else rng.choice(captions)


def make_row(raw: dict, split: str, index: int, images_dir: Path, size: int, rng: random.Random,
             where: str = "") -> dict:
    captions = [c for c in (raw.get("captions") or []) if isinstance(c, str) and c.strip()]
    bbox, image_path = raw.get("bbox"), raw.get("image_path")
    if not captions or not isinstance(image_path, str) or not (isinstance(bbox, list) and len(bbox) == 4):
        raise DataError(f"{where or 'RefCOCO row'} lacks captions, an image_path or a four-number bbox; {_HOW}")
    local = images_dir / (image_path[len("coco/"):] if image_path.startswith("coco/") else image_path)
    if not local.is_file():
        raise DataError(f"{where}: no image {local}; {_HOW}")
    png, (width, height) = load_image(str(local), size)
    caption = caption_of(captions, str(raw.get("split") or split), rng)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": IMAGE + PROMPT.format(ASK + caption)}],
        "images": [{"bytes": png, "path": image_path}],
        "ability": "grounding",
        "reward_model": {"style": "rule", "ground_truth": box_of(bbox, width, height)},
        "extra_info": {"split": split, "index": index, "problem": ASK + caption, "caption": caption,
                       "image_path": image_path},
    }


def run(inputs, images_dir, output_dir, size: int = 256, seed: int = 0) -> list[Path]:
    """Write output_dir/<split>.parquet for each split of the inputs (train,
    validation, test, testB, by the Hub's file names); -> their paths."""
    if size < 1:
        raise DataError(f"refcoco image size {size} must be at least 1 (NeMo-RL's: 256)")
    images_dir = Path(images_dir)
    if not images_dir.is_dir():
        raise DataError(f"RefCOCO images folder '{images_dir}' does not exist; {_HOW}")
    by_split: dict[str, list[Path]] = {}
    for f, split in find_parquet(inputs, "RefCOCO", _HOW):
        if split is None:
            raise DataError(f"cannot tell the split of RefCOCO file '{f}'; name it train-*, validation-*, test-* or "
                            "testB-*.parquet as the Hub does")
        by_split.setdefault(split, []).append(f)
    rng = random.Random(seed)
    order = sorted(by_split, key=lambda s: ({"train": 0, "validation": 1}.get(s, 2), s))
    return [write_batches(_batches(by_split[s], s, images_dir, size, rng), Path(output_dir) / f"{s}.parquet")
            for s in order]


def _batches(files: list[Path], split: str, images_dir: Path, size: int, rng: random.Random):
    index, batch = 0, []
    for f in files:
        for i, raw in enumerate(read_table(f, COLUMNS, "RefCOCO", _HOW)):
            batch.append(make_row(raw, split, index, images_dir, size, rng, f"RefCOCO file '{f}' row {i}"))
            index += 1
            if len(batch) == BATCH:
                yield batch
                batch = []
    yield batch
