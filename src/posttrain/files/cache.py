"""Files and directories that rooms on several floors read: where the cache lives, a file's and a
directory's sha256, what a model directory must hold, and the file names of a peft adapter directory.

On the bottom floor (DESIGN.md), so that data/, rewards/, rollout/, models/ and checkpoint/ can all
use them without reaching up to one another.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from posttrain.errors import ModelError

ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter directory: these two files
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_FIX = ("point actor_rollout_ref.model.path (model.path) at a Hugging Face model directory, "
        "or make one with `posttrain tiny-model --output DIR`")


def cache_root() -> Path:
    """$POSTTRAIN_CACHE, else $XDG_CACHE_HOME/posttrain, else ~/.cache/posttrain."""
    if os.environ.get("POSTTRAIN_CACHE"):
        return Path(os.environ["POSTTRAIN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "posttrain"


def sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def directory_digest(path: str | Path) -> str:
    """sha256 over a directory's files: each file's name and the sha256 of its bytes, in name order."""
    outer = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        outer.update(f"{f.name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return outer.hexdigest()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
TOKENIZER_FIX = "point model.tokenizer_path at the directory of the tokenizer's files, or null for the model's own"


def check_model_dir(path: str | Path, fix: str = _FIX, tokenizer: bool = True) -> Path:
    """Fail early, with the fix (`fix`: which key to point where), on a directory that cannot hold a model
    (`tokenizer`: with its tokenizer's files; false: the tokenizer is given apart, model.tokenizer_path)."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model directory '{p}' does not exist; {fix}")
    if not p.is_dir():
        raise ModelError(f"model path '{p}' is a file, not a directory; {fix}")
    if not (p / "config.json").exists():
        raise ModelError(f"model directory '{p}' has no config.json; {fix}")
    if not (list(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").exists()):
        pickled = list(p.glob("pytorch_model*.bin")) or list(p.glob("*.pt"))
        hint = (" (it has only pickled .bin weights, which posttrain does not unpickle: "
                "convert them to safetensors)") if pickled else ""
        raise ModelError(f"model directory '{p}' has no safetensors weights{hint}; {fix}")
    if tokenizer and not any((p / f).exists() for f in TOKENIZER_FILES):
        raise ModelError(f"model directory '{p}' has no tokenizer files (tokenizer.json / tokenizer_config.json); {fix}"
                         + (" (or give the tokenizer's directory as model.tokenizer_path)" if fix == _FIX else ""))
    return p


def check_tokenizer_dir(path: str | Path) -> Path:
    """Fail early, naming model.tokenizer_path, on a directory given for the tokenizer that holds none."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"model.tokenizer_path={p}: {'no such directory' if not p.exists() else 'not a directory'}; "
                         f"{TOKENIZER_FIX}")
    if not any((p / f).exists() for f in TOKENIZER_FILES):
        raise ModelError(f"model.tokenizer_path={p}: no tokenizer files there (tokenizer.json / "
                         f"tokenizer_config.json); {TOKENIZER_FIX}")
    return p
