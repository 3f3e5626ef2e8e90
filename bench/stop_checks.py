"""rollout.stop_check_every on this machine: the hf engine's generate() with a stop check every k tokens, the
settings alternating in one process, and the host syncs each makes.

The embedded model, 16 arith prompts x 8 samples, a 64-token budget, sampled at temperature 1 with EOS on
(the model's EOS ends its answers within a few tokens; --eos 5 ends a response at its first '5' instead, so
responses end anywhere in the budget and ended rows leaving the batch matters). Prints, per k, the median
seconds of a generate() call over --rounds rounds (after one warm-up call each), its ratio to k=1, and its host
syncs per decoding step (runtime/syncs.py: each would drain a GPU's queue). --static adds, per k, the
static-shape step (rollout.static_decoding; eager here, as on any CPU) beside the eager loop.

    .venv/bin/python bench/stop_checks.py [--k 1,4,8,16] [--rounds 7] [--threads 2] [--eos 5] [--static]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", default="1,4,8,16", help="stop_check_every values (the first is the yardstick)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--eos", default=None, help="a token that ends a response instead of the model's EOS")
    p.add_argument("--static", action="store_true", help="each k with rollout.static_decoding too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from posttrain.data.arith import prompt_text
    from posttrain.models import load_model, load_tokenizer
    from posttrain.models.loader import eos_token_ids
    from posttrain.models.shipped import embedded_model
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.runtime.syncs import HostSyncs

    path = embedded_model()
    tok, model = load_tokenizer(path), load_model(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": prompt_text(10 + 7 * i, 95 - 5 * i)}],
                                       add_generation_prompt=True, tokenize=True) for i in range(16)]
    prompts = [x if isinstance(x, list) else x["input_ids"] for x in prompts]
    params = SamplingParams(n=8, max_new_tokens=args.max_new_tokens, temperature=1.0)
    ks = [int(k) for k in args.k.split(",")]
    eos = eos_token_ids(tok, model) if args.eos is None else [tok.convert_tokens_to_ids(args.eos)]
    variants = [(k, static) for k in ks for static in ((False, True) if args.static else (False,))]
    engines = {(k, static): HFRolloutEngine(model, eos, tok.pad_token_id, progress=False, stop_check_every=k,
                                            static_decoding=static) for k, static in variants}
    times = {v: [] for v in variants}
    syncs = {}
    for v, engine in engines.items():  # warm-up, and the syncs per decoding step
        forwards = []
        handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
        with HostSyncs() as counted:
            engine.generate(prompts, params)
        handle.remove()
        syncs[v] = counted.count / len(forwards)
    for _ in range(args.rounds):
        for v, engine in engines.items():
            start = time.perf_counter()
            engine.generate(prompts, params)
            times[v].append(time.perf_counter() - start)
    base = statistics.median(times[variants[0]])
    print(f"| stop_check_every | decoding | s per generate (median of {args.rounds}) | vs k={ks[0]}, eager loop "
          "| host syncs per step |")
    print("|---|---|---|---|---|")
    for v in variants:
        t = statistics.median(times[v])
        print(f"| {v[0]} | {'static step' if v[1] else 'eager loop'} | {t:.3f} ({min(times[v]):.3f}..{max(times[v]):.3f}) "
              f"| {t / base:.2f}x | {syncs[v]:.3f} |")


if __name__ == "__main__":
    main()
