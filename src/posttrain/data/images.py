"""A prompt's images: read from a row as stored, decoded, placed in the chat messages, and turned into the token ids
and tensors a vision-language model takes. The processor (models/processor.py's load_processor) is passed in.

    row = {"prompt": [{"role": "user", "content": "<image>What colour is this?"}],
           "images": [{"bytes": png_bytes, "path": None}], ...}
    images = row_images(row, "images")                     # [{"bytes": ..., "path": None}], undecoded
    with_image_parts(row["prompt"], 1, "train row 0")
    # -> [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    ids = encode_vision_prompt(processor, row["prompt"], images, None)   # the image placeholder expanded
    tensors = vision_inputs(processor, images, "train row 0")          # Qwen2.5-VL: pixel_values, image_grid_thw

Two row layouts are read. verl's: a list under data.image_key (default "images"), each item {"bytes": b, "path": p},
raw bytes, a path or a PIL image, and one `<image>` in the prompt's text where each image goes, in order. TRL's: an
`image` column (one image) or an `images` column, and no placeholder: the images go before the text of the first
user message. Relative paths are read from the working directory, as verl reads them (the rows do not say which
file they came from, and a path must mean the same in the data step and in the rollout).
"""

from __future__ import annotations

import base64
import functools
import io
import re
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.errors import DataError
from posttrain.text.lines import one_line

if TYPE_CHECKING:
    from PIL import Image

PLACEHOLDER = "<image>"  # verl's: where an image goes in a message's text
# the processor's outputs that are per token (the rollout and the passes make their own): not the images' tensors
PER_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
_SPLIT = re.compile(f"({re.escape(PLACEHOLDER)})")


def row_images(row: dict, image_key: str) -> list:
    """The row's images as stored (undecoded), [] when none: verl's list under `image_key`, or TRL's single
    `image` column when `image_key` is the default "images" and the row has no images column of its own.

        row_images({"images": [{"bytes": b"...", "path": None}]}, "images")   -> [{"bytes": b"...", "path": None}]
        row_images({"image": b"..."}, "images")                               -> [b"..."]
        row_images({"prompt": "2+2?"}, "images")                              -> []
    """
    if not isinstance(row, dict):
        return []
    value = _listed(row.get(image_key))
    if _empty(value) and image_key == "images" and not _empty(row.get("image")):
        value = [row["image"]]  # TRL's one-image column
    if _empty(value):
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]  # one image stored on its own (a dict, bytes, a path)


def _listed(value):
    """A numpy array (rows built with pandas) as a list; anything else as it is."""
    return list(value) if type(value).__name__ == "ndarray" else value


def _empty(value) -> bool:
    """None, or an empty list, string or bytes (a column a row does not use); `in (None, [])` would ask a numpy
    array (rows built with pandas) for one truth value."""
    return value is None or (isinstance(value, (list, tuple, str, bytes)) and len(value) == 0)


def refuse_videos(row: dict, video_key: str, where: str) -> None:
    """A row with videos (verl's data.video_key column) is a DataError: videos are not supported yet."""
    if isinstance(row, dict) and not _empty(_listed(row.get(video_key))):
        raise DataError(f"{where} has videos in its '{video_key}' column (data.video_key): videos are not supported "
                        "yet; drop the column or the rows (images are supported)")


def decode_image(value, where: str) -> Image.Image:
    """One stored image -> a PIL image in RGB. `value`: bytes; {"bytes": b, "path": p} (bytes may be None, then
    the path is read); a path (relative: to the working directory; "file://" and "data:image/...;base64," are
    read too); a PIL image. One that does not decode is a DataError naming `where` ("train row 7 image 2").

        decode_image({"bytes": png, "path": None}, "train row 0 image 0").size   -> (56, 56)
    """
    try:
        image = _open(value, where)
        return image.convert("RGB")  # convert loads the pixels: a truncated file fails here, not later
    except DataError:
        raise
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, DecompressionBombError, ...
        from PIL import UnidentifiedImageError

        why = "not a format PIL reads" if isinstance(e, UnidentifiedImageError) else one_line(e)
        raise DataError(f"{where} does not decode as an image ({why}); store PNG or JPEG bytes "
                        "({'bytes': ...}) or a readable image file's path") from e


