#!/usr/bin/env python3
"""Gather the wheels that the GPU machine's image lacks, and check that they fit.

The lent GPU machine has no network. Its image has CPython 3.12 (x86_64, manylinux)
with the packages in IMAGE below; what it lacks is pinned in bench/gpu/wheels.txt.
This script
  1. downloads those wheels, for that interpreter and platform, into DEST (.whl/ by
     default, which git ignores, so it travels only when carried) and removes any
     other wheel there;
  2. checks that every requirement of every carried wheel is met by a carried wheel
     or by the image;
  3. checks that what travels (the files git would send plus DEST) fits the limit.

    python3 bench/gpu/carry.py [--dest .whl] [--check-only] [--limit-mib 64]

A relative DEST is taken from the repository root. Progress goes to stderr, the
summary to stdout; the exit status is 1 when a check fails. Standard library only;
`packaging` (the image has it) is used when importable, for exact markers and
version specifiers, else a small fallback does.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:  # the fallbacks below take over
    Marker = SpecifierSet = Version = None

REPO = Path(__file__).resolve().parents[2]
WHEELS_TXT = Path(__file__).resolve().with_name("wheels.txt")
MIB = 2**20

# The image's interpreter and platform, for `pip download` and for environment markers.
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix",
              "extra": ""}  # no extra is asked for: `extra == "..."` requirements drop out

# The image's packages. Versions where known; every other name is present at an unknown version.
IMAGE_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0",
                  "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2", "triton": "3.6.0"}
IMAGE_NAMES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-ml-py nvidia-nccl-cu13 onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()


def canon(name: str) -> str:
    """PEP 503: lowercase, runs of - _ . become one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


IMAGE: dict[str, str | None] = {**{canon(n): None for n in IMAGE_NAMES},
                                **{canon(n): v for n, v in IMAGE_VERSIONS.items()}}


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def parse_wheels_txt(text: str) -> dict[str, str]:
    """`name==version` lines (`#` comments, blank lines) -> {canonical name: version}."""
    pins: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)", line)
        if not m:
            raise ValueError(f"wheels.txt line {number}: expected name==version, got {line!r}")
        name = canon(m.group(1))
        if name in pins:
            raise ValueError(f"wheels.txt line {number}: {name} is pinned twice (keep one version of each)")
        pins[name] = m.group(2)
    return pins


# --- versions, specifiers and markers: `packaging` when importable, else a fallback that
# compares release numbers only (pre-releases and local versions are not told apart).

def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


def same_version(a: str, b: str) -> bool:
    if Version is not None:
        return Version(a) == Version(b)
    def suffix(v):  # 'rc1' of '1.0rc1'
        return re.sub(r"^\s*v?[\d.]*", "", v).lower()
    return _cmp(_release(a), _release(b)) == 0 and suffix(a) == suffix(b)


def satisfies(version: str, spec: str) -> bool:
    """Whether `version` meets the specifier `spec` (e.g. '>=1.31.0,<3.0'; '' is anything)."""
    if SpecifierSet is not None:
        return SpecifierSet(spec).contains(version, prereleases=True)
    have = _release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, want = re.fullmatch(r"(~=|===|==|!=|<=|>=|<|>)\s*(\S+)", clause).groups()
        if want.endswith(".*"):  # ==1.2.* / !=1.2.*
            prefix = _release(want[:-2])
            hit = _cmp(have[:len(prefix)], prefix) == 0
            ok = hit if op == "==" else not hit
        else:
            w, c = _release(want), _cmp(have, _release(want))
            ok = {"==": c == 0, "===": c == 0, "!=": c != 0, "<=": c <= 0, ">=": c >= 0, "<": c < 0, ">": c > 0,
                  "~=": c >= 0 and _cmp(have[:len(w) - 1], w[:-1]) == 0}[op]
        if not ok:
            return False
    return True


