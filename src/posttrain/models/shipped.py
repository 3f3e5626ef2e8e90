"""The tiny models whose weights ship inside the package, and the check that a directory still holds
the bytes posttrain shipped (a few milliseconds).

    embedded/        the embedded tiny model (arithmetic; `posttrain train`'s default)
    embedded_tools/  the same model warmed up on calculator calls (the tool-use demonstration)
    embedded_games/  the same model warmed up on number guessing (the multi-turn game demonstration)
    embedded_vision/ a Qwen2.5-VL around the same model, warmed up to read two digits in an image (vision-digits)

The code that built them lives a floor higher, in tiny/ (tiny/arith.py, tiny/tools.py, tiny/games.py,
tiny/vision_model.py): it trains with the rollout engine and the data, which this room must not import. To
replace a shipped model, rebuild it into its directory
(`posttrain tiny-model [--task tools|games|vision] --rebuild --output DIR`) and set its digest here to the one
that command prints.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import ModelError
from posttrain.files.cache import directory_digest

EMBEDDED_DIR = Path(__file__).with_name("embedded")
# directory_digest(EMBEDDED_DIR): the shipped model's bytes, every file of it
EMBEDDED_DIGEST = "4a09583d34fe4752b0f8949c3a42c9acf47b7a92cb3480676d335f361f2bf9c8"
TOOLS_DIR = Path(__file__).with_name("embedded_tools")
# directory_digest(TOOLS_DIR): the shipped tool-using model's bytes, every file of it
TOOLS_DIGEST = "ca5c8aaee5b23c8ebb6508f7125c4678bdd22a0d203c014cd77c2663861cac5d"
GAMES_DIR = Path(__file__).with_name("embedded_games")
# directory_digest(GAMES_DIR): the shipped number-guessing model's bytes, every file of it
GAMES_DIGEST = "949836955e8c7c6cf5775ba5c68de48d17ddb4dd51a4e6748442f1a4476eeed2"
VISION_DIR = Path(__file__).with_name("embedded_vision")
# directory_digest(VISION_DIR): the shipped vision-digits model's bytes, every file of it
VISION_DIGEST = "8a76cb7092616e056da0b028c10acee8945bf4fd44b075c6d8538778ce11d1ff"


def embedded_model() -> Path:
    """The shipped model's directory, checked against EMBEDDED_DIGEST (a few milliseconds)."""
    return checked_directory(EMBEDDED_DIR, EMBEDDED_DIGEST, "the embedded tiny model",
                             "posttrain tiny-model --rebuild --output DIR")


def tools_model() -> Path:
    """The shipped tool-using tiny model's directory, checked against TOOLS_DIGEST."""
    return checked_directory(TOOLS_DIR, TOOLS_DIGEST, "the tool-using tiny model",
                             "posttrain tiny-model --task tools --rebuild --output DIR")


def games_model() -> Path:
    """The shipped number-guessing tiny model's directory, checked against GAMES_DIGEST."""
    return checked_directory(GAMES_DIR, GAMES_DIGEST, "the number-guessing tiny model",
                             "posttrain tiny-model --task games --rebuild --output DIR")


def vision_model() -> Path:
    """The shipped tiny vision-language model's directory, checked against VISION_DIGEST."""
    return checked_directory(VISION_DIR, VISION_DIGEST, "the tiny vision model",
                             "posttrain tiny-model --task vision --rebuild --output DIR")


def checked_directory(path: Path, digest: str, what: str, rebuild: str) -> Path:
    """`path` if its files are the shipped ones (directory_digest == digest), else ModelError with the fix."""
    fix = f"reinstall posttrain, or build one with `{rebuild}` and train with model.path=DIR"
    if not path.is_dir():
        raise ModelError(f"{what}'s directory {path} is missing; {fix}")
    found = directory_digest(path)
    if found != digest:
        raise ModelError(f"{what}'s files in {path} are not the ones posttrain shipped "
                         f"(digest {found[:16]}, expected {digest[:16]}); {fix}")
    return path