def _open(value, where: str):
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(bytes(value)))
    if isinstance(value, dict):
        if value.get("bytes"):
            return _open(value["bytes"], where)
        if value.get("path"):
            return _open(value["path"], where)
        if value.get("image") is not None:  # Qwen's {"image": path or PIL}
            return _open(value["image"], where)
        raise DataError(f"{where} is a dict with neither 'bytes' nor 'path' (keys: {', '.join(map(str, value)) or 'none'})"
                        "; store {'bytes': <PNG/JPEG bytes>} or {'path': <file>}")
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise DataError(f"{where} is a URL ({value[:80]}): posttrain does not download images; download them "
                            "and store their bytes or local paths")
        if value.startswith("data:image/") and ";base64," in value:
            return Image.open(io.BytesIO(base64.b64decode(value.split(";base64,", 1)[1])))
        path = Path(value.removeprefix("file://")).expanduser()
        if not path.is_file():
            raise DataError(f"{where}: no image file '{value[:200]}' (relative paths are read from the working "
                            f"directory, {Path.cwd()}); give an absolute path or store the image's bytes")
        return Image.open(path)
    raise DataError(f"{where} is {type(value).__name__}, not image bytes, a {{'bytes', 'path'}} dict, a path or a PIL "
                    "image; store one of those")


def with_image_parts(messages, count: int, where: str) -> list[dict]:
    """The chat messages with `count` images as content parts, for a processor's chat template: each `<image>` in
    a string content becomes an {"type": "image"} part, the text around it {"type": "text"} parts, in order; with
    no placeholder (and no image part) anywhere, the images go before the text of the first user message (TRL's
    layout). A content already a list of parts is kept; a plain-string prompt is one user message. Placeholders
    and images disagreeing in number is a DataError naming `where`.

        with_image_parts([{"role": "user", "content": "A <image> B <image>"}], 2, "row 0")[0]["content"]
        # -> [{"type": "text", "text": "A "}, {"type": "image"}, {"type": "text", "text": " B "}, {"type": "image"}]
        with_image_parts("What is this?", 1, "row 0")[0]["content"]
        # -> [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    # every string content becomes parts, not only those with images: some families' templates (Idefics3's)
    # read a content only as a list of parts
    out = [{**m, "content": _parts(m.get("content"))} for m in messages]
    placed = sum(_is_image(p) for m in out for p in m["content"])
    if placed == 0 and count > 0:
        first = next((m for m in out if m.get("role") == "user"), None)
        if first is None:
            raise DataError(f"{where} has {count} image(s), no <image> placeholder and no user message to put them "
                            "in; add a user message or one <image> per image where each goes")
        first["content"] = [{"type": "image"} for _ in range(count)] + first["content"]
    elif placed != count:
        raise DataError(f"{where} has {placed} <image> placeholder(s) but {count} image(s); put one "
                        "<image> in the text per image, in order (or none: the images then go before the first user "
                        "message's text)")
    return out


def _parts(content) -> list:
    if isinstance(content, (list, tuple)):
        return list(content)  # already parts
    if content is None:
        return []
    parts = []
    for piece in _SPLIT.split(str(content)):
        if piece == PLACEHOLDER:
            parts.append({"type": "image"})
        elif piece:  # the empty text around a placeholder at either end would render as nothing
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]


def _is_image(part) -> bool:
    return isinstance(part, dict) and (part.get("type") == "image" or "image" in part)


def encode_vision_prompt(processor, messages, images: list, template_kwargs: dict | None = None) -> list[int]:
    """The prompt's token ids exactly as the processor's full call gives them: its chat template over
    with_image_parts(messages), ready for the assistant's turn, then processor(text=[...], images=[[decoded]]),
    each image placeholder expanded into the image's tokens (their number depends on the image's size for
    Qwen2.5-VL, is fixed for Idefics3). A prompt without images goes the same way (text only). DataError for
    images that do not match the placeholders or do not decode; the processor's own errors pass through.

        encode_vision_prompt(processor, [{"role": "user", "content": "<image>Hi"}], [png], None)
        # -> [257, 117, ..., 259, 261, 261, 261, 261, 260, 72, 105, ...]   (Qwen2.5-VL: 4 <|image_pad|> for 56x56)
    """
    decoded = [decode_image(image, f"image {j}") for j, image in enumerate(images)]
    return _call(processor, messages, decoded, template_kwargs, "the prompt")["input_ids"][0].tolist()


def _call(processor, messages, decoded: list, template_kwargs: dict | None, where: str):
    """The processor's full call on one prompt and its decoded images (a BatchFeature of one row)."""
    parts = with_image_parts(messages, len(decoded), where)
    kwargs = _template_variables(processor, template_kwargs)
    text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False, **kwargs)
    # one list of images per sample: Idefics3 needs it, Qwen2.5-VL takes it as well
    return processor(text=[text], images=[decoded] if decoded else None, return_tensors="pt")