def applies(marker: str) -> bool:
    """Whether an environment marker holds on the image (no extra asked for)."""
    if not marker:
        return True
    if Marker is not None:
        return Marker(marker).evaluate(TARGET_ENV)
    if "extra" in marker:  # an optional feature's requirement
        return False
    # `var op "value"` clauses joined all by `and` or all by `or`; anything else is kept,
    # so that a requirement in doubt shows up as unmet rather than slipping by
    clauses = re.findall(r"""(\w+)\s*(==|!=|<=|>=|<|>)\s*["']([^"']*)["']""", marker)
    joins = set(re.findall(r"\b(and|or)\b", marker))
    if "(" in marker or len(joins) > 1 or len(clauses) != len(re.findall(r"\b(?:and|or)\b", marker)) + 1:
        return True
    results = []
    for var, op, value in clauses:
        have = TARGET_ENV.get(var, "")
        if var.startswith("python"):
            c = _cmp(_release(have), _release(value))
        else:
            c = (have > value) - (have < value)
        results.append({"==": c == 0, "!=": c != 0, "<=": c <= 0, ">=": c >= 0, "<": c < 0, ">": c > 0}[op])
    return any(results) if joins == {"or"} else all(results)


def split_requirement(req: str) -> tuple[str, str, str]:
    """'Name[extra] (>=1, <2) ; marker' -> ('name', '>=1,<2', 'marker'). The extras asked of a
    package are not followed: their own requirements are not checked."""
    req, _, marker = req.partition(";")
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$", req)
    return canon(m.group(1)), re.sub(r"[\s()]", "", m.group(2)), marker.strip()


# --- wheels

def wheel_name_version(path: str | Path) -> tuple[str, str]:
    """'multiprocess-0.70.19-py312-none-any.whl' -> ('multiprocess', '0.70.19')."""
    name, version = Path(path).name.split("-")[:2]
    return canon(name), version


def requirements_of(wheel_path: str | Path) -> list[str]:
    """The Requires-Dist of a wheel's METADATA that apply on the image, markers removed."""
    with zipfile.ZipFile(wheel_path) as z:
        [meta] = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        headers = email.parser.Parser().parsestr(z.read(meta).decode("utf-8"), headersonly=True)
    out = []
    for req in headers.get_all("Requires-Dist") or []:
        name, spec, marker = split_requirement(req)
        if applies(marker):
            out.append(name + spec)
    return out


def wheels_in(dest: Path) -> list[Path]:
    return sorted(dest.glob("*.whl")) if dest.is_dir() else []


def unmet(carried: dict[str, tuple[str, list[str]]], image: dict[str, str | None]) -> list[str]:
    """carried: {name: (version, requirements)}; image: {name: version or None when unknown}.
    A requirement is met by a carried wheel (which pip installs over the image's copy) or else
    by the image; an image version that is unknown meets any specifier."""
    problems = []
    for who, (version, reqs) in sorted(carried.items()):
        for req in reqs:
            name, spec, _ = split_requirement(req)
            if name in carried:
                have, where = carried[name][0], "carried"
            elif name in image:
                have, where = image[name], "the image has"
            else:
                problems.append(f"{who} {version} needs {name}{spec}: neither carried nor on the image")
                continue
            if have is not None and not satisfies(have, spec):
                problems.append(f"{who} {version} needs {name}{spec}: {where} {have}")
    return problems


def unverified(carried: dict[str, tuple[str, list[str]]], image: dict[str, str | None]) -> list[str]:
    """Specifiers that only the image meets, at a version this script does not know."""
    return [f"{who} needs {name}{spec}" for who, (_, reqs) in sorted(carried.items()) for name, spec, _ in
            map(split_requirement, reqs) if spec and name not in carried and name in image and image[name] is None]


# --- downloads

def download(name: str, version: str, dest: Path) -> None:
    pin = f"{name}=={version}"
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms, "-d", str(dest), pin]
    log(f"downloading {pin}")
    if subprocess.run(cmd, stdout=sys.stderr).returncode == 0:
        return
    # No wheel for the image: one built here from the sdist serves only if it is pure Python.
    # It is built aside, so that a wheel for this machine's platform never lands in DEST.
    log(f"{pin}: no wheel for CPython {PYTHON_VERSION} manylinux x86_64; building one from the sdist")
    with tempfile.TemporaryDirectory() as tmp:
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, pin],
                               stdout=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if built.returncode != 0 or len(wheels) != 1:
            raise SystemExit(f"{pin}: neither a wheel for the image nor one built from the sdist (pip's output above)")
        if not wheels[0].name.endswith("-none-any.whl"):
            raise SystemExit(f"{pin}: there is no wheel for CPython {PYTHON_VERSION} manylinux x86_64 and it is not "
                             f"pure Python (built {wheels[0].name}): it cannot be carried; pin a version that has one")
        shutil.move(str(wheels[0]), dest / wheels[0].name)


