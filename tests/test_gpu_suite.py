"""bench/gpu/run.sh --dry-run: the GPU suite's own code, run on the CPU at tiny
sizes, so that the script a GPU machine runs cannot rot between loans."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_suite_runs_dry_on_the_cpu_and_prints_its_table_last(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["environment"]["dry_run"] and res["environment"]["device"] == "cpu"
    tests = res["tests"]
    assert tests["exit_code"] == 0 and tests["failed"] == 0
    assert "tests/test_gpu.py" in tests["files"] and tests["skipped"] >= 6  # no CUDA here: every GPU case skips
    assert all(c["why"].startswith("Skipped:") or "CUDA" in c["why"] or "vLLM" in c["why"] for c in tests["cases"])
    default = res["default"]
    assert default["exit_code"] == 0 and default["steps"] == 2 and default["val_after"] is not None
    for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        tp = res["throughput"][shape]
        assert tp["exit_code"] == 0 and tp["steps"] == 2
        assert tp["prompt_length"] == 32 and tp["response_length"] == 8  # exact lengths: EOS off
        assert tp["phases_s"]["timing_s/gen"] > 0 and tp["phases_s"]["timing_s/update_actor"] > 0
        assert tp["parameters"] > 151_936 * 64  # the real vocabulary's embedding is there
    last = done.stdout.strip().splitlines()
    assert last[-1].startswith("| qwen2.5-1.5b |") and last[-2].startswith("| qwen2.5-0.5b |")
    assert (tmp_path / "out" / "summary.md").read_text().strip().splitlines()[-1] == last[-1]
