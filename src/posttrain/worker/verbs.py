"""What one device does: the worker verbs.

A `Worker` holds the policy (with its optimizer), the reference model and
the rollout engine of one device, colocated. The driver calls its verbs:
`generate`, `compute_log_probs`, `train_step`, `sync_weights`,
`save_shards`, `load_checkpoint`. In one process the driver owns a single
Worker; on a Ray cluster a `distributed.WorkerGroup` runs one per device
and calls the same verbs on all of them.

Each verb is short: the models are loaded and placed by worker/models.py,
the passes without gradients run in worker/passes.py, and the rollout
engine is a `worker.rollout.Rollout` (in this process, or a process of its
own with asynchronous training) that the verbs call without asking which.
With more than one worker, the policy and reference are sharded with FSDP2
and the engine samples from weights of its own, refreshed by
`sync_weights` after each update (worker/weights.py says which and how).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.pool import RolloutPool
from posttrain.training.actor import move_optimizer_state, update_policy
from posttrain.worker import models, passes, process
from posttrain.worker.engines import autocast_of, engine_dtype_of, rollout_dtype_of
from posttrain.worker.rollout import make_rollout
from posttrain.worker.spec import WorkerSpec
from posttrain.worker.weights import has_rollout_copy, make_rollout_copy, merged_rollout, pushed_at_start


@contextlib.contextmanager
def optimizer_state_on_device(optimizer, offload: bool):
    """With `offload`, the optimizer's state sits on the CPU except during an update."""
    if offload:
        move_optimizer_state(optimizer, to_cpu=False)
    try:
        yield
    finally:
        if offload:
            move_optimizer_state(optimizer, to_cpu=True)


