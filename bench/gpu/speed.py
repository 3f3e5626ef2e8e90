"""The `speed` part of bench/gpu/suite.py: posttrain's levers on and off against
TRL's GRPOTrainer, phase by phase, with each variant's GPU busy fraction and
the step's floor on this device.

What lives here (suite.py holds the variants, LEVERS_OFF among them, and runs them):

- `measure_peaks`: this device's bf16 matmul FLOP/s (an 8192^3 matmul timed;
  float32 at 512^3 on the CPU) and its memory bandwidth (a 1 GiB copy timed,
  read + write; 64 MiB on the CPU);
- `floor`: bench/step_floor.py's model at the device's measured peaks, for the
  work itself (the same for every variant): each phase's FLOPs (posttrain's
  count, metrics/flops.ModelFlops: generation with each prompt prefilled once,
  the reference pass a forward, the update a forward and backward) and bytes
  (bf16 weights read once per forward, a decoding step's KV cache read per
  sequence, the logits written, the update's gradients and AdamW's float32
  state), the phase's floor the larger of FLOPs / peak and bytes / bandwidth,
  the step's floor their sum; "% of floor" = floor / measured;
- `run_posttrain` (`python bench/gpu/speed.py posttrain ...`): posttrain's
  training loop in a process of its own, one step profiled for the busy
  fraction (busy.py) by standing in for the run's step profiler;
- `speed_table`: the Markdown table of results["speed"].
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

import busy

# the timing_s/* metrics of posttrain's loop compared with TRL's phases
POSTTRAIN_PHASES = {"gen": "timing_s/gen", "old_log_prob": "timing_s/old_log_prob", "ref": "timing_s/ref",
                    "update": "timing_s/update_actor"}
BF16 = 2  # bytes


# ------------------------------------------------------------------ the device's peaks

def measure_peaks(device: str) -> dict:
    """-> matmul FLOP/s and copy bytes/s (read + write) measured on `device`, best of the timed repeats."""
    import torch

    out = _measure(device)
    if device == "cuda":
        from posttrain.metrics.flops import gpu_peak_flops

        out["datasheet_flops"] = gpu_peak_flops(torch.cuda.get_device_name(0))
        torch.cuda.empty_cache()  # the operands are gone: their memory goes back to the device
    return out


def _measure(device: str) -> dict:
    import torch

    cuda = device == "cuda"
    n, dtype, reps = (8192, torch.bfloat16, 20) if cuda else (512, torch.float32, 5)
    copy_bytes = 2 ** 30 if cuda else 64 * 2 ** 20
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        for _ in range(3):  # warm-up: cuBLAS heuristics, clocks
            fn()
        times = []
        for _ in range(reps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return min(times)

    matmul_s = best(lambda: torch.matmul(a, b))
    copy_s = best(lambda: dst.copy_(src))
    return {"matmul_flops": 2.0 * n ** 3 / matmul_s, "matmul": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
            "copy_bytes_per_s": 2.0 * copy_bytes / copy_s, "copy": f"{copy_bytes // 2 ** 20} MiB, read + write"}


# ------------------------------------------------------------------ the floor

def floor(model_dir: Path, parameters: int, w: dict, peaks: dict) -> dict:
    """Each phase's FLOPs, bytes and floor (seconds) for the work `w` (prompts x n, prompt_length,
    response_length) on a device with `peaks` (measure_peaks); "step": the phases' sum."""
    import torch

    from posttrain.metrics.flops import ModelFlops

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    mf = ModelFlops.from_config(cfg)
    rows, n, p, r = w["prompts"] * w["n"], w["n"], w["prompt_length"], w["response_length"]
    vocab, layers = cfg["vocab_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = 2 * layers * (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim * BF16
    prompt_t, response_t = torch.full((rows,), float(p)), torch.full((rows,), float(r))
    forward = mf.training(prompt_t + response_t) / (1.0 + mf.backward_factor)
    logits = rows * r * vocab * BF16  # the response positions' logits, written once
    weights = BF16 * mf.matmul_params  # every weight read once by a forward (the batch in one pass)
    phases = {
        # prefill once, then r - 1 decoding steps; step j reads every sequence's p + j cached keys and values
        "gen": (mf.rollout(prompt_t, response_t, samples_per_prefill=n),
                weights * r + rows * kv_per_token * ((r - 1) * p + (r - 1) * r / 2) + logits),
        "ref": (forward, weights + logits),
        # forward and backward: weights read 3 times, logits written and their gradient read and written;
        # float32 gradients written, AdamW reads parameters, gradients, both moments and writes three back
        "update": (mf.training(prompt_t + response_t), 3 * weights + 3 * logits + (4 + 28) * parameters),
    }
    out = {}
    for name, (flops, nbytes) in phases.items():
        compute, memory = flops / peaks["matmul_flops"], nbytes / peaks["copy_bytes_per_s"]
        out[name] = {"flops": flops, "bytes": float(nbytes), "compute_s": compute, "memory_s": memory,
                     "floor_s": max(compute, memory), "bound": "compute" if compute >= memory else "memory"}
    out["step"] = {"flops": sum(v["flops"] for v in out.values()), "bytes": sum(v["bytes"] for v in out.values()),
                   "floor_s": sum(v["floor_s"] for v in out.values())}
    return out


def percent_of_floor(fl: dict | None, phases: dict, step_s: float | None) -> dict:
    """floor / measured per phase (gen, ref, update) and for the step; None where either is missing."""
    if not fl:
        return {}
    measured = {**{k: phases.get(k) for k in ("gen", "ref", "update")}, "step": step_s}
    return {k: (fl[k]["floor_s"] / v if v else None) for k, v in measured.items()}


# ------------------------------------------------------------------ posttrain in its own process

class OneStepBusy:
    """Stands in for a run's step profiler (runtime/profiling.StepProfiler): step `profile_step` runs under
    busy.StepBusy, its result written to `out`; every step also goes through the run's own profiler."""

    def __init__(self, inner, profile_step: int, out: Path):
        self.inner, self.profile_step, self.out = inner, profile_step, out

    enabled = property(lambda self: self.inner.enabled)

    def profiles(self, step: int) -> bool:
        return self.inner.profiles(step)

    @contextmanager
    def step(self, n: int):
        with self.inner.step(n):
            if n != self.profile_step:
                yield
                return
            result: dict = {"step": n}
            with busy.profiled_step(result):
                yield
            self.out.write_text(json.dumps(result))

    def close(self) -> None:
        self.inner.close()


def run_posttrain(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="speed.py posttrain")
    p.add_argument("--summary", required=True, help="train()'s summary is written here (JSON)")
    p.add_argument("--busy", required=True, help="the profiled step's busy fraction is written here (JSON)")
    p.add_argument("--profile-step", type=int, default=0, help="the step (from 1) to profile; 0: none")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from posttrain.config import load_config
    from posttrain.driver.build import build_run
    from posttrain.driver.loop import train

    if args.profile_step:
        busy.prepare_for_cuda_graphs()  # before the engine captures its decoding step's graph
    run = build_run(load_config(None, args.overrides))
    if args.profile_step:
        run.profiler = OneStepBusy(run.profiler, args.profile_step, Path(args.busy))
    summary = train(run)
    Path(args.summary).write_text(json.dumps(summary, default=str))
    return 0


def posttrain_result(lines: list[dict], profile_step: int) -> dict:
    """A posttrain variant's numbers from its metrics lines: the steps after the first (warm-up) and before
    the profiled one (when there is another), medians of step and phase seconds."""
    steps_m = [m for m in lines if "timing_s/step" in m]
    measured = [m for i, m in enumerate(steps_m, 1) if i > 1 and i != profile_step] or steps_m[1:] or steps_m

    def med(key):
        vals = [m[key] for m in measured if m.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"steps": len(steps_m), "step_s": [round(m["timing_s/step"], 3) for m in steps_m],
            "measured_steps": [i for i, m in enumerate(steps_m, 1) if m in measured],
            "median_step_s": med("timing_s/step"),
            "phases_s": {k: med(key) for k, key in POSTTRAIN_PHASES.items()},
            "all_timings_s": {k: med(k) for k in sorted({k for m in measured for k in m if k.startswith("timing_s/")})},
            "response_length": med("response_length/mean"), "prompt_length": med("prompt_length/mean"),
            "max_memory_allocated_gb": max((m["perf/max_memory_allocated_gb"] for m in steps_m
                                            if m.get("perf/max_memory_allocated_gb")), default=None)}


# ------------------------------------------------------------------ the table

def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _step_s(v: dict | None) -> float | None:
    v = v or {}
    return None if v.get("skipped") or v.get("unavailable") or v.get("exit_code") else v.get("median_step_s")


def speed_table(speed: dict, dry_run: bool) -> str:
    import common

    lines = []
    for shape, s in speed.items():
        variants, fl, peaks = s.get("variants", {}), s.get("floor"), s.get("peaks") or {}

        trl_gen, trl_cb = (_step_s(variants.get(name)) for name in ("trl_generate", "trl_continuous_batching"))
        w = s.get("work", {})
        header = (f"speed at {shape}: {w.get('prompts')} prompts x {w.get('n')} samples, "
                  f"{w.get('prompt_length')}-token prompts, {w.get('response_length')}-token responses (EOS off), "
                  f"{'float32 on the CPU (DRY RUN)' if dry_run else 'bf16 autocast over float32 weights'}; "
                  f"median of the steps between the warm-up and the profiled last step; measured peaks "
                  f"{_f(peaks.get('matmul_flops', 0) / 1e12, '.3g')} TFLOP/s ({peaks.get('matmul', '-')}), "
                  f"{_f(peaks.get('copy_bytes_per_s', 0) / 1e9, '.0f')} GB/s; step floor "
                  f"{_f((fl or {}).get('step', {}).get('floor_s'), '.3f')} s")
        lines += ["", header, ""]
        head = ["variant", "s/step", "gen s", "ref s", "old logp s", "update s", "vs TRL generate()",
                "vs TRL CB", "% of floor (gen/ref/update/step)", "busy"]
        body = []
        for name, v in variants.items():
            if v.get("skipped") or v.get("unavailable") or v.get("exit_code"):
                why = v.get("skipped") or v.get("unavailable") or f"failed (exit {v.get('exit_code')})"
                body.append([name, why] + ["-"] * (len(head) - 2))
                continue
            step, ph = v.get("median_step_s"), v.get("phases_s", {})
            pct = v.get("percent_of_floor", {})
            body.append([name, _f(step), _f(ph.get("gen")), _f(ph.get("ref")), _f(ph.get("old_log_prob")),
                         _f(ph.get("update")),
                         _f(trl_gen / step if trl_gen and step else None) + ("x" if trl_gen and step else ""),
                         _f(trl_cb / step if trl_cb and step else None) + ("x" if trl_cb and step else ""),
                         "/".join(_f(pct.get(k) and 100 * pct[k], ".1f") for k in ("gen", "ref", "update", "step")),
                         _f((v.get("busy") or {}).get("busy_fraction"), ".0%")])
        notes = [f"{name}: not passed, not in this posttrain's config: {', '.join(v['dropped_overrides'])}"
                 for name, v in variants.items() if v.get("dropped_overrides")]
        notes += [f"{name}: the policy was {v['policy_dtype_after']} after training (TRL casts it in place to generate)"
                  for name, v in variants.items() if v.get("policy_dtype_after") not in (None, "float32")]
        lines += [f"- {n}" for n in notes] + ([""] if notes else [])
        lines.append(common.markdown_table(head, body))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["posttrain"]:
        sys.exit(run_posttrain(sys.argv[2:]))
    sys.exit("usage: python bench/gpu/speed.py posttrain --summary F --busy F [--profile-step N] OVERRIDES...")
