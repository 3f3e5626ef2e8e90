"""posttrain on a GPU: the GPU tests, the embedded default, throughput at
real shapes against TRL's GRPOTrainer, and the step against its floor with
posttrain's levers on and off, in one command. Run through
`bench/gpu/run.sh`, which installs what the machine lacks first.

    python bench/gpu/suite.py --out DIR [--dry-run] [--parts tests,default,throughput,trl,speed]
                              [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--steps 3]
                              [--variants levers,trl_generate,levers_off,trl_continuous_batching,levers_no_graph]

Parts (each writes DIR/results.json as it finishes, so a run cut short
keeps what was done; a later call with other parts adds to it):
  tests       `pytest -m gpu` over the test files that hold GPU tests (junit in DIR/pytest.xml)
  default     `posttrain train` with no model: the embedded default, on CUDA
  throughput  GRPO steps at each shape: bf16 autocast over float32 weights, 64 prompts x 8 samples,
              256-token prompts, 512-token responses (EOS off), a KL loss to the reference, one update
  trl         the same work with TRL's GRPOTrainer (bf16, float32 weights), for the ratio
  speed       at Qwen2.5-0.5B's shape only (the throughput part's work): posttrain with every lever (its
              defaults on CUDA), with its levers off (LEVERS_OFF below: today's path) and with every lever but
              the CUDA graph (levers_no_graph); TRL's GRPOTrainer with generate() and with transformers'
              continuous batching (SPEED_VARIANTS); per variant s/step and the seconds of generation, the
              reference pass, the old log-prob pass and the update (posttrain's timing_s/*, TRL's methods
              wrapped in CUDA-synchronised timers: bench/trl_side.py), the GPU's busy fraction over one
              profiled step (bench/gpu/busy.py), and % of the floor (bench/gpu/speed.py: bench/step_floor.py's
              model at this device's measured bf16 matmul FLOP/s and copy bandwidth). --variants picks some;
              results["speed"][shape]["variants"][name], so a rerun of one keeps the others. About 8 minutes
              on an H100/H200: alone in one call (--parts speed; --shapes does not apply). Steps: --steps
              (default 3; dry 2): the first a warm-up, the last profiled, the median over those between
              (the profiled one when none is between)
The Markdown table (DIR/summary.md) is printed last.

--dry-run runs the same code on the CPU at tiny sizes (the shapes shrunk to 2
layers of 64, 4 prompts x 2 samples, 32-token prompts, 8-token responses,
2 steps; the default run cut to 2 steps): what the default test suite
runs so that this script keeps working. The TRL variants run with the
interpreter $TRL_PYTHON names (default this one), and are recorded as skipped
where it cannot import trl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent)]

import shapes  # noqa: E402

PARTS = ("tests", "default", "throughput", "trl", "speed")

# ------------------------------------------------------------------ the speed part's variants
# posttrain's levers switched off, as config overrides (posttrain's own keys): today's path. A key that this
# posttrain's config schema lacks is left out of the run and named in the results (the variant's
# "dropped_overrides"), so the dry run never passes an unknown key.
LEVERS_OFF = {
    # the hf engine's decoding: false = today's loop; true (the default on CUDA) = the static-shape step,
    # CUDA-graph captured on CUDA (rollout.enforce_eager=true: the static step without the graph)
    "rollout.static_decoding": False,
    "rollout.stop_check_every": 1,  # a host check for ended sequences after every token (null: 8 on a GPU)
    "ref.cast_weights": False,  # the reference's Linear weights cast by autocast at every forward (null: once)
    # the no-gradient passes' micro-batches of rollout.log_prob_micro_batch_size sequences (null on CUDA: a token
    # budget from the free memory)
    "model.log_prob_budget_from_memory": False,
}
# name -> ("posttrain", overrides) or ("trl", trainer settings), in the order they run (the most wanted first,
# so that a call cut short keeps them)
SPEED_VARIANTS = {
    "levers": ("posttrain", {}),  # posttrain's defaults on CUDA: every lever on
    "trl_generate": ("trl", {"continuous_batching": False}),  # GRPOTrainer with its default generate()
    "levers_off": ("posttrain", LEVERS_OFF),
    "trl_continuous_batching": ("trl", {"continuous_batching": True}),  # use_transformers_continuous_batching
    "levers_no_graph": ("posttrain", {"rollout.enforce_eager": True}),  # every lever, no CUDA graph
}
SPEED_BUDGET_S = 470  # the speed part's variants on a GPU, so that it ends within ~8 minutes
SPEED_VARIANT_TIMEOUT_S = 180

REAL = dict(prompts=64, n=8, prompt_length=256, response_length=512, micro=8, log_prob_micro=16, trl_split="16x32")
DRY = dict(prompts=4, n=2, prompt_length=32, response_length=8, micro=4, log_prob_micro=8, trl_split="4x2")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Results:
    """DIR/results.json, rewritten after every part."""

    def __init__(self, out: Path):
        self.path = out / "results.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1))


def environment(dry_run: bool) -> dict:
    import torch
    import transformers

    import posttrain

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "posttrain": getattr(posttrain, "__version__", "?"), "posttrain_from": str(Path(posttrain.__file__).parent),
           "cuda": torch.version.cuda, "dry_run": dry_run}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["device_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
        env["device_count"] = torch.cuda.device_count()
    else:
        env["device"] = "cpu"
    try:
        import trl

        env["trl"] = trl.__version__
    except ImportError:
        env["trl"] = None
    return env


def run_logged(cmd: list[str], logfile: Path, timeout: float | None = None, **kw) -> int:
    """Run `cmd`, its output appended to `logfile` and its tail echoed on failure."""
    with logfile.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, **kw)
        except subprocess.TimeoutExpired:
            f.write(f"\n(timed out after {timeout} s)\n")
            return 124
    if done.returncode:
        tail = logfile.read_text(errors="replace")[-3000:]
        log(f"exit {done.returncode}: {' '.join(cmd[:4])} ...\n{tail}")
    return done.returncode


# ------------------------------------------------------------------ tests

def gpu_test_files() -> list[str]:
    """The test files that hold GPU tests (the others need packages a GPU image may lack)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text() or "needs_cuda" in p.read_text())