class Worker:
    """The verbs of one device. `rank`/`world_size` > 1 only inside a worker group.
    `sharded` (default: world_size > 1) joins a process group and shards with FSDP2;
    a `WorkerGroup` always shards, at a world size of 1 too (parameter offload is FSDP2's)."""

    def __init__(self, spec: WorkerSpec, rank: int = 0, world_size: int = 1, sharded: bool | None = None):
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.sharded = world_size > 1 if sharded is None else sharded
        self.teachers: dict = {}  # distillation: key (None with one teacher) -> frozen model
        self.teacher_tps: dict = {}  # key -> the teacher's TensorParallel (the policy's, or of its own size), or None
        self.policy = self.ref = self.optimizer = self.scheduler = self.tokenizer = None
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        self.sp = None  # training.ulysses.SequenceParallel, with sequence_parallel > 1
        self.tp = None  # training.tensor_parallel.TensorParallel, with tensor_parallel > 1
        self.rollout = None  # worker.rollout.Rollout: the engine, local or in a process of its own

    # ------------------------------------------------------------ building

    def setup(self, init_method: str | None = None) -> dict:
        """Join the process group (when sharded), load and shard the models,
        make the optimizer and the rollout engine. -> where this worker runs."""
        s = self.spec  # the order is the contract: environment, process group, models, sharding, optimizer, engine
        device = process.prepare_process(s)
        if self.sharded:
            process.init_process_group(s, self.rank, self.world_size, init_method, device)
        torch.manual_seed(s.seed)
        kwargs = models.model_kwargs(s, device)
        self.tokenizer, self.policy, eos = models.load_policy(s, kwargs, self.rank)
        # the hf engine's own model is made before sharding: it is whole
        copy = make_rollout_copy(s, self.policy, kwargs) if has_rollout_copy(s, self.sharded) else None
        mesh = models.tensor_parallel_mesh(s, self.world_size, device) if self.sharded else None
        self.tp = models.place_policy(s, self.policy, self.sharded, mesh)
        self.ref, self.teachers, self.teacher_tps = models.load_frozen(s, kwargs, self.sharded, self.rank, mesh,
                                                                       self.world_size)
        self.optimizer, self.scheduler = models.optimizer_of(self.policy, s)
        if s.critic is not None:
            self.critic, self.critic_optimizer, self.critic_scheduler = models.load_critic(
                s, kwargs, self.tokenizer, self.sharded, mesh)
        if s.sequence_parallel > 1 and self.sharded:  # after the rollout's copy was made: it samples whole rows
            self.sp = models.sequence_parallel(s.sequence_parallel, self.rank, self.world_size,
                                               (self.policy, self.ref, self.critic, *self.teachers_of_sp()),
                                               s.tensor_parallel)
        self.rollout = make_rollout(s, self.policy, copy, eos, self.tokenizer.pad_token_id, self.rank, self.sharded)
        if pushed_at_start(s, self.rollout.history):
            self.rollout.push_weights(self.policy, restart=True)
        flops = process.peak_flops(s, device)
        return {**self.info(), "device": str(device), "pad_token_id": self.tokenizer.pad_token_id,
                "device_name": flops["device_name"], "peak_flops": flops["peak_flops"],
                "sequence_parallel": self.sp.size if self.sp else 1, "sharded": self.sharded,
                "tensor_parallel": self.tp.size if self.tp else 1,
                "rollout_workers": [(w.pid, getattr(w, "where", {}).get("host", process.host()))  # asynchronous
                                    for w in (self.engine.workers if isinstance(self.engine, RolloutPool) else ())],
                "peak_key": flops["peak_key"]}

    @property
    def data_parallel_size(self) -> int:
        """The workers whose gradients FSDP2 averages: all of them, or one per TP group."""
        return self.world_size // (self.tp.size if self.tp else 1)

    @property
    def engine(self):
        """The rollout engine itself (the HF or vLLM engine, or a rollout.remote.RemoteEngine); None before setup."""
        return self.rollout.engine if self.rollout is not None else None

    @property
    def history(self):
        """The rollout.weights.WeightHistory of the engine's weights (rollout.stale_updates, a remote engine)."""
        return self.rollout.history if self.rollout is not None else None

    @property
    def merged_rollout(self) -> bool:
        """The engine holds a LoRA policy's base with the adapters merged in (weights.merged_rollout)."""
        return merged_rollout(self.spec)

    @property
    def rollout_dtype(self) -> str | None:
        """rollout.dtype where it differs from the policy's compute dtype (engines.rollout_dtype_of)."""
        return rollout_dtype_of(self.spec)

    @property
    def engine_dtype(self) -> str:
        """The dtype of the engine's weights (engines.engine_dtype_of)."""
        return engine_dtype_of(self.spec)

    @property
    def rollout_copy(self) -> bool:
        """The hf engine samples from a model of its own, not the policy's module (weights.has_rollout_copy)."""
        return has_rollout_copy(self.spec, self.sharded)

    # ------------------------------------------------------------ verbs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample; an engine that can sleep (vLLM) is woken for it and put back
        to sleep after, so training has the device memory to itself."""
        return self.rollout.generate(prompts, params)

    def compute_log_probs(self, batch, which: str = "policy", teacher: str | None = None) -> torch.Tensor:
        """-> log-probs [N, R] of batch.responses under the policy, the reference or the teacher (of key
        `teacher` when there are several)."""
        if which == "teacher":
            sp, tp = self.teacher_parallel(teacher)
            return passes.over_teacher_group(self.spec, batch, tp, self.tokenizer.pad_token_id, lambda rows: (
                passes.log_probs(self.spec, rows, which, teacher, self.policy, self.ref, self.teachers, sp, tp),))[0]
        return passes.log_probs(self.spec, batch, which, teacher, self.policy, self.ref, self.teachers, self.sp,
                                self.tp)

    def compute_teacher_topk(self, batch, k: int, teacher: str | None = None):
        """The teacher's pass of distillation's top-k modes: -> (log-probs of batch.responses [N, R], its k
        likeliest tokens' log-probs [N, R, k] and ids [N, R, k])."""
        sp, tp = self.teacher_parallel(teacher)
        return passes.over_teacher_group(self.spec, batch, tp, self.tokenizer.pad_token_id, lambda rows:
                                         passes.teacher_topk(self.spec, rows, k, teacher, self.teachers, sp, tp))

    def teacher_parallel(self, teacher: str | None):
        """-> (the sequence-parallel group, the TensorParallel) teacher `teacher`'s passes run with: the policy's;
        or, split by a TP size of its own, no Ulysses (it runs whole sequences) and its own TP group."""
        t = passes.teacher_spec(self.spec, teacher)
        return (None if models.own_tensor_parallel(self.spec, t) else self.sp), self.teacher_tps.get(t.key)

    def teachers_of_sp(self) -> list:
        """The teachers that take the policy's sequence-parallel passes (not those split by a TP size of their own)."""
        return [self.teachers[t.key] for t in self.spec.teachers if not models.own_tensor_parallel(self.spec, t)]

    def compute_values(self, batch) -> torch.Tensor:
        """-> the critic's values [N, R] of batch's response positions."""
        return passes.values(self.spec, batch, self.critic, self.sp)  # its head is whole: no vocabulary split

    def train_step(self, batch, mini_totals: list[float] | None = None) -> dict[str, float]:
        """One PPO update over `batch` (this worker's rows of every mini-batch,
        in order), then one LR-scheduler step. `mini_totals`: the whole
        mini-batches' loss denominators, when the rows are split over workers."""
        with self.autocast(), optimizer_state_on_device(self.optimizer, self.spec.optimizer_offload):
            metrics = update_policy(self.policy, self.optimizer, batch, self.spec.update, mini_totals=mini_totals,
                                    world_size=self.data_parallel_size, sp=self.sp, tp=self.tp)
        self.scheduler.step()
        return metrics

    def sft_step(self, batch: dict, total_tokens: int | None = None) -> dict[str, float]:
        """One supervised update over `batch` (data.sft.collate's tensors: this worker's rows of the step's
        batch), then one LR-scheduler step. `total_tokens`: the whole batch's learned tokens, when its rows
        are split over workers (training.sft.sft_update)."""
        from posttrain.training.sft import sft_update

        with self.autocast(), optimizer_state_on_device(self.optimizer, self.spec.optimizer_offload):
            metrics = sft_update(self.policy, self.optimizer, batch, self.spec.sft, total_tokens,
                                 self.data_parallel_size, sp=self.sp, tp=self.tp)
        self.scheduler.step()
        return metrics

    def sft_loss(self, batch: dict) -> tuple[float, int]:
        """(summed -log p of `batch`'s learned tokens, their count), without gradients: the validation loss."""
        from posttrain.training.sft import nll_of

        with self.autocast():
            return nll_of(self.policy, batch, self.spec.sft, sp=self.sp, tp=self.tp)

    def update_critic(self, batch, mini_totals: list[float] | None = None) -> dict[str, float]:
        """One clipped value-loss update of the critic over `batch` (needs
        values and returns), then one step of its LR scheduler."""
        from posttrain.training.critic import update_critic

        with self.autocast(), optimizer_state_on_device(self.critic_optimizer, self.spec.critic.optimizer_offload):
            metrics = update_critic(self.critic, self.critic_optimizer, batch, self.spec.critic.update,
                                    mini_totals=mini_totals, world_size=self.data_parallel_size, sp=self.sp)
        self.critic_scheduler.step()
        return metrics

    def autocast(self):
        """The policy's mixed precision (engines.autocast_of)."""
        return autocast_of(self.spec)

    def memory(self) -> dict[str, float]:
        """Peak memory of this process so far: resident set (CPU) and, on a
        GPU, the most device memory allocated / reserved by torch (GiB)."""
        return process.peak_memory()

    # ------------------------------------------------------------ the engine's weights

    def sync_weights(self) -> None:
        """Make the rollout engine sample from the policy's new weights: the same module (hf, one
        process), a copy of them, the LoRA adapters alone (vLLM's LoRA request), or the base with the
        adapters merged in (rollout.lora_sync=merged); with rollout.stale_updates=k, the weights of k
        updates ago (before k updates, the first ones); a rollout process of its own gets a new version."""
        self.rollout.push_weights(self.policy)

    def validation_weights(self, on: bool) -> None:
        """Validation scores the policy as it is now: with rollout.stale_updates the engine is given the newest
        weights for it (`on`) and its k-updates-old ones back after (not `on`); a rollout process of its own
        takes the newest version for its next batch. Other engines already hold them."""
        self.rollout.validation_weights(on)

    def engine_weights(self, version: int, keep_older: bool = False) -> None:
        """Asynchronous training: the rollout process samples with `version` of the weights (counted from the
        start, or the resume) from its next batch on; older versions are let go unless `keep_older`."""
        self.rollout.load_version(version, keep_older)

    # ------------------------------------------------------------ checkpoints

    def save_shards(self, path: str) -> None:
        """Write this worker's shards of policy + optimizer (+ scheduler) and
        its random state under `path` (a collective)."""
        from posttrain.checkpoint.sharded import CRITIC_DCP_DIR, DCP_DIR, save_sharded
        from posttrain.checkpoint.state import capture_rng

        save_sharded(Path(path) / DCP_DIR, self.policy, self.optimizer, self.scheduler)
        if self.critic is not None:
            save_sharded(Path(path) / CRITIC_DCP_DIR, self.critic, self.critic_optimizer, self.critic_scheduler)
        rng_dir = Path(path) / "rng"
        rng_dir.mkdir(parents=True, exist_ok=True)
        torch.save(capture_rng(self.generators()), rng_dir / f"rank_{self.rank}.pt")

    def load_checkpoint(self, ckpt: str) -> bool:
        """Load policy + optimizer + scheduler shards and this rank's random
        state from a sharded checkpoint. -> whether the random state matched
        this rank (it does not when the number of workers changed)."""
        from posttrain.checkpoint.sharded import CRITIC_DCP_DIR, DCP_DIR, load_sharded
        from posttrain.checkpoint.state import restore_rng

        load_sharded(Path(ckpt) / DCP_DIR, self.policy, self.optimizer, self.scheduler)
        if self.critic is not None:
            load_sharded(Path(ckpt) / CRITIC_DCP_DIR, self.critic, self.critic_optimizer, self.critic_scheduler)
        self.rollout.push_weights(self.policy, restart=True)  # a stale engine starts over from the resumed weights
        rng = Path(ckpt) / "rng" / f"rank_{self.rank}.pt"
        if rng.exists():
            restore_rng(torch.load(rng, weights_only=True), self.generators())
        return rng.exists()

    def snapshot(self, step: int, writer, trainer_state: dict, metrics: dict):
        """This process's state for a checkpoint, copied to CPU now and written
        by `writer` (in the background with async_save)."""
        from posttrain.checkpoint import take_snapshot
        from posttrain.checkpoint.state import critic_snapshot

        if self.sharded:
            raise RuntimeError("a worker of a group is checkpointed through WorkerGroup.snapshot")
        snap = take_snapshot(step, self.policy, self.optimizer, self.scheduler, self.generators(), trainer_state,
                             metrics)
        if self.critic is not None:
            snap.critic = critic_snapshot(self.critic, self.critic_optimizer, self.critic_scheduler)
        return snap

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy's full weights (HF names, CPU) on rank 0; None elsewhere (a collective)."""
        from posttrain.rollout.weights import named_full_weights

        out = {name: t.detach().cpu().clone() for name, t in named_full_weights(self.policy)}
        return out if self.rank == 0 else None

    def generators(self) -> dict[str, torch.Generator]:
        """The random streams a checkpoint saves: the rollout engine's, if it has one (vLLM seeds its requests)."""
        gen = getattr(self.engine, "generator", None)
        return {"rollout": gen} if gen is not None else {}

    # ------------------------------------------------------------ the process

    def info(self) -> dict:
        """Where this worker runs (for error messages)."""
        return {"rank": self.rank, "pid": os.getpid(), "host": process.host()}

    def free_address(self) -> tuple[str, int]:
        """This node's address and a free port: the rendezvous of a multi-node group."""
        return process.host(), process.free_port()

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
        process.destroy_process_group()
