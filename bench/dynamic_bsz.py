"""Token-budget micro-batches (actor.use_dynamic_bsz) against micro-batches of
a fixed number of sequences, on responses of mixed lengths.

The work is one RL step's training passes (what the micro-batching cuts up):
the policy's log-prob pass and one PPO update, over `--prompts` x `--n`
sequences of the benchmark model (common.make_model) whose response lengths
are drawn uniformly from `--min-len`..`--max-len` (prompts of about 30 to 60
tokens: common.make_prompts), so a fixed-count micro-batch mixes short and
long rows. Each setting runs `--repeats` times in this process, alternating,
and the table reports the median seconds of the two passes together and the
MFU (model FLOPs of the real tokens: flops.ModelFlops, over the CPU's
measured peak).

    .venv/bin/python bench/dynamic_bsz.py [--prompts 16] [--n 8] [--min-len 8] [--max-len 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

import common


def synthetic_batch(model_dir: Path, prompts: int, n: int, min_len: int, max_len: int, seed: int = 0):
    """A RolloutBatch as a rollout would give it: the benchmark prompts, n random
    responses each of a random length in [min_len, max_len], random advantages."""
    from posttrain.driver.batch import RolloutBatch
    from posttrain.models import load_tokenizer
    from posttrain.rollout.base import RolloutOutput
    from posttrain.rollout.hf import left_pad

    tok = load_tokenizer(str(model_dir))
    rows = common.make_prompts(prompts, seed)
    ids = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    width = max(map(len, ids))
    p_ids, p_mask = left_pad(ids, tok.pad_token_id, width)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (prompts * n,), generator=g)
    resp = torch.randint(0, 256, (prompts * n, max_len), generator=g)
    mask = (torch.arange(max_len)[None, :] < lengths[:, None]).long()
    out = RolloutOutput(prompt_ids=p_ids.repeat_interleave(n, 0), prompt_mask=p_mask.repeat_interleave(n, 0),
                        response_ids=resp * mask + tok.pad_token_id * (1 - mask), response_mask=mask)
    batch = RolloutBatch.from_rollout(out, n, ["arith"] * prompts, ["0"] * prompts, [{}] * prompts,
                                      ["x"] * (prompts * n))
    batch.advantages = torch.randn(batch.responses.shape, generator=g) * batch.response_mask
    return batch


def run_passes(model, batch, micro: int, budget: int | None) -> float:
    """Seconds of the log-prob pass and one PPO update (one mini-batch)."""
    from posttrain.training.actor import UpdateSettings, make_optimizer, update_policy
    from posttrain.training.logprobs import compute_log_probs

    model = copy.deepcopy(model)
    opt = make_optimizer(model, 1e-6, 0.0, (0.9, 0.999))
    start = time.perf_counter()
    batch.old_log_probs, _ = compute_log_probs(model, batch, micro, max_tokens=budget)
    update_policy(model, opt, batch, UpdateSettings(mini_batch_size=len(batch), micro_batch_size=micro,
                                                    micro_max_tokens=budget))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fixed", default="8,32,128", help="micro-batch sizes (sequences) to compare")
    p.add_argument("--budgets", default="2048,4096,8192,16384", help="token budgets to compare")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from posttrain.metrics.flops import ModelFlops, cpu_peak_flops
    from posttrain.models import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = common.make_model(Path(tmp) / "model")
        model = load_model(str(model_dir))
        batch = synthetic_batch(model_dir, args.prompts, args.n, args.min_len, args.max_len)
        real = batch.attention_mask.sum(-1)
        # the log-prob pass is a forward (1/3 of forward + backward), the update forward + backward
        flops = ModelFlops.from_model_dir(model_dir).training(real) * (1 + 1 / 3)
        peak = cpu_peak_flops(args.threads)
        settings = [(f"fixed {m} sequences", m, None) for m in map(int, args.fixed.split(","))]
        settings += [(f"token budget {b}", 8, b) for b in map(int, args.budgets.split(","))]
        run_passes(model, batch, 8, None)  # warm-up
        times: dict[str, list[float]] = {name: [] for name, _, _ in settings}
        for _ in range(args.repeats):
            for name, micro, budget in settings:
                times[name].append(run_passes(model, batch, micro, budget))
    print(f"{args.prompts} prompts x {args.n} samples, responses of {args.min_len}..{args.max_len} tokens "
          f"(mean {float(batch.response_mask.sum(-1).float().mean()):.0f}), prompts of "
          f"{int(batch.attention_mask[:, :batch.prompt_width].sum(-1).min())}.."
          f"{int(batch.attention_mask[:, :batch.prompt_width].sum(-1).max())} tokens; log-prob pass + one update; "
          f"median of {args.repeats}; {common.versions()}")
    from posttrain.training.microbatch import micro_batches

    base = statistics.median(times[settings[0][0]])
    rows = []
    for name, micro, budget in settings:
        med = statistics.median(times[name])
        rows.append([name, len(micro_batches(batch, micro, True, budget)), f"{med:.2f}", f"{base / med:.2f}x",
                     f"{flops / med / peak:.1%}"])
    print(common.markdown_table(["micro-batches", "passes per pass type", "s", f"vs {settings[0][0]}", "MFU"],
                                rows))


if __name__ == "__main__":
    main()
