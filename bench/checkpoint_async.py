"""Does a checkpoint being written slow training down?

Runs the embedded default (tiny model, arith, 32 prompts x 8 samples) and
times RL steps three ways, in one process:
  - no save at all;
  - a step that starts right after an async save was started (the write runs
    in a background thread during the step; the snapshot copy is counted);
  - a step followed by a synchronous save (the peer: what async avoids).
Prints median seconds and the ratios to the no-save step.

    .venv/bin/python bench/checkpoint_async.py [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.driver.lifecycle import save
from posttrain.driver.loop import rl_step


def timed_steps(run, n: int, before_step=None, after_step=None) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        if before_step:
            before_step()
        _, indices = run.sampler.next_batch()
        rl_step(run, [run.train_data[i] for i in indices])
        run.global_step += 1
        if after_step:
            after_step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(load_config(None, [f"trainer.run_dir={tmp}", "trainer.logger=[]"]))
        timed_steps(run, 2)  # warm-up
        plain = timed_steps(run, args.steps)
        run.writer.async_save = True
        inflight = timed_steps(run, args.steps, before_step=lambda: save(run, {}, run.kl_ctrl, run.ahead))
        run.writer.wait()
        run.writer.async_save = False
        synced = timed_steps(run, args.steps, after_step=lambda: save(run, {}, run.kl_ctrl, run.ahead))
    base = statistics.median(plain)
    print("per step:", [round(t, 2) for t in plain], [round(t, 2) for t in inflight], [round(t, 2) for t in synced])
    print(f"step, no save:                        {base:.3f} s (median of {args.steps})")
    print(f"step, async save in flight (+copy):   {statistics.median(inflight):.3f} s  "
          f"ratio {statistics.median(inflight) / base:.3f}")
    print(f"step + synchronous save (peer):       {statistics.median(synced):.3f} s  "
          f"ratio {statistics.median(synced) / base:.3f}")


if __name__ == "__main__":
    main()
