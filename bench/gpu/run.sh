#!/usr/bin/env bash
# posttrain on a GPU machine, from the repository root (about 22 minutes on an H200; where one call
# is limited to 10, split it: --parts tests,default, then --parts throughput,trl --shapes qwen2.5-0.5b,
# then --parts throughput,trl --shapes qwen2.5-1.5b, then --parts speed alone: about 8 minutes on one
# H100/H200, its variants cut short at 470 s; rerun some with --variants, the others' results are kept):
#
#   bash bench/gpu/run.sh [--parts tests,default,throughput,trl,speed] [--shapes ...] [--steps N]
#                         [--variants levers,trl_generate,levers_off,trl_continuous_batching,levers_no_graph]
#   bash bench/gpu/run.sh --dry-run          # the same on the CPU at tiny sizes
#
# On the GPU machine (no network): the wheels that bench/gpu/carry.py put in .whl/
# and posttrain itself are installed with --no-deps into a private folder, so the
# machine's own torch and transformers are the ones that run. Then bench/gpu/suite.py
# writes results.json, summary.md, pytest.xml and log.txt into $OUT (or --out DIR)
# and prints the Markdown table last.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t posttrain-gpu-XXXXXX)}
export OUT

dry=0
for a in "$@"; do [[ $a == --dry-run ]] && dry=1; done
if (( ! dry )); then
  site=${POSTTRAIN_SITE:-/tmp/posttrain-site}
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  else
    echo "no wheels in .whl/: run python3 bench/gpu/carry.py here first and carry .whl" >&2
  fi
  # posttrain with --no-deps; a build that fails (an old setuptools) falls back to the source tree
  if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
       --target "$site" . >"$OUT/install.txt" 2>&1; then
    echo "pip could not build posttrain here (see install.txt); using src/ as it is" >&2
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
fi
"$PY" -c "import posttrain, torch, transformers; print('posttrain', posttrain.__file__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
exec "$PY" bench/gpu/suite.py --out "$OUT" "$@"
