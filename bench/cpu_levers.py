"""What each of the step's CPU levers saves, each against its peer, measured in the same run.

The shapes are SmolLM2-135M's at trl_grpo.py's work (16 prompts x 8 samples, 16 response tokens, training
micro-batches of 64 rows; hidden 576, vocabulary 49152), with random weights:

- reuse_cpu_memory (malloc.reuse_freed_memory): a training micro-batch's log-probs and entropy with their backward
  ([64, 16, 49152] logits), each side in a fresh process: glibc's malloc as it comes (large blocks mapped fresh
  and page-faulted in at every use) against malloc keeping what it frees;
- one log-softmax (training/logprobs.log_prob_and_entropy) against two passes (token_log_probs and
  entropy_from_logits), the same micro-batch, with the backward of the log-probs;
- the decoding step's output layer, [128, 576] x [576, 49152], in vocabulary slices (rollout/head.sliced_linear)
  against the plain torch.nn.Linear;
- a decoding step's sampling with its log-probs from one log-softmax (rollout/hf.next_tokens) against a softmax
  for sampling, then a second log-softmax for the log-probs (written out here as the peer).

The first lever's sides run in processes of their own; the others in this one, with reuse_cpu_memory on (as a
step runs them). Each time is the median of `--repeats` after a warm-up. Prints a markdown table: lever, peer s, lever s, peer/lever.
`--compiled-decode` adds a lever tried and not kept: generation on the bench model (16 prompts x 8 samples x 16
tokens) with the model's forward torch.compile'd (dynamic shapes), against eager, and the time its first call took.

    .venv/bin/python bench/cpu_levers.py [--threads 2] [--repeats 7] [--compiled-decode]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

import common

ROWS, RESPONSE, HIDDEN, VOCAB, DECODE_ROWS = 64, 16, 576, 49152, 128


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def logits_and_tokens(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, RESPONSE, VOCAB, generator=g) * 3, torch.randint(0, VOCAB, (ROWS, RESPONSE), generator=g)


def one_pass(logits, tokens) -> None:
    from posttrain.training.logprobs import log_prob_and_entropy

    x = logits.clone().requires_grad_()
    log_prob, _ = log_prob_and_entropy(x, tokens)
    log_prob.sum().backward()


def two_passes(logits, tokens) -> None:
    from posttrain.algorithms.losses import entropy_from_logits
    from posttrain.training.logprobs import token_log_probs

    x = logits.clone().requires_grad_()
    log_prob = token_log_probs(x, tokens)
    with torch.no_grad():
        entropy_from_logits(x)
    log_prob.sum().backward()


def child(mode: str, threads: int, repeats: int) -> None:
    """The malloc lever's side: one_pass timed in this fresh process. Prints its seconds."""
    torch.set_num_threads(threads)
    if mode == "reuse":
        from posttrain.runtime.malloc import reuse_freed_memory

        assert reuse_freed_memory(), "malloc.reuse_freed_memory needs Linux with glibc"
    logits, tokens = logits_and_tokens()
    print(timed(lambda: one_pass(logits, tokens), repeats))


def malloc_row(threads: int, repeats: int) -> list:
    def side(mode):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--threads", str(threads),
                              "--repeats", str(repeats)], capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    peer, lever = side("plain"), side("reuse")
    return ["reuse_cpu_memory: log-probs + entropy + backward, [64, 16, 49152]", peer, lever]


def head_row(repeats: int) -> list:
    from posttrain.rollout.head import sliced_linear

    layer = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(DECODE_ROWS, 1, HIDDEN)
    with torch.no_grad():
        peer = timed(lambda: layer(hidden), repeats)
        lever = timed(lambda: sliced_linear(layer, hidden), repeats)
    return ["decoding's output layer in vocabulary slices, [128, 576] x [576, 49152]", peer, lever]


def sampling_row(repeats: int) -> list:
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import next_tokens

    g = torch.Generator().manual_seed(1)
    logits, uniform = torch.randn(DECODE_ROWS, VOCAB, generator=g) * 3, torch.rand(DECODE_ROWS, generator=g)
    params = SamplingParams(max_new_tokens=1, temperature=0.9)

    def peer():  # a softmax to sample from, the last token with mass found by a pass of its own, a log-softmax
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        cdf = probs.cumsum(dim=-1)
        token = torch.searchsorted(cdf, (uniform[:, None] * cdf[:, -1:]).contiguous(), right=True).squeeze(-1)
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
        token = torch.minimum(token, last)
        return torch.log_softmax(logits.float() / params.temperature, -1).gather(-1, token[:, None])

    return ["a decoding step's sampling and log-probs, 128 x 49152", timed(peer, repeats),
            timed(lambda: next_tokens(logits, params, uniform, True), repeats)]


def compiled_decode_row(repeats: int) -> list:
    """A lever tried and not kept: the bench model's forward torch.compile'd (dynamic shapes) for generation,
    against eager; the time to compile is reported beside."""
    import tempfile
    from pathlib import Path

    from posttrain.models.loader import load_model, load_tokenizer
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = common.make_model(Path(tmp) / "model")
        tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
               for row in common.make_prompts(16)]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    engine = HFRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, progress=False)
    params = SamplingParams(n=8, max_new_tokens=16, temperature=1.0, ignore_eos=True, logprobs=True)
    eager = timed(lambda: engine.generate(prompts, params), repeats)
    model.forward = torch.compile(model.forward, dynamic=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    first = time.perf_counter() - start
    return [f"(not kept) the 3M bench model's generation with its forward torch.compile'd; the first call, "
            f"compiling, took {first:.1f} s", eager, timed(lambda: engine.generate(prompts, params), repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--compiled-decode", action="store_true", help="also the lever tried and not kept (a minute)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.threads, args.repeats)
    torch.set_num_threads(args.threads)
    first = malloc_row(args.threads, args.repeats)
    from posttrain.runtime.malloc import reuse_freed_memory

    reuse_freed_memory()  # the other levers as a step runs them: with it
    logits, tokens = logits_and_tokens()
    rows = [first,
            ["one log-softmax for log-probs and entropy, + backward, [64, 16, 49152]",
             timed(lambda: two_passes(logits, tokens), args.repeats),
             timed(lambda: one_pass(logits, tokens), args.repeats)],
            head_row(args.repeats), sampling_row(args.repeats)]
    if args.compiled_decode:
        rows.append(compiled_decode_row(args.repeats))
    print(f"# {args.threads} threads, median of {args.repeats}; {common.versions()}")
    print(common.markdown_table(["lever", "peer s", "lever s", "peer / lever"],
                                [[name, f"{a:.4f}", f"{b:.4f}", f"{a / b:.2f}x"] for name, a, b in rows]))


if __name__ == "__main__":
    main()