def part_tests(out: Path, logfile: Path) -> dict:
    xml = out / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *gpu_test_files()]
    start = time.perf_counter()
    code = run_logged(cmd, logfile, cwd=ROOT)
    result = {"exit_code": code, "seconds": round(time.perf_counter() - start, 1), "files": gpu_test_files()}
    if xml.exists():
        cases = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            status, why = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    status, why = ("failed" if tag != "skipped" else "skipped"), (el.get("message") or "")[:300]
            cases.append({"test": case.get("name"), "status": status, "why": why,
                          "seconds": float(case.get("time") or 0)})
        result["cases"] = cases
        for s in ("passed", "failed", "skipped"):
            result[s] = sum(c["status"] == s for c in cases)
    return result


# ------------------------------------------------------------------ posttrain runs

def train_in_subprocess(overrides: list[str], logfile: Path, tmp: Path) -> dict:
    """posttrain.driver.loop.train in a fresh process (its device memory is its own) ->
    the run's summary and every metrics line."""
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.run_dir="))
    script = ("import json, sys\nfrom posttrain.driver.build import build_run\nfrom posttrain.config import load_config\n"
              "from posttrain.driver.loop import train\n"
              "s = train(build_run(load_config(None, sys.argv[2:])))\n"
              "open(sys.argv[1], 'w').write(json.dumps(s, default=str))\n")
    summary_file = tmp / f"summary-{time.monotonic_ns()}.json"
    code = run_logged([sys.executable, "-c", script, str(summary_file), *overrides], logfile,
                      env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()] \
        if (Path(run_dir) / "metrics.jsonl").exists() else []
    return {"exit_code": code, "summary": json.loads(summary_file.read_text()) if summary_file.exists() else None,
            "lines": lines}