def stray(dest: Path, pins: dict[str, str]) -> list[Path]:
    """Wheels in DEST that wheels.txt does not pin at that version."""
    out = []
    for path in wheels_in(dest):
        name, version = wheel_name_version(path)
        if name not in pins or not same_version(version, pins[name]):
            out.append(path)
    return out


def sync(dest: Path, pins: dict[str, str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for path in stray(dest, pins):
        log(f"removing {path.name}: not pinned in wheels.txt at that version")
        path.unlink()
    for path in wheels_in(dest):
        if not zipfile.is_zipfile(path):  # a download cut short
            log(f"removing {path.name}: not a zip file")
            path.unlink()
    have = {wheel_name_version(p) for p in wheels_in(dest)}
    for name, version in pins.items():
        if any(n == name and same_version(v, version) for n, v in have):
            log(f"have {name}=={version}")
        else:
            download(name, version, dest)


# --- sizes

def tree_bytes(root: Path, skip: Path | None = None) -> int:
    """Bytes of the files git would send from `root`: tracked and untracked-but-not-ignored
    files, less those deleted from the work tree (and those under `skip`, counted apart)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, check=True).stdout
    total = 0
    for rel in set(os.fsdecode(r) for r in listed.split(b"\0") if r):
        path = Path(root, rel)
        if skip is not None and path.is_relative_to(skip):
            continue
        if path.is_symlink() or path.is_file():  # a submodule's directory or a deleted file is not sent
            total += path.lstat().st_size
    return total


def dir_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=".whl", help="where the wheels go; relative to the repository root (.whl)")
    ap.add_argument("--check-only", action="store_true", help="download and remove nothing: only check DEST")
    ap.add_argument("--limit-mib", type=float, default=64, help="what may travel, tree plus wheels (64)")
    args = ap.parse_args(argv)
    dest = (REPO / args.dest).resolve()  # an absolute --dest stays as it is
    pins = parse_wheels_txt(WHEELS_TXT.read_text())

    problems = []
    if args.check_only:
        problems += [f"{p.name} is in {dest} but not pinned in wheels.txt at that version" for p in stray(dest, pins)]
    else:
        sync(dest, pins)
    carried, pinned = {}, sorted(set(wheels_in(dest)) - set(stray(dest, pins)))
    for path in pinned:
        log(f"{path.name}: {path.stat().st_size / MIB:.2f} MiB")
        name, version = wheel_name_version(path)
        try:
            carried[name] = (version, requirements_of(path))
        except (zipfile.BadZipFile, ValueError) as e:  # a broken file: pip on the GPU machine would fail on it too
            problems.append(f"{path.name} is not a readable wheel ({e}): delete it and run again")
    present = {wheel_name_version(p)[0] for p in pinned}
    problems += [f"{n}=={v} is pinned but not in {dest}" for n, v in pins.items() if n not in present]
    bad = unmet(carried, IMAGE)
    problems += bad
    for line in unverified(carried, IMAGE):
        log(f"not verified (the image's version is unknown): {line}")

    tree, wheels = tree_bytes(REPO, skip=dest), dir_bytes(dest)
    total, limit = tree + wheels, args.limit_mib * MIB
    if total > limit:
        problems.append(f"{total / MIB:.2f} MiB would travel, over the {args.limit_mib:g} MiB limit")
    for p in problems:
        log("PROBLEM:", p)
    print(f"wheels: {len(carried)} in {dest}, requirements {'NOT met' if bad else 'met'}")
    print(f"size: tree {tree / MIB:.2f} MiB + wheels {wheels / MIB:.2f} MiB = {total / MIB:.2f} MiB "
          f"(limit {args.limit_mib:g} MiB)")
    print("ok" if not problems else f"FAILED: {len(problems)} problem(s), listed on stderr")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
