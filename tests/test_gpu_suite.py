"""bench/gpu/run.sh --dry-run: the GPU suite's own code, run on the CPU at tiny
sizes, so that the script a GPU machine runs cannot rot between loans."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# the speed part's variants the dry run runs (the others are posttrain with other overrides: the same code, left
# out for time; bench/gpu/suite.py --dry-run --parts speed runs them all)
DRY_VARIANTS = ("levers_off", "trl_generate", "trl_continuous_batching")


def test_the_gpu_suite_runs_dry_on_the_cpu_and_prints_its_table_last(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    env.pop("TRL_PYTHON", None)
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--dry-run", "--variants", ",".join(DRY_VARIANTS)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
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
    lines = done.stdout.strip().splitlines()
    assert any(x.startswith("| qwen2.5-1.5b |") for x in lines) and any(x.startswith("| qwen2.5-0.5b |") for x in lines)
    assert (tmp_path / "out" / "summary.md").read_text().strip().splitlines()[-1] == lines[-1]
    assert any(x.startswith("| several GPUs") and "not run: 0 GPU" in x for x in lines)
    check_speed(res, lines)


def check_speed(res: dict, lines: list[str]) -> None:
    """The speed part: every variant asked for, keyed by name; posttrain's with phases, a profiled step's busy
    fraction and % of the floor; TRL's skipped here (this interpreter has no trl) or run; its table last."""
    speed = res["speed"]["qwen2.5-0.5b"]
    assert list(speed["variants"]) == list(DRY_VARIANTS)
    assert speed["peaks"]["matmul_flops"] > 0 and speed["peaks"]["copy_bytes_per_s"] > 0
    assert all(speed["floor"][k]["floor_s"] > 0 for k in ("gen", "ref", "update", "step"))
    for name in ("levers_off",):
        v = speed["variants"][name]
        assert v["exit_code"] == 0 and v["steps"] == 2 and v["measured_steps"] == [2]
        assert v["prompt_length"] == 32 and v["response_length"] == 8
        assert v["phases_s"]["gen"] > 0 and v["phases_s"]["ref"] > 0 and v["phases_s"]["update"] > 0
        assert v["busy"]["step"] == 2 and 0 < v["busy"]["busy_fraction"] <= 1 and v["busy"]["intervals"] > 0
        assert 0 < v["percent_of_floor"]["step"]
        # only the keys this posttrain's config has are passed: the others are named
        passed = {o.split("=")[0] for o in v["overrides"]} | set(v["dropped_overrides"])
        assert {"rollout.static_decoding", "rollout.stop_check_every"} <= passed
        assert ("rollout.static_decoding" in v["dropped_overrides"]) == (not speed["static_decoding_in_config"])
    for name in ("trl_generate", "trl_continuous_batching"):
        v = speed["variants"][name]
        assert v.get("skipped", "").startswith("trl is not importable") if res["environment"]["trl"] is None else \
            v["exit_code"] == 0 and ("unavailable" in v or v["phases_s"]["gen"] > 0)
    table_rows = [x for x in lines if x.startswith("| ") and x.split(" | ")[0][2:] in DRY_VARIANTS]
    assert [x.split(" | ")[0][2:] for x in table_rows] == list(DRY_VARIANTS) and lines[-1] == table_rows[-1]


def load_bench_gpu(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_gpu_{name}", ROOT / "bench" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_summary_says_several_gpus_have_not_run_unless_they_did():
    sys.path.insert(0, str(ROOT / "bench"))
    suite = load_bench_gpu("suite")
    tests = {"passed": 3, "failed": 0, "skipped": 0, "seconds": 9.0, "cases": []}
    one = suite.table({"environment": {"device": "H200", "device_count": 1}, "tests": tests})
    assert "| several GPUs (tensor parallelism at TP > 1, FSDP2 over devices) | not run: 1 GPU here" in one
    assert "several GPUs" not in suite.table({"environment": {"device": "H200", "device_count": 8}, "tests": tests})


def test_the_busy_time_is_the_union_of_the_intervals():
    busy = load_bench_gpu("busy")
    assert busy.union_ns([]) == 0
    assert busy.union_ns([(10, 12), (0, 5), (3, 8), (11, 11), (8, 9)]) == 9 + 2  # [0, 9) and [10, 12)


def test_the_floor_of_a_qwen2_5_0_5b_step_at_h200_like_peaks(tmp_path):
    """Decoding 512 sequences token by token is bound by memory (the weights and the KV cache read per token),
    the reference pass and the update by compute; the step's floor is the phases' sum, a few seconds."""
    speed = load_bench_gpu("speed")
    work = {"prompts": 64, "n": 8, "prompt_length": 256, "response_length": 512}
    (tmp_path / "config.json").write_text((ROOT / "bench" / "gpu" / "configs" / "qwen2.5-0.5b.json").read_text())
    fl = speed.floor(tmp_path, 494_032_768, work, {"matmul_flops": 800e12, "copy_bytes_per_s": 4e12})
    assert fl["gen"]["bound"] == "memory" and fl["ref"]["bound"] == "compute" and fl["update"]["bound"] == "compute"
    assert abs(fl["update"]["flops"] - 3 * fl["ref"]["flops"]) < 1e-6 * fl["update"]["flops"]  # backward = 2 forwards
    assert 1.0 < fl["step"]["floor_s"] < 5.0
    assert fl["step"]["floor_s"] == sum(fl[k]["floor_s"] for k in ("gen", "ref", "update"))
    pct = speed.percent_of_floor(fl, {"gen": 10.0, "ref": None, "update": 10.0}, 23.0)
    assert pct["ref"] is None and abs(pct["step"] - fl["step"]["floor_s"] / 23.0) < 1e-12