def part_default(dry_run: bool, device: str, logfile: Path, tmp: Path) -> dict:
    overrides = [f"trainer.device={device}", f"trainer.run_dir={tmp / 'default'}", "trainer.logger=[console]"]
    if dry_run:
        overrides += ["trainer.total_training_steps=2", "trainer.test_freq=2", "data.val_max_samples=32"]
    start = time.perf_counter()
    r = train_in_subprocess(overrides, logfile, tmp)
    steps = [m for m in r["lines"] if "timing_s/step" in m]
    s = r["summary"] or {}
    return {"exit_code": r["exit_code"], "wall_s": round(time.perf_counter() - start, 1),
            "val_before": s.get("val_before"), "val_after": s.get("val_after"), "steps": s.get("steps"),
            "train_s": s.get("seconds"), "median_step_s": statistics.median(m["timing_s/step"] for m in steps[1:])
            if len(steps) > 1 else None,
            "val_curve": [(m.get("step"), m["val/score/mean"]) for m in r["lines"] if "val/score/mean" in m]}


def work(dry_run: bool) -> dict:
    return DRY if dry_run else REAL


def throughput_overrides(model_dir: Path, data_file: Path, run_dir: Path, w: dict, steps: int, device: str
                         ) -> list[str]:
    """The throughput part's work (and the speed part's) in posttrain's config overrides."""
    import common

    return common.posttrain_overrides(model_dir, data_file, run_dir, w["prompts"], w["n"], w["response_length"],
                                      steps) + [
        f"trainer.device={device}", f"data.max_prompt_length={w['prompt_length']}",
        f"actor.ppo_micro_batch_size={w['micro']}", f"rollout.log_prob_micro_batch_size={w['log_prob_micro']}",
        f"ref.log_prob_micro_batch_size={w['log_prob_micro']}"]


