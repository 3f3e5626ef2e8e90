"""LoRA sampling: the hf engine with the adapters applied (peft's layers: the
base's matmul plus the low-rank one, what posttrain runs) against a merged
copy (W + (alpha / r) B A in one matrix), the base alone as the floor.

The work is one step's generation: `--prompts` x `--n` samples of exactly
`--tokens` tokens (EOS off) from the model at `--model` (default: the
benchmark model, common.make_model) with rank `--rank` adapters on every
linear layer, their B matrices random (trained adapters). Each variant runs
`--repeats` times, alternating; the table gives the median seconds and the
ratio to the merged copy. Merging costs a copy of the model (or changes the
base in place, which the reference model of a LoRA run needs unchanged).

    .venv/bin/python bench/lora_rollout.py [--model DIR] [--rank 16] [--prompts 16] [--n 8] [--tokens 24]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

import common


def main() -> None:
    from posttrain.data.dataset import encode_prompt
    from posttrain.models.loader import eos_token_ids, load_model, load_tokenizer
    from posttrain.models.lora import LoraSettings, add_adapters
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model directory (default: the benchmark model)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model_dir = args.model or common.make_model(tempfile.mkdtemp(prefix="bench-lora-"))
    tokenizer = load_tokenizer(model_dir)
    base = load_model(model_dir).eval()
    torch.manual_seed(0)
    lora = add_adapters(copy.deepcopy(base), LoraSettings(rank=args.rank, alpha=2 * args.rank)).eval()
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.02)  # trained adapters are not zero
    merged = copy.deepcopy(lora).merge_and_unload().eval()
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in common.make_prompts(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens, n=args.n, temperature=1.0, ignore_eos=True)
    eos = eos_token_ids(tokenizer, base)
    times: dict[str, list[float]] = {"adapters applied": [], "merged copy": [], "base alone": []}
    models = {"adapters applied": lora, "merged copy": merged, "base alone": base}
    for _ in range(args.repeats):
        for name, model in models.items():
            engine = HFRolloutEngine(model, eos, tokenizer.pad_token_id, seed=0, progress=False)
            start = time.perf_counter()
            engine.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
    ref = statistics.median(times["merged copy"])
    print(f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens, rank {args.rank}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'variant':<18} {'seconds':>8} {'vs merged':>10}")
    for name, ts in times.items():
        print(f"{name:<18} {statistics.median(ts):8.2f} {statistics.median(ts) / ref:9.2f}x")


if __name__ == "__main__":
    main()
