"""The vision-digits task: the arith task with its first number drawn in an image, for the tiny vision model.

    >>> prompt_text(45), answer_text(23, 45)
    ('<image>+45=', '68')
    number_image(23, seed=0, split="train", index=0).size   # (56, 28): one 28x28 cell per digit

The image shows `a` (10..99), one digit per 28x28 cell, which is one image token of Qwen2.5-VL (2x2 patches of
14 px): 56x28 pixels, two image tokens. The text after it is the arith prompt's tail, `+45=`, so the row reads as
the arith prompt `23+45=` with `23` seen rather than written, and the answer, `68`, is scored by the arith reward
(data_source "arith"). The tiny vision model's language model is the embedded arith model, which adds already: what
it has to learn is to read the digits. The pairs are arith.split_pairs' (disjoint train and test pairs).

Each digit is Pillow's built-in bitmap font (5x7 pixels, the same in every Pillow) scaled up 3x to 15x21, placed
in its cell with a jitter of up to 3 pixels each way, dark ink on a light background whose shades vary, plus
pixel noise: no two images alike, so the model cannot learn the pixels of ten glyphs by heart. Everything is
drawn from a generator seeded by (seed, split, index): the same row gives the same PNG bytes on every machine.
"""

from __future__ import annotations

import io

from posttrain.data import arith

DATA_SOURCE = arith.DATA_SOURCE  # scored by the arith reward: the last integer of the response against the sum
CELL = 28  # pixels per digit: one Qwen2.5-VL image token (a 2x2 group of 14-pixel patches)
SCALE = 3  # the bitmap font's 5x7 glyphs drawn 15x21
JITTER = 3  # pixels each way
NOISE = 12.0  # the pixel noise's standard deviation (0..255 levels)
SPLITS = {"train": 0, "test": 1, "dev": 2}


def prompt_text(b: int) -> str:
    """The text of the prompt: the image's placeholder, then the arith prompt after its first number."""
    return f"<image>+{b}="


def answer_text(a: int, b: int) -> str:
    return arith.answer_text(a, b)


def _glyphs() -> dict:
    """Each digit's 0/1 mask [7, 5] in Pillow's built-in bitmap font."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default_imagefont()
    out = {}
    for d in "0123456789":
        im = Image.new("L", (8, 12), 0)
        ImageDraw.Draw(im).text((0, 0), d, fill=255, font=font)
        out[d] = (np.asarray(im)[2:9, 0:5] > 0).astype("float32")
    return out


_GLYPHS: dict = {}


def number_pixels(a: int, rng):
    """`a`'s digits drawn as an RGB uint8 array [28, 28 x digits, 3] (module docstring), drawn with the numpy
    generator `rng`."""
    import numpy as np

    if not _GLYPHS:
        _GLYPHS.update(_glyphs())
    text = str(a)
    ink = np.zeros((CELL, CELL * len(text)), dtype="float32")
    h, w = 7 * SCALE, 5 * SCALE
    for i, d in enumerate(text):
        glyph = np.kron(_GLYPHS[d], np.ones((SCALE, SCALE), dtype="float32"))
        dy, dx = rng.integers(-JITTER, JITTER + 1, size=2)
        y, x = (CELL - h) // 2 + dy, i * CELL + (CELL - w) // 2 + dx
        ink[y:y + h, x:x + w] = glyph
    background = rng.uniform(170, 255, size=3)
    colour = rng.uniform(0, 90, size=3)
    pixels = background * (1 - ink[..., None]) + colour * ink[..., None]
    pixels += rng.normal(0, NOISE, size=pixels.shape)
    return np.clip(np.rint(pixels), 0, 255).astype("uint8")


def number_image(a: int, seed: int = 0, split: str = "train", index: int = 0):
    """The PIL image of `a` for row `index` of `split` under `seed` (the same every time)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, SPLITS[split], index, a])
    return Image.fromarray(number_pixels(a, rng))


def number_png(a: int, seed: int = 0, split: str = "train", index: int = 0) -> bytes:
    """number_image as PNG bytes (what a row's images column stores)."""
    buf = io.BytesIO()
    number_image(a, seed, split, index).save(buf, format="PNG")
    return buf.getvalue()


split_pairs = arith.split_pairs  # (a, b) pairs, the train and test ones disjoint
