"""malloc.reuse_freed_memory: freed memory comes back without page faults, and a CPU worker sets it up."""

import platform
import subprocess
import sys

import pytest

from posttrain.config import load_config

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"

# 20 rounds of a 64 MiB tensor written and freed; -> the page faults of each round
ROUNDS = """
import resource, sys, torch
from posttrain.runtime.malloc import reuse_freed_memory
if sys.argv[1] in ("reuse", "reuse then off"):
    assert reuse_freed_memory()
if sys.argv[1] == "reuse then off":
    assert reuse_freed_memory(False)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
for _ in range(20):
    before = faults()
    x = torch.empty(1 << 24).fill_(1.0)
    del x
    out.append(faults() - before)
print(out)
"""


def round_faults(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (elsewhere reuse_freed_memory does nothing)")
def test_a_freed_tensor_comes_back_without_page_faults():
    plain, reused, back = round_faults("plain"), round_faults("reuse"), round_faults("reuse then off")
    pages = (1 << 24) * 4 // 4096  # 16384 pages of 4 KiB
    # by default every round maps fresh memory and faults each page in; kept memory is reused once the heap
    # has grown a free block the request fits (a few rounds: the allocation's alignment asks a bit more)
    assert min(plain[-5:]) >= 0.9 * pages, plain
    assert sum(reused[-5:]) < 0.05 * pages, reused
    assert min(back[-5:]) >= 0.9 * pages, back  # switched off again: glibc's way back


def test_a_cpu_worker_keeps_freed_memory_unless_switched_off(tmp_path, tiny_model_dir, monkeypatch):
    from posttrain.runtime import malloc
    from posttrain.driver.settings import worker_spec
    from posttrain.worker.verbs import Worker

    calls = []
    monkeypatch.setattr(malloc, "reuse_freed_memory", lambda on=True: calls.append(on) or True)
    for value, want in (("true", [True]), ("false", [False])):
        calls.clear()
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"trainer.reuse_cpu_memory={value}",
                                 f"trainer.run_dir={tmp_path / value}"])
        spec = worker_spec(cfg, str(tiny_model_dir), None, "cpu", total_steps=1)
        assert spec.reuse_cpu_memory is (value == "true")
        Worker(spec).setup()
        assert calls == want
