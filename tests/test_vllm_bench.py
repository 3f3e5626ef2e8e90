"""bench/vllm_cpu.py keeps running: the smallest run of it (the tiny model, 2 prompts x 2 samples of 4
tokens, float32) prints its two tables. In the vLLM environment only (`make test-vllm`'s .venv-vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]


def test_the_vllm_cpu_benchmark_prints_its_tables(tmp_path):
    import posttrain

    env = {**os.environ, "PYTHONPATH": str(Path(posttrain.__file__).resolve().parents[1])}  # this checkout's
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_cpu.py"), "--models", "tiny", "--prompts", "2",
                           "--n", "2", "--max-tokens", "4", "--repeats", "1", "--dtypes", "float32",
                           "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert all(x.startswith("|") for x in lines[1:] if x), proc.stdout  # vLLM's log goes to stderr
    rows = [line for line in lines if line.startswith("| tiny |")]
    assert [r.split(" | ")[1:3] for r in rows[:2]] == [["hf", "float32"], ["vllm", "float32"]], proc.stdout
    assert rows[2].startswith("| tiny | float32 | ") and len(rows) == 3, proc.stdout
    result = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert result["tokens"] == {"hf float32": 16, "vllm float32": 16}  # 2 x 2 x 4, EOS off
    gap = result["mismatch"]["float32"]
    assert gap["rollout_corr/logp_abs_diff_max"] < 1e-4  # float32 on both sides (tests/test_vllm_engine.py)