def part_throughput(shape: str, model_dir: Path, data_file: Path, w: dict, steps: int, device: str,
                    logfile: Path, tmp: Path) -> dict:
    run_dir = tmp / f"tp-{shape}"
    r = train_in_subprocess(throughput_overrides(model_dir, data_file, run_dir, w, steps, device), logfile, tmp)
    steps_m = [m for m in r["lines"] if "timing_s/step" in m]
    measured = steps_m[1:] or steps_m  # the first step is warm-up

    def med(key):
        vals = [m[key] for m in measured if m.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {"exit_code": r["exit_code"], "steps": len(steps_m),
           "step_s": [round(m["timing_s/step"], 3) for m in steps_m], "median_step_s": med("timing_s/step"),
           "phases_s": {k: med(k) for k in sorted({k for m in measured for k in m if k.startswith("timing_s/")})},
           "tokens_per_s_per_gpu": med("perf/throughput"), "mfu_actor": med("perf/mfu/actor"),
           "mfu_rollout": med("perf/mfu/rollout"),
           "max_memory_allocated_gb": max((m["perf/max_memory_allocated_gb"] for m in steps_m
                                           if m.get("perf/max_memory_allocated_gb")), default=None),
           "prompt_length": med("prompt_length/mean"), "response_length": med("response_length/mean")}
    return out


def part_trl(shape: str, model_dir: Path, rows: list[dict], w: dict, steps: int, device: str, logfile: Path,
             tmp: Path) -> dict:
    try:
        import trl  # noqa: F401
    except ImportError:
        return {"skipped": "trl is not installed in this interpreter (bench/gpu/carry.py carries it)"}
    config = {"model_dir": str(model_dir), "rows": rows, "prompts": w["prompts"], "n": w["n"],
              "response_length": w["response_length"], "steps": steps, "threads": None, "lr": 1e-6, "beta": 0.04,
              "temperature": 1.0, "batch_split": w["trl_split"], "output_dir": str(tmp / f"trl-{shape}"),
              "device": device, "bf16": device == "cuda", "gradient_checkpointing": False}
    cfg_file, result_file = tmp / f"trl-{shape}.json", tmp / f"trl-{shape}-result.json"
    cfg_file.write_text(json.dumps(config))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false")
    code = run_logged([sys.executable, str(HERE.parent / "trl_side.py"), "--config", str(cfg_file),
                       "--out", str(result_file)], logfile, env=env)
    if code or not result_file.exists():
        return {"exit_code": code}
    r = json.loads(result_file.read_text())
    measured = r["step_s"][1:] or r["step_s"]
    return {"exit_code": 0, "step_s": [round(s, 3) for s in r["step_s"]], "median_step_s": statistics.median(measured),
            "batch_split": r["batch_split"], "max_memory_allocated_gb": r.get("max_memory_allocated_gb"),
            "completion_length": [r["completion_length_min"], r["completion_length_max"]],
            "versions": r["versions"]}


# ------------------------------------------------------------------ speed

SPEED_SHAPE = "qwen2.5-0.5b"


def override_value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def known_overrides(overrides: dict) -> tuple[list[str], list[str]]:
    """-> (the overrides whose keys posttrain's config schema has, as key=value; the keys it lacks)."""
    from posttrain.config.schema import schema

    keys = schema()
    return ([f"{k}={override_value(v)}" for k, v in overrides.items() if k in keys],
            [k for k in overrides if k not in keys])


def trl_python() -> tuple[str, str | None]:
    """-> (the interpreter for TRL's variants: $TRL_PYTHON or this one; why it cannot run them, or None)."""
    python = os.environ.get("TRL_PYTHON") or sys.executable
    done = subprocess.run([python, "-c", "import trl"], capture_output=True, text=True)
    return python, (None if done.returncode == 0 else
                    f"trl is not importable by {python} (bench/gpu/carry.py carries it; TRL_PYTHON names another)")


def speed_posttrain(name: str, overrides: dict, model_dir: Path, data_file: Path, w: dict, steps: int,
                    device: str, logfile: Path, tmp: Path, timeout: float | None) -> dict:
    import speed

    passed, dropped = known_overrides(overrides)
    run_dir = tmp / f"speed-{name}"
    summary_file, busy_file = tmp / f"speed-{name}-summary.json", tmp / f"speed-{name}-busy.json"
    cmd = [sys.executable, str(HERE / "speed.py"), "posttrain", "--summary", str(summary_file), "--busy",
           str(busy_file), "--profile-step", str(steps), "--",
           *throughput_overrides(model_dir, data_file, run_dir, w, steps, device), *passed]
    start = time.perf_counter()
    code = run_logged(cmd, logfile, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = {"framework": "posttrain", "exit_code": code, "overrides": passed, "dropped_overrides": dropped,
           "wall_s": round(time.perf_counter() - start, 1)}
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if lines:
        out.update(speed.posttrain_result(lines, steps))
    out["busy"] = json.loads(busy_file.read_text()) if busy_file.exists() else None
    return out


def speed_trl(name: str, settings: dict, model_dir: Path, rows: list[dict], w: dict, steps: int, device: str,
              logfile: Path, tmp: Path, timeout: float | None) -> dict:
    python, missing = trl_python()
    if missing:
        return {"framework": "trl", "skipped": missing}
    cb = bool(settings.get("continuous_batching"))
    config = {"model_dir": str(model_dir), "rows": rows, "prompts": w["prompts"], "n": w["n"],
              "response_length": w["response_length"], "steps": steps, "threads": None, "lr": 1e-6, "beta": 0.04,
              "temperature": 1.0, "batch_split": w["trl_split"], "output_dir": str(tmp / f"speed-{name}"),
              "device": device, "bf16": device == "cuda", "gradient_checkpointing": False,
              "continuous_batching": cb, "phase_timers": True, "profile_step": steps,
              # continuous batching takes no min_new_tokens: EOS is off through its EOS id instead (trl_side.py)
              "strict_lengths": not cb}
    if cb and device == "cpu":  # its KV cache sized from the device's memory is most of the machine's RAM on a CPU
        config["continuous_batching_config"] = {"num_blocks": 16, "max_batch_tokens": 512}
    cfg_file, result_file = tmp / f"speed-{name}.json", tmp / f"speed-{name}-result.json"
    cfg_file.write_text(json.dumps(config))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    code = run_logged([python, str(HERE.parent / "trl_side.py"), "--config", str(cfg_file), "--out",
                       str(result_file)], logfile, timeout=timeout, env=env)
    out = {"framework": "trl", "exit_code": code, "settings": settings, "wall_s": round(time.perf_counter() - start, 1)}
    if code or not result_file.exists():
        return out
    r = json.loads(result_file.read_text())
    if "unavailable" in r:
        return {**out, "unavailable": r["unavailable"], "versions": r["versions"]}
    measured = list(range(2, steps)) or [steps]  # between the warm-up and the profiled step

    def med(values):
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals else None

    phases = r.get("phases_s") or []
    return {**out, "steps": len(r["step_s"]), "step_s": [round(s, 3) for s in r["step_s"]], "measured_steps": measured,
            "median_step_s": med([r["step_s"][i - 1] for i in measured]),
            "phases_s": {k: med([phases[i - 1].get(k) for i in measured if i <= len(phases)])
                         for k in ("gen", "old_log_prob", "ref", "update", "score_other", "generate_call")},
            "busy": r.get("busy"), "batch_split": r["batch_split"], "max_memory_allocated_gb": r.get("max_memory_allocated_gb"),
            "completion_length": [r["completion_length_min"], r["completion_length_max"]],
            "continuous_batching": r.get("continuous_batching"), "policy_dtype_after": r.get("policy_dtype_after"),
            "versions": r["versions"]}


def part_speed(model_dir: Path, data_file: Path, rows: list[dict], w: dict, steps: int, device: str, variants: list[str],
               logfile: Path, tmp: Path, res: Results, dry_run: bool) -> dict:
    """The speed part at SPEED_SHAPE: each variant in `variants` into res["speed"][shape]["variants"] as it
    finishes (the others kept)."""
    import speed

    shape = SPEED_SHAPE
    entry = res.data.get("speed", {}).get(shape, {})
    log(f"speed: measuring {device}'s matmul and copy peaks")
    peaks = speed.measure_peaks(device)
    parameters = shapes.parameter_count(model_dir)
    entry.update(work={**w, "steps": steps}, peaks=peaks, parameters=parameters,
                 floor=speed.floor(model_dir, parameters, w, peaks), static_decoding_in_config=
                 not known_overrides({"rollout.static_decoding": False})[1])
    entry.setdefault("variants", {})
    deadline = None if dry_run else time.monotonic() + SPEED_BUDGET_S
    for name in variants:
        kind, settings = SPEED_VARIANTS[name]
        timeout = None
        if deadline is not None:
            timeout = min(SPEED_VARIANT_TIMEOUT_S, deadline - time.monotonic())
            if timeout < 30:
                entry["variants"][name] = {"framework": kind, "skipped": f"the part's {SPEED_BUDGET_S} s were spent"}
                continue
        log(f"speed: {name}, {steps} steps")
        if kind == "posttrain":
            r = speed_posttrain(name, settings, model_dir, data_file, w, steps, device, logfile, tmp, timeout)
        else:
            r = speed_trl(name, settings, model_dir, rows, w, steps, device, logfile, tmp, timeout)
        if r.get("median_step_s"):
            r["percent_of_floor"] = speed.percent_of_floor(entry["floor"], r.get("phases_s", {}), r["median_step_s"])
        entry["variants"][name] = r
        res.set("speed", {**res.data.get("speed", {}), shape: entry})
    res.set("speed", {**res.data.get("speed", {}), shape: entry})
    return entry


# ------------------------------------------------------------------ the table

def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict) -> str:
    import common

    env = res.get("environment", {})
    rows = []
    t = res.get("tests")
    if t:
        bad = [c["test"] for c in t.get("cases", []) if c["status"] == "failed"]
        rows.append(["`pytest -m gpu`", f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                     f"{t.get('skipped', 0)} skipped" + (f" (failed: {', '.join(bad)})" if bad else ""),
                     f"{t['seconds']} s"])
        if env.get("device_count", 0) < 2:  # the tests run the multi-GPU code paths on one device at most
            rows.append(["several GPUs (tensor parallelism at TP > 1, FSDP2 over devices)",
                         f"not run: {env.get('device_count', 0)} GPU here; the TP path ran at TP = 1 on one GPU, "
                         "TP = 2 only on the CPU (gloo)", "-"])
    d = res.get("default")
    if d:
        rows.append(["embedded default (`posttrain train`)",
                     f"val/score/mean {fmt(d['val_before'])} -> {fmt(d['val_after'])} in {d['steps']} steps",
                     f"{fmt(d['train_s'], '.1f')} s ({fmt(d['median_step_s'], '.3f')} s/step)"])
    lines = [f"posttrain on {env.get('device', '?')}: torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl', '-')}, python "
             f"{env.get('python')}, trl {env.get('trl') or '-'}" + (" (DRY RUN on the CPU)" if env.get("dry_run") else ""),
             "", common.markdown_table(["check", "result", "time"], rows) if rows else ""]
    tp = res.get("throughput", {})
    if tp:
        w = res.get("work", {})
        lines += ["", f"GRPO at real shapes: {w.get('prompts')} prompts x {w.get('n')} samples, "
                      f"{w.get('prompt_length')}-token prompts, {w.get('response_length')}-token responses (EOS off), "
                      "KL loss to the reference, one update per step, "
                      f"{'float32 on the CPU' if env.get('dry_run') else 'bf16 autocast over float32 weights'}; "
                      "median of the steps after the first", ""]
        head = ["shape", "posttrain s/step", "gen", "old logp", "ref", "update", "tokens/s/GPU", "MFU actor",
                "MFU rollout", "peak GiB", "TRL s/step", "TRL peak GiB", "TRL / posttrain"]
        body = []
        for shape, p in tp.items():
            trl_r = res.get("trl", {}).get(shape, {})
            ph = p.get("phases_s", {})
            ratio = (trl_r["median_step_s"] / p["median_step_s"]) if trl_r.get("median_step_s") and \
                p.get("median_step_s") else None
            body.append([shape, fmt(p.get("median_step_s")), fmt(ph.get("timing_s/gen")),
                         fmt(ph.get("timing_s/old_log_prob")), fmt(ph.get("timing_s/ref")),
                         fmt(ph.get("timing_s/update_actor")), fmt(p.get("tokens_per_s_per_gpu"), ".0f"),
                         fmt(p.get("mfu_actor"), ".1%"), fmt(p.get("mfu_rollout"), ".1%"),
                         fmt(p.get("max_memory_allocated_gb"), ".1f"),
                         fmt(trl_r.get("median_step_s")) if "skipped" not in trl_r else "not run",
                         fmt(trl_r.get("max_memory_allocated_gb"), ".1f"), fmt(ratio, ".2f") + ("x" if ratio else "")])
        lines.append(common.markdown_table(head, body))
    if res.get("speed"):
        import speed

        lines.append(speed.speed_table(res["speed"], bool(env.get("dry_run"))).rstrip("\n"))
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="posttrain-gpu-"))
    p.add_argument("--dry-run", action="store_true", help="the CPU at tiny sizes (what the test suite runs)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--shapes", default=",".join(shapes.SHAPES))
    p.add_argument("--steps", type=int, help="steps per throughput run, the first a warm-up (default 3; dry 2); "
                                             "per speed variant, the first a warm-up and the last profiled (default 3; dry 2)")
    p.add_argument("--variants", default=",".join(SPEED_VARIANTS), help="the speed part's variants")
    args = p.parse_args()
    parts = [x for x in args.parts.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    unknown = set(parts) - set(PARTS) | set(args.shapes.split(",")) - set(shapes.SHAPES) | set(variants) - set(
        SPEED_VARIANTS)
    if unknown:
        p.error(f"unknown part, shape or variant {sorted(unknown)}; parts: {PARTS}, shapes: {list(shapes.SHAPES)}, "
                f"variants: {list(SPEED_VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logfile = out / "log.txt"
    res = Results(out)

    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device is visible: use --dry-run to run on the CPU")
        return 2
    res.set("environment", environment(args.dry_run))
    log(f"environment: {res.data['environment']}")
    steps = args.steps or (2 if args.dry_run else 3)
    w = work(args.dry_run)
    failed = False
    with tempfile.TemporaryDirectory(prefix="posttrain-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        built: dict[str, Path] = {}  # shape -> the model directory built for it
        if "tests" in parts:
            log(f"tests: pytest -m gpu over {gpu_test_files()}")
            res.set("tests", part_tests(out, logfile))
            failed |= res.data["tests"]["exit_code"] not in (0, 5)  # 5: nothing collected (no GPU tests left)
        if "default" in parts:
            log("default: the embedded default")
            res.set("default", part_default(args.dry_run, device, logfile, tmp))
            failed |= res.data["default"]["exit_code"] != 0
        if "throughput" in parts or "trl" in parts:
            from posttrain.data.schema import write_rows

            res.set("work", {**w, "steps": steps})
            for shape in args.shapes.split(","):
                log(f"{shape}: building a random-weight model on {device}")
                model_dir = built[shape] = shapes.make_model(shape, tmp / shape, device, dry_run=args.dry_run)
                rows = shapes.prompt_rows(model_dir, w["prompts"] * steps, w["prompt_length"])
                data_file = write_rows(rows, tmp / f"{shape}.parquet")
                info = {"parameters": shapes.parameter_count(model_dir)}
                if "trl" in parts:  # TRL first: a fresh process each, nothing of posttrain's in memory
                    log(f"{shape}: TRL GRPOTrainer, {steps} steps")
                    res.set("trl", {**res.data.get("trl", {}), shape: {**info, **part_trl(
                        shape, model_dir, rows, w, steps, device, logfile, tmp)}})
                if "throughput" in parts:
                    log(f"{shape}: posttrain, {steps} steps")
                    r = part_throughput(shape, model_dir, data_file, w, steps, device, logfile, tmp)
                    res.set("throughput", {**res.data.get("throughput", {}), shape: {**info, **r}})
                    failed |= r["exit_code"] != 0
        if "speed" in parts:
            speed_steps = args.steps or (2 if args.dry_run else 3)
            model_dir = built.get(SPEED_SHAPE)
            if model_dir is None:
                log(f"speed: {SPEED_SHAPE}, a random-weight model on {device}")
                model_dir = shapes.make_model(SPEED_SHAPE, tmp / SPEED_SHAPE, device, dry_run=args.dry_run)
            if device == "cuda":
                torch.cuda.empty_cache()  # the models were built here: their memory goes back before the variants run
            rows = shapes.prompt_rows(model_dir, w["prompts"] * speed_steps, w["prompt_length"])
            from posttrain.data.schema import write_rows

            data_file = write_rows(rows, tmp / f"speed-{SPEED_SHAPE}.parquet")
            entry = part_speed(model_dir, data_file, rows, w, speed_steps, device, variants, logfile, tmp, res,
                               args.dry_run)
            failed |= any(entry["variants"][v].get("exit_code") for v in variants
                          if entry["variants"][v].get("framework") == "posttrain")
    summary = table(res.data)
    (out / "summary.md").write_text(summary)
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
