"""What one device does: the worker verbs.

A `Worker` holds the policy (with its optimizer), the reference model and
the rollout engine of one device, colocated. The driver calls its verbs:
`generate`, `compute_log_probs`, `train_step`, `sync_weights`,
`save_shards`, `load_checkpoint`. In one process the driver owns a single
Worker; on a Ray cluster a `distributed.WorkerGroup` runs one per device
and calls the same verbs on all of them.

With more than one worker, the policy and reference are sharded with FSDP2
(`training.parallelize`) and the HF rollout engine samples from its own
full copy of the policy, refreshed by `sync_weights` after each update (a
vLLM engine does the same with its own weights). The HF engine has such a
copy in one process too when it samples in a dtype of its own
(rollout.dtype) or with the weights of k updates ago (rollout.stale_updates:
the worker keeps the last k + 1 versions on the CPU and loads the oldest).
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch

from posttrain.worker.engines import autocast_of, build_rollout_engine, engine_dtype_of, make_engine, rollout_dtype_of
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.training.actor import (
    make_lr_scheduler, make_optimizer, move_optimizer_state, update_policy,
)
from posttrain.training.fused import check_fusable
from posttrain.training.logprobs import compute_log_probs, compute_topk_log_probs
from posttrain.worker.spec import CriticSpec, WorkerSpec


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
        self.policy = self.ref = self.engine = self.optimizer = self.scheduler = self.tokenizer = None
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        self.sp = None  # training.ulysses.SequenceParallel, with sequence_parallel > 1
        self.history = None  # rollout.weights.WeightHistory, with rollout.stale_updates > 0 or a remote engine
        self.engine_version = None  # a remote engine's weights: the version engine_weights loaded

    # ------------------------------------------------------------ building

    def setup(self, init_method: str | None = None) -> dict:
        """Join the process group (when sharded), load and shard the models,
        make the optimizer and the rollout engine. -> where this worker runs."""
        from posttrain.models import load_model, load_tokenizer
        from posttrain.models.loader import eos_token_ids, freeze_vision_tower
        from posttrain.runtime.malloc import reuse_freed_memory
        from posttrain.runtime.quiet import quiet_libraries
        from posttrain.training.parallelize import parallelize

        # One piece on purpose (a few lines over 60): its order is the contract (environment, process group,
        # models, sharding, optimizer, engine), read top to bottom.
        s = self.spec
        os.environ.update(s.env)
        quiet_libraries()
        if s.threads:
            torch.set_num_threads(s.threads)
        device = torch.device(s.device)
        if device.type == "cpu":
            reuse_freed_memory(s.reuse_cpu_memory)
        if self.sharded:
            self._init_process_group(init_method, device)
        torch.manual_seed(s.seed)
        kwargs = dict(dtype=s.dtype, trust_remote_code=s.trust_remote_code, device=device,
                      small_attention=s.small_attention)
        self.tokenizer = load_tokenizer(s.model_dir, trust_remote_code=s.trust_remote_code)
        if s.lora is None:
            self.policy = load_model(s.policy_dir or s.model_dir, **kwargs)
        else:  # the base model, frozen, with adapters: fresh, or a checkpoint's (policy_dir) or lora_adapter_path
            from posttrain.models.lora import add_adapters

            self.policy = add_adapters(load_model(s.model_dir, **kwargs), s.lora, s.policy_dir)
        eos = eos_token_ids(self.tokenizer, self.policy)
        if s.update.fused_kernels:
            check_fusable(self.policy)
        if s.freeze_vision_tower and not freeze_vision_tower(self.policy) and self.rank == 0:
            warnings.warn(f"actor.freeze_vision_tower=true: {type(self.policy).__name__} has no vision tower; "
                          "every parameter trains", stacklevel=2)
        rollout_model = None if self.sharded or s.rollout.remote else self.policy  # vLLM's engine loads its own
        if self.rollout_copy:  # before sharding: the copy is whole
            rollout_model = self._rollout_copy(load_model, kwargs)
        if self.sharded:
            parallelize(self.policy, param_dtype=s.mixed_precision, activation_checkpointing=s.gradient_checkpointing,
                        offload_params=s.param_offload, forward_prefetch=s.forward_prefetch,
                        reduce_dtype=s.reduce_dtype)
        elif s.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if s.ref.needed and s.lora is None:  # with LoRA the reference is the policy's base: its adapters switched off
            self.ref = load_model(s.model_dir, **kwargs).requires_grad_(False).eval()
            if self.sharded:
                parallelize(self.ref, param_dtype=s.mixed_precision, offload_params=s.ref.param_offload,
                            forward_prefetch=s.ref.forward_prefetch)
        for t in s.teachers:  # on-policy distillation: frozen, placed as the reference is
            self.teachers[t.key] = load_model(t.model_dir, **kwargs).requires_grad_(False).eval()
            if self.sharded:
                parallelize(self.teachers[t.key], param_dtype=s.mixed_precision, offload_params=t.param_offload,
                            forward_prefetch=s.ref.forward_prefetch)
        self.optimizer = make_optimizer(self.policy, s.lr, s.weight_decay, s.betas, s.eps)
        self.scheduler = make_lr_scheduler(self.optimizer, s.warmup_steps, s.warmup_start_factor, s.total_steps,
                                           s.lr_scheduler_type, s.min_lr_ratio, s.num_cycles)
        if s.critic is not None:
            self._setup_critic(s.critic, kwargs)
        if s.sequence_parallel > 1 and self.sharded:  # after the rollout's copy was made: it samples whole rows
            self._setup_sequence_parallel(s.sequence_parallel)
        self.engine = self._make_engine(rollout_model, eos)
        if s.rollout.stale_updates or s.rollout.remote:
            from posttrain.rollout.weights import WeightHistory

            # stale: the last k + 1 versions; remote: the versions the rollout process may still ask for (in
            # flight: the newest, on its way to it)
            lag = s.rollout.stale_updates if not s.rollout.remote else 0 if s.rollout.in_flight else None
            self.history = WeightHistory(lag, getattr(torch, self.engine_dtype))
        # the engine holds weights of its own (vLLM, a copy) that are not the policy's at start when resuming
        # (policy_dir) or starting from adapters (lora_adapter_path): pushed now, not one step late
        not_model_dir = s.policy_dir is not None or (s.lora is not None and s.lora.adapter_path is not None)
        if s.rollout.weights_from_policy or self.history is not None or not_model_dir:
            self._push_weights(restart=True)
        from posttrain.metrics.flops import cpu_peak_key, device_peak_flops

        # MFU's denominator, measured here: a CPU's peak depends on this process's threads
        dtype = getattr(torch, s.mixed_precision or s.dtype)
        device_name, peak = device_peak_flops(device, dtype)
        return {**self.info(), "device": str(device), "pad_token_id": self.tokenizer.pad_token_id,
                "device_name": device_name, "peak_flops": peak, "sequence_parallel": self.sp.size if self.sp else 1,
                "sharded": self.sharded,
                "peak_key": cpu_peak_key(torch.get_num_threads(), dtype) if device.type == "cpu" else None}

    def _rollout_copy(self, load_model, kwargs: dict) -> torch.nn.Module:
        """The hf engine's own model: the plain base for merged LoRA weights (W + s B A at every sync), else a copy
        of the policy; its parameters in rollout.dtype where that differs from the policy's compute dtype (buffers
        such as RoPE's frequencies stay as they are, as a model loaded in that dtype keeps them)."""
        model = load_model(self.spec.model_dir, **kwargs) if self.merged_rollout else copy.deepcopy(self.policy)
        # its parameters keep requires_grad as the policy's (no optimizer holds them): torch picks kernels by it,
        # and the copy then samples bit for bit as the policy's own module would
        model.eval()
        if self.rollout_dtype is not None:
            for p in model.parameters():
                p.data = p.data.to(getattr(torch, self.rollout_dtype))
        return model

    def _setup_critic(self, c: CriticSpec, kwargs: dict) -> None:
        from posttrain.models import load_value_model
        from posttrain.training.parallelize import parallelize

        self.critic = load_value_model(c.model_dir, **kwargs)
        if self.critic.config.vocab_size < len(self.tokenizer):
            from posttrain.errors import ModelError

            raise ModelError(
                f"the critic model in '{c.model_dir}' has a vocabulary of {self.critic.config.vocab_size} tokens, "
                f"fewer than the actor's tokenizer ({len(self.tokenizer)}): the critic reads the actor's token ids, "
                "so critic.model.path must share the actor's tokenizer")
        if self.sharded:
            parallelize(self.critic, param_dtype=self.spec.mixed_precision,
                        activation_checkpointing=c.gradient_checkpointing, offload_params=c.param_offload)
        elif c.gradient_checkpointing:
            self.critic.gradient_checkpointing_enable()
        self.critic_optimizer = make_optimizer(self.critic, c.lr, c.weight_decay, c.betas, c.eps)
        self.critic_scheduler = make_lr_scheduler(self.critic_optimizer, c.warmup_steps, c.warmup_start_factor,
                                                  c.total_steps, c.lr_scheduler_type, c.min_lr_ratio, c.num_cycles)

    def _setup_sequence_parallel(self, size: int) -> None:
        """Groups of `size` consecutive ranks split each sequence's positions (training/ulysses.py)."""
        import torch.distributed as dist

        from posttrain.errors import ConfigError
        from posttrain.training.ulysses import SequenceParallel, use_ulysses

        groups = [dist.new_group(list(range(r, r + size))) for r in range(0, self.world_size, size)]  # every rank
        self.sp = SequenceParallel(groups[self.rank // size], size, self.rank % size)  # makes every group
        for model in (self.policy, self.ref, self.critic, *self.teachers.values()):  # every model its passes split
            if model is not None:
                try:
                    use_ulysses(model, self.sp)
                except ValueError as e:
                    raise ConfigError(f"actor.{e}; pick a size that divides it") from None

    def _init_process_group(self, init_method: str, device: torch.device) -> None:
        import torch.distributed as dist

        # CUDA: NCCL for the GPU's tensors, gloo for the CPU's (FSDP2's CPU offload gathers and saves them)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray gives each worker one GPU, visible as cuda:0
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.spec.collective_timeout_s))

    def _make_engine(self, rollout_model, eos: list[int]):
        s, r = self.spec, self.spec.rollout
        if r.remote:  # asynchronous training: the engine in a process of its own, built there
            from functools import partial

            from posttrain.rollout.remote import RemoteEngine

            return RemoteEngine(partial(build_rollout_engine, s, eos, self.tokenizer.pad_token_id, self.rank),
                                threads=r.threads, in_flight=r.in_flight)
        lora_rank = self.policy.peft_config["default"].r if s.lora and not self.merged_rollout else 0
        return make_engine(s, rollout_model, eos, self.tokenizer.pad_token_id, self.rank, progress=not self.sharded,
                           lora_rank=lora_rank)

    # ------------------------------------------------------------ verbs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample; an engine that can sleep (vLLM) is woken for it and put back
        to sleep after, so training has the device memory to itself."""
        self._wake()
        try:  # an engine in a dtype of its own computes in it: autocast would recast its matmuls
            with self.autocast() if self.rollout_dtype is None else contextlib.nullcontext():
                return self.engine.generate(prompts, params)
        finally:
            self._sleep()

    def compute_log_probs(self, batch, which: str = "policy", teacher: str | None = None) -> torch.Tensor:
        """-> log-probs [N, R] of batch.responses under the policy, the reference or the teacher (of key
        `teacher` when there are several)."""
        from posttrain.models.lora import base_only

        s = self.spec
        lora_ref = which == "ref" and s.lora is not None  # the reference is the base: the policy, adapters off
        if which == "teacher":
            t = self._teacher_spec(teacher)
            model, size, budget = self.teachers[t.key], t.log_prob_micro_batch_size, t.log_prob_max_tokens
        else:
            model = {"policy": self.policy, "ref": self.policy if lora_ref else self.ref}[which]
            size, budget = {"policy": (s.log_prob_micro_batch_size, s.log_prob_max_tokens),
                            "ref": (s.ref.log_prob_micro_batch_size, s.ref.log_prob_max_tokens)}[which]
        options = s.update.pass_options(compile=None if which == "policy" else s.ref.torch_compile, sp=self.sp)
        with self.autocast(), base_only(model) if lora_ref else contextlib.nullcontext():
            return compute_log_probs(model, batch, size, s.temperature, options=options, max_tokens=budget)[0]

    def compute_teacher_topk(self, batch, k: int, teacher: str | None = None):
        """The teacher's pass of distillation's top-k modes: -> (log-probs of batch.responses [N, R], its k
        likeliest tokens' log-probs [N, R, k] and ids [N, R, k])."""
        t = self._teacher_spec(teacher)
        options = self.spec.update.pass_options(compile=False, sp=self.sp)
        with self.autocast():
            return compute_topk_log_probs(self.teachers[t.key], batch, k, t.log_prob_micro_batch_size,
                                          self.spec.temperature, options=options, max_tokens=t.log_prob_max_tokens)

    def _teacher_spec(self, key: str | None):
        """The teacher of routing key `key` (None: the only one)."""
        return next(t for t in self.spec.teachers if t.key == key or len(self.spec.teachers) == 1)

    def train_step(self, batch, mini_totals: list[float] | None = None) -> dict[str, float]:
        """One PPO update over `batch` (this worker's rows of every mini-batch,
        in order), then one LR-scheduler step. `mini_totals`: the whole
        mini-batches' loss denominators, when the rows are split over workers."""
        with self.autocast(), optimizer_state_on_device(self.optimizer, self.spec.optimizer_offload):
            metrics = update_policy(self.policy, self.optimizer, batch, self.spec.update,
                                    mini_totals=mini_totals, world_size=self.world_size, sp=self.sp)
        self.scheduler.step()
        return metrics

    def sft_step(self, batch: dict, total_tokens: int | None = None) -> dict[str, float]:
        """One supervised update over `batch` (data.sft.collate's tensors: this worker's rows of the step's
        batch), then one LR-scheduler step. `total_tokens`: the whole batch's learned tokens, when its rows
        are split over workers (training.sft.sft_update)."""
        from posttrain.training.sft import sft_update

        with self.autocast(), optimizer_state_on_device(self.optimizer, self.spec.optimizer_offload):
            metrics = sft_update(self.policy, self.optimizer, batch, self.spec.sft, total_tokens, self.world_size,
                                 sp=self.sp)
        self.scheduler.step()
        return metrics

    def sft_loss(self, batch: dict) -> tuple[float, int]:
        """(summed -log p of `batch`'s learned tokens, their count), without gradients: the validation loss."""
        from posttrain.training.sft import nll_of

        with self.autocast():
            return nll_of(self.policy, batch, self.spec.sft, sp=self.sp)

    def compute_values(self, batch) -> torch.Tensor:
        """-> the critic's values [N, R] of batch's response positions."""
        from posttrain.training.critic import compute_values

        c = self.spec.critic.update
        with self.autocast():
            return compute_values(self.critic, batch, c.forward_micro_batch_size, c.remove_padding, c.forward_max_tokens,
                                  self.sp)

    def update_critic(self, batch, mini_totals: list[float] | None = None) -> dict[str, float]:
        """One clipped value-loss update of the critic over `batch` (needs
        values and returns), then one step of its LR scheduler."""
        from posttrain.training.critic import update_critic

        with self.autocast(), optimizer_state_on_device(self.critic_optimizer, self.spec.critic.optimizer_offload):
            metrics = update_critic(self.critic, self.critic_optimizer, batch, self.spec.critic.update,
                                    mini_totals=mini_totals, world_size=self.world_size, sp=self.sp)
        self.critic_scheduler.step()
        return metrics

    def autocast(self):
        """The policy's mixed precision (engines.autocast_of)."""
        return autocast_of(self.spec)

    def memory(self) -> dict[str, float]:
        """Peak memory of this process so far: resident set (CPU) and, on a
        GPU, the most device memory allocated / reserved by torch (GiB)."""
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out = {"perf/max_rss_gb": rss / (2 ** 30 if sys.platform == "darwin" else 2 ** 20)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
            out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2 ** 30
        return out

    @property
    def merged_rollout(self) -> bool:
        """A LoRA policy whose rollout engine holds the base with the adapters merged in: rollout.lora_sync=merged,
        and the engines that sample from weights of their own (rollout.stale_updates, an hf engine's
        rollout.dtype): their copies and snapshots are of a plain model."""
        s = self.spec
        if s.lora is None:
            return False
        own = (s.rollout.stale_updates > 0 or s.rollout.remote
               or (s.rollout.name == "hf" and self.rollout_dtype is not None))
        return s.lora.sync == "merged" or own

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
        """The hf engine samples from a model of its own, not the policy's module: beside sharded workers, with
        merged LoRA weights, in a dtype of its own, or with the weights of k updates ago."""
        s = self.spec
        return s.rollout.name == "hf" and not s.rollout.remote and (
            self.sharded or self.merged_rollout or self.rollout_dtype is not None or s.rollout.stale_updates > 0)

    def sync_weights(self) -> None:
        """Make the rollout engine sample from the policy's new weights: the same module (hf, one
        process), a copy of them, the LoRA adapters alone (vLLM's LoRA request), or the base with the
        adapters merged in (rollout.lora_sync=merged); with rollout.stale_updates=k, the weights of k
        updates ago (before k updates, the first ones)."""
        self._push_weights()

    def _push_weights(self, restart: bool = False) -> None:
        """sync_weights; `restart`: the weights now are the first of the history (at start, after a resume)."""
        s = self.spec
        if s.rollout.name == "hf" and not self.rollout_copy and not s.rollout.remote:
            self.engine.update_weights(self.policy)  # the same module: nothing to copy
            return
        from posttrain.rollout.weights import named_full_weights

        self._wake()  # the weights go into a sleeping engine's device memory
        if s.lora is not None and s.rollout.name == "vllm" and not self.merged_rollout:
            from posttrain.models.lora import adapter_config_json, adapter_weights

            self.engine.load_adapter(adapter_weights(named_full_weights(self.policy, lora_only=True)),
                                     adapter_config_json(self.policy))
            return
        weights = named_full_weights(self.policy)
        if self.merged_rollout:
            from posttrain.models.lora import lora_scaling, merged_weights

            weights = merged_weights(weights, lora_scaling(self.policy))
        if self.history is not None:
            self.history.push(weights, restart=restart)
            if s.rollout.remote:  # the rollout process takes the version the driver names (engine_weights) or, in
                if restart:      # flight, each new one at its next forward, even mid-batch
                    self.engine_version = None
                if s.rollout.in_flight:
                    self.engine.send_weights(self.history.newest_version, self.history.newest())
                return
            weights = self.history.oldest()
        self.engine.load_weights(weights)

    def validation_weights(self, on: bool) -> None:
        """Validation scores the policy as it is now: with rollout.stale_updates the engine is given the newest
        weights for it (`on`) and its k-updates-old ones back after (not `on`). Other engines already hold them."""
        if self.history is None:
            return
        if self.spec.rollout.remote:  # the rollout process reloads its own version before its next batch
            if on:
                self.engine_weights(self.history.newest_version, keep_older=True)
            return
        self._wake()
        self.engine.load_weights(self.history.newest() if on else self.history.oldest())

    def engine_weights(self, version: int, keep_older: bool = False) -> None:
        """Asynchronous training: the rollout process samples with `version` of the weights (counted from the
        start, or the resume) from its next batch on; older versions are let go unless `keep_older`."""
        if self.spec.rollout.in_flight:  # it has been sent each version: it waits for this one, or takes a newer
            self.engine.min_version = version
            return
        if self.engine_version != version:
            self.engine.load_weights(self.history.get(version))
            self.engine_version = version
        if not keep_older:
            self.history.drop_below(version)

    def _wake(self) -> None:
        if getattr(self, "_asleep", False):
            self.engine.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        if getattr(self.engine, "can_sleep", False) and self.spec.rollout.free_cache_engine:
            self.engine.sleep()
            self._asleep = True

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
        self._push_weights(restart=True)  # a stale engine starts over from the resumed weights
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
        gen = getattr(self.engine, "generator", None)
        return {"rollout": gen} if gen is not None else {}

    def info(self) -> dict:
        """Where this worker runs (for error messages)."""
        import socket

        try:
            import ray

            host = ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()
        except ImportError:
            host = socket.gethostname()
        return {"rank": self.rank, "pid": os.getpid(), "host": host}

    def free_address(self) -> tuple[str, int]:
        """This node's address and a free port: the rendezvous of a multi-node group."""
        import socket

        host = self.info()["host"]
        with socket.socket() as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.spec.rollout.remote and self.engine is not None:
            self.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