def _template_variables(processor, template_kwargs: dict | None) -> dict:
    """`template_kwargs` less the ones the processor's chat template does not read: a processor takes those for
    its own call, and logs a warning for each prompt (data.apply_chat_template_kwargs.enable_thinking=false on a
    template without thinking would log once per row)."""
    if not template_kwargs:
        return {}
    names = _variables(getattr(processor, "chat_template", None) or "")
    if names is None:
        return dict(template_kwargs)
    return {k: v for k, v in template_kwargs.items() if k in names or k in ("tools", "documents")}


@functools.lru_cache(maxsize=8)
def _variables(template: str) -> frozenset | None:
    """The variables a Jinja template reads (None: it does not parse here; pass everything)."""
    try:
        import jinja2
        from jinja2 import meta

        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except Exception:  # noqa: BLE001 - a template using an extension this environment lacks
        return None


def vision_inputs(processor, images: list, where: str) -> dict:
    """The tensors a model's forward takes for one prompt's images, without the per-token ones (input_ids,
    attention_mask, mm_token_type_ids, token_type_ids: the rollout and the passes make those): exactly (torch.equal)
    those of encode_vision_prompt's full call. {} for no images.

        vision_inputs(qwen_processor, [png_56x56, png_84x56], "train row 3")
        # -> {"pixel_values": [40, 1176], "image_grid_thw": [[1, 4, 4], [1, 4, 6]]}
        vision_inputs(idefics3_processor, [png_56x56], "train row 3")
        # -> {"pixel_values": [1, 1, 3, 32, 32], "pixel_attention_mask": [1, 1, 32, 32]}
    """
    if not images:
        return {}
    decoded = [decode_image(image, f"{where} image {j}") for j, image in enumerate(images)]
    token = getattr(processor, "image_token", None)
    if token is None:  # a processor without a placeholder token: its image processor alone
        out = processor.image_processor(images=[decoded], return_tensors="pt")
    else:
        # the images' tensors do not depend on the text around the placeholders: one placeholder per image is the
        # full call's pixel processing, with the processor's own settings
        out = processor(text=[token * len(decoded)], images=[decoded], return_tensors="pt")
    return {k: v for k, v in out.items() if k not in PER_TOKEN_KEYS}


def image_token_count(processor, ids: list[int]) -> int:
    """How many of `ids` are the processor's image token (what the images cost of data.max_prompt_length, less
    the few marker tokens around each image)."""
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None and getattr(processor, "image_token", None) is not None:
        token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return sum(1 for t in ids if t == token_id) if token_id is not None else 0
