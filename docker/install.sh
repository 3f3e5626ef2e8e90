#!/usr/bin/env bash
# Installs posttrain into a Python environment, the same way in both images
# (docker/Dockerfile.cpu and docker/Dockerfile.gpu) and in tests/test_docker.py.
#
#   bash docker/install.sh [--base-only] [SOURCE_DIR]
#
# Two steps, run in this order:
#   1. the base: PyTorch, from the source TORCH_SOURCE names (below);
#   2. posttrain from SOURCE_DIR (default: the directory above this script) with
#      its extras POSTTRAIN_EXTRAS, and RAY_SPEC beside it; every package step 1
#      left installed is pinned, with a constraints file, so that resolving
#      posttrain's dependencies can never replace that torch (nor vLLM's own
#      pins): a conflict stops the install instead. `pip check` ends it.
# --base-only stops after step 1: the images run it in a layer of its own, before
# the source is copied in, so that a change to the code does not download the
# base again.
#
# Settings (environment variables; a Dockerfile's ARGs arrive as these):
#   PYTHON            interpreter of the environment to install into (default: python)
#   TORCH_SOURCE      index (default): TORCH_SPEC from TORCH_INDEX
#                     vllm: VLLM_SPEC, TORCH_SPEC and RAY_SPEC from pip's default index,
#                           in one resolve; torch is the (CUDA) build vLLM pins
#                     keep: torch is installed already; it is only checked
#   TORCH_SPEC        e.g. torch==2.13.0: required with TORCH_SOURCE=index; optional
#                     with vllm, where a version other than vLLM's own pin fails
#   TORCH_INDEX       index URL for torch alone, e.g. https://download.pytorch.org/whl/cpu;
#                     empty: pip's configured index, as with the Makefile
#   VLLM_SPEC         e.g. vllm==0.32.0 (required with TORCH_SOURCE=vllm)
#   RAY_SPEC          e.g. ray[default]==2.60.0; empty: whatever posttrain's extras allow
#   POSTTRAIN_EXTRAS  comma-separated extras of posttrain (default: ray; empty: none)
#   PIP_CHECK         1 (default): finish with `pip check`; 0: skip it
# pip's own variables (PIP_NO_CACHE_DIR, PIP_INDEX_URL, ...) apply as usual;
# PIP_QUIET defaults to 1 here.
set -euo pipefail

die() {
    echo "install.sh: error: $*" >&2
    exit 2
}

base_only=0
source_dir=""
for arg in "$@"; do
    case "$arg" in
        --base-only) base_only=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
            exit 0
            ;;
        -*) die "unknown option $arg (see --help)" ;;
        *)
            [[ -z "$source_dir" ]] || die "one SOURCE_DIR only (got '$source_dir' and '$arg')"
            source_dir="$arg"
            ;;
    esac
done
if [[ -z "$source_dir" ]]; then
    source_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fi

PYTHON="${PYTHON:-python}"
TORCH_SOURCE="${TORCH_SOURCE:-index}"
TORCH_SPEC="${TORCH_SPEC:-}"
TORCH_INDEX="${TORCH_INDEX:-}"
VLLM_SPEC="${VLLM_SPEC:-}"
RAY_SPEC="${RAY_SPEC:-}"
POSTTRAIN_EXTRAS="${POSTTRAIN_EXTRAS-ray}"
PIP_CHECK="${PIP_CHECK:-1}"
export PIP_QUIET="${PIP_QUIET:-1}"

command -v "$PYTHON" >/dev/null 2>&1 || die "no Python interpreter '$PYTHON' (set PYTHON)"
pip() {
    "$PYTHON" -m pip "$@"
}
prefix="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
echo "install.sh: installing into $prefix (torch from: $TORCH_SOURCE)"

# Step 1: the base.
case "$TORCH_SOURCE" in
    index)
        [[ -n "$TORCH_SPEC" ]] || die "TORCH_SOURCE=index needs TORCH_SPEC (e.g. torch==2.13.0)"
        index_args=()
        if [[ -n "$TORCH_INDEX" ]]; then
            index_args=(--index-url "$TORCH_INDEX")
        fi
        pip install "${index_args[@]}" "$TORCH_SPEC"
        ;;
    vllm)
        [[ -n "$VLLM_SPEC" ]] || die "TORCH_SOURCE=vllm needs VLLM_SPEC (e.g. vllm==0.32.0)"
        base=("$VLLM_SPEC")
        if [[ -n "$TORCH_SPEC" ]]; then
            base+=("$TORCH_SPEC")
        fi
        if [[ -n "$RAY_SPEC" ]]; then
            base+=("$RAY_SPEC")
        fi
        pip install "${base[@]}"
        ;;
    keep) ;;
    *) die "TORCH_SOURCE must be index, vllm or keep, not '$TORCH_SOURCE'" ;;
esac
"$PYTHON" -c 'import torch' 2>/dev/null \
    || die "torch does not import in $prefix after step 1 (TORCH_SOURCE=$TORCH_SOURCE)"
if [[ "$base_only" == 1 ]]; then
    exit 0
fi

# Step 2: posttrain, with everything already installed held where it is.
[[ -f "$source_dir/pyproject.toml" ]] || die "no pyproject.toml in $source_dir (the posttrain source)"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
# `pip list --format=freeze` writes name==version even for packages installed
# from a URL or a file, which a constraints file needs.
pip list --format=freeze --exclude pip --exclude posttrain >"$constraints"
target="$source_dir"
if [[ -n "$POSTTRAIN_EXTRAS" ]]; then
    target="${source_dir}[${POSTTRAIN_EXTRAS}]"
fi
wanted=("$target")
if [[ -n "$RAY_SPEC" ]]; then
    wanted+=("$RAY_SPEC")
fi
pip install --constraint "$constraints" "${wanted[@]}"
if [[ "$PIP_CHECK" == 1 ]]; then
    pip check >/dev/null || {
        pip check >&2 || true
        die "the installed packages are inconsistent (above); PIP_CHECK=0 skips this check"
    }
fi
"$PYTHON" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version

import torch

found = []
for name in ("posttrain", "torch", "ray", "vllm", "transformers"):
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print("install.sh: done:", ", ".join(found), f"(CUDA {torch.version.cuda})" if torch.version.cuda else "(CPU)")
EOF
