"""NeMo-RL's policy.*, checkpointing.* and logger.* sections -> posttrain's keys: the parts every NeMo-RL
layout shares (GRPO's, PPO's value model, SFT's, distillation's), read leaf by leaf through `Leaves`.

    f = Leaves(tree)
    out = {}
    policy(f, out, "in run.yaml")                      # model, batch sizes, optimizer, scheduler, generation, LoRA
    checkpointing_and_logger(f, out, "in run.yaml")
    f.left()                                           # the leaves nobody read: the caller refuses them
"""

from __future__ import annotations

from typing import Any

from posttrain.config.dialects.nemo_rl.keys import BACKENDS, METRICS, WHOLE
from posttrain.errors import ConfigError

ABSENT = object()  # a key the file does not have


class Leaves:
    """The file's leaves by dotted key; `get` marks a key as read, so what is left was not understood."""

    def __init__(self, tree: dict):
        self.flat: dict[str, Any] = {}
        self._walk(tree, "")
        self.read: set[str] = set()

    def _walk(self, node, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v and key not in WHOLE:
                self._walk(v, key + ".")
            else:
                self.flat[key] = v

    def has(self, key: str) -> bool:
        return key in self.flat

    def get(self, key: str, default=None):
        self.read.add(key)
        return self.flat.get(key, default)

    def under(self, prefix: str) -> dict[str, Any]:
        """Every leaf below `prefix.` (marked read)."""
        found = {k: v for k, v in self.flat.items() if k.startswith(prefix + ".") or k == prefix}
        self.read.update(found)
        return found

    def left(self) -> dict[str, Any]:
        return {k: v for k, v in self.flat.items() if k not in self.read}


def policy(f: Leaves, out: dict, origin: str) -> None:
    if f.get("policy.megatron_cfg.enabled") is not True and f.get("policy.dtensor_cfg.enabled") is False:
        raise ConfigError(f"policy.dtensor_cfg.enabled=false ({origin}) with Megatron off: posttrain trains with "
                          "FSDP2 (DTensor); set policy.dtensor_cfg.enabled=true")
    model = f.get("policy.model_name", ABSENT)
    tokenizer = f.get("policy.tokenizer.name", ABSENT)
    if tokenizer not in (ABSENT, None, model):  # another model's tokenizer (a base model with its instruct one's)
        out["model.tokenizer_path"] = tokenizer
    if f.has("policy.tokenizer.chat_template_kwargs"):
        out["data.apply_chat_template_kwargs"] = f.get("policy.tokenizer.chat_template_kwargs") or {}
    if f.has("policy.train_global_batch_size"):
        samples = f.get("policy.train_global_batch_size")
        n = f.get("grpo.num_generations_per_prompt")
        if n is None:
            raise ConfigError(f"policy.train_global_batch_size ({origin}) counts samples: give "
                              "grpo.num_generations_per_prompt too, so it can be turned into prompts")
        if samples % n:
            raise ConfigError(f"policy.train_global_batch_size={samples} ({origin}) counts samples and must be a "
                              f"multiple of grpo.num_generations_per_prompt={n} (whole groups per update)")
        out["actor.ppo_mini_batch_size"] = samples // n  # posttrain's (verl's) mini-batch counts prompts
    if f.has("policy.logprob_batch_size"):
        out["rollout.log_prob_micro_batch_size"] = out["ref.log_prob_micro_batch_size"] = f.get(
            "policy.logprob_batch_size")
    if f.has("policy.max_grad_norm"):
        norm = f.get("policy.max_grad_norm")
        out["actor.grad_clip"] = float("inf") if norm is None else norm  # null: no clipping
    if f.has("policy.optimizer"):  # `optimizer: null`: a Megatron file's (its optimizer is megatron_cfg's)
        raise ConfigError(f"policy.optimizer is null ({origin}): this file configures Megatron's optimizer; with "
                          "FSDP2 give ++policy.optimizer.kwargs.lr=LR (AdamW)")
    name = f.get("policy.optimizer.name", "torch.optim.AdamW")
    if name.rsplit(".", 1)[-1] != "AdamW":
        raise ConfigError(f"policy.optimizer.name={name} ({origin}) is not supported; posttrain trains with "
                          "torch.optim.AdamW")
    if f.has("policy.scheduler"):
        out.update(_scheduler(f.get("policy.scheduler"), origin))
    if f.get("policy.dtensor_cfg.cpu_offload", False):
        out["actor.param_offload"] = out["actor.optimizer_offload"] = True
    _generation(f, out, origin)
    _lora(f, out)
    packing = f.get("policy.sequence_packing.enabled", False)
    dynamic = f.get("policy.dynamic_batching.enabled", False)
    if packing or dynamic:  # micro-batches by a token budget instead of a row count
        kind = "sequence_packing" if packing else "dynamic_batching"
        out["actor.use_dynamic_bsz"] = True
        out["actor.ppo_max_token_len_per_gpu"] = f.get(f"policy.{kind}.train_mb_tokens")
        out["rollout.log_prob_use_dynamic_bsz"] = True
        out["rollout.log_prob_max_token_len_per_gpu"] = f.get(f"policy.{kind}.logprob_mb_tokens")
    f.under("policy.sequence_packing"), f.under("policy.dynamic_batching")
    if f.has("policy.max_total_sequence_length") and out.get("rollout.name") == "vllm":
        out.setdefault("rollout.max_model_len", f.get("policy.max_total_sequence_length"))
    f.get("policy.max_total_sequence_length"), f.get("policy.dtensor_cfg.enabled")


def _generation(f: Leaves, out: dict, origin: str) -> None:
    g = "policy.generation."
    if f.has(g + "backend"):
        backend = f.get(g + "backend")
        if backend not in BACKENDS:
            raise ConfigError(f"policy.generation.backend={backend} ({origin}) is not supported; posttrain "
                              "generates with vllm (GPUs) or hf")
        out["rollout.name"] = BACKENDS[backend]
    if f.has(g + "top_k"):
        out["rollout.top_k"] = -1 if f.get(g + "top_k") is None else f.get(g + "top_k")
    if f.has(g + "val_temperature"):  # NeMo-RL validates by sampling (its default: the training temperature)
        t = f.get(g + "val_temperature")
        out["rollout.val_kwargs.temperature"] = t
        out["rollout.val_kwargs.do_sample"] = t > 0
    if f.has(g + "val_top_k"):
        out["rollout.val_kwargs.top_k"] = -1 if f.get(g + "val_top_k") is None else f.get(g + "val_top_k")
    vllm = out.get("rollout.name") == "vllm"
    for key, ours in (("max_model_len", "rollout.max_model_len"), ("enforce_eager", "rollout.enforce_eager")):
        if f.has(g + "vllm_cfg." + key) and vllm:  # vLLM's engine settings: on hf they would be named unused
            out[ours] = f.get(g + "vllm_cfg." + key)
        f.get(g + "vllm_cfg." + key)
    if not vllm:
        for key in ("rollout.tensor_model_parallel_size", "rollout.gpu_memory_utilization"):
            out.pop(key, None)
    kwargs = f.get(g + "vllm_kwargs", {})
    if kwargs:
        out["rollout.engine_kwargs"] = {"vllm": dict(kwargs)}


def _lora(f: Leaves, out: dict) -> None:
    p = "policy.dtensor_cfg.lora_cfg."
    if not f.get(p + "enabled", False):
        f.under(p.rstrip("."))
        return
    out["model.lora_rank"] = f.get(p + "dim", 8)
    out["model.lora_alpha"] = f.get(p + "alpha", 32)
    out["model.lora_dropout"] = f.get(p + "dropout", 0.0)
    targets = f.get(p + "target_modules") or []
    out["model.target_modules"] = "all-linear" if f.get(p + "match_all_linear", True) or not targets else targets
    out["model.exclude_modules"] = f.get(p + "exclude_modules") or None


def _scheduler(value, origin: str) -> dict:
    """NeMo-RL's list of torch schedulers -> posttrain's linear warm-up (LinearLR, then a constant LR)."""
    items = value if isinstance(value, list) else [value] if value else []
    named = [s for s in items if isinstance(s, dict) and s.get("name")]
    kinds = [str(s["name"]).rsplit(".", 1)[-1] for s in named]
    kw = [s.get("kwargs") or {} for s in named]
    constant_ok = all(k.get("factor", 1 / 3) == 1.0 for n, k in zip(kinds, kw) if n == "ConstantLR")
    note = ("; CosineAnnealingLR's T_max is fixed, posttrain's cosine ends at the run's last step: drop it, set "
            "actor.lr_scheduler_type=cosine actor.min_lr_ratio=ETA_MIN/LR") if "CosineAnnealingLR" in kinds else ""
    refuse = ConfigError(f"policy.scheduler {kinds} ({origin}) is not supported; posttrain's schedule is a linear "
                         f"warm-up (torch LinearLR ending at factor 1.0) then a constant LR or a cosine{note}")
    if not kinds:
        return {}
    if kinds[0] == "LinearLR" and set(kinds[1:]) <= {"ConstantLR"} and constant_ok:
        if kw[0].get("end_factor", 1.0) != 1.0:
            raise refuse
        return {"actor.lr_warmup_steps": int(kw[0].get("total_iters", 5)),
                "actor.lr_warmup_start_factor": float(kw[0].get("start_factor", 1 / 3))}
    if set(kinds) == {"ConstantLR"} and constant_ok:
        return {"actor.lr_warmup_steps": 0}
    raise refuse


def checkpointing_and_logger(f: Leaves, out: dict, origin: str) -> None:
    enabled = f.get("checkpointing.enabled", True)
    if not enabled:  # NeMo-RL then writes none, at the last step neither
        out["trainer.save_freq"], out["trainer.save_last"] = -1, False
    if f.has("checkpointing.checkpoint_dir") and enabled:
        out["trainer.run_dir"] = f.get("checkpointing.checkpoint_dir")  # checkpoints and metrics in one place
    elif f.has("logger.log_dir"):
        out["trainer.run_dir"] = f.get("logger.log_dir")
    f.get("checkpointing.checkpoint_dir"), f.get("logger.log_dir")
    k = f.get("checkpointing.keep_top_k")
    metric = f.get("checkpointing.metric_name")
    higher = f.get("checkpointing.higher_is_better", True)
    if k is not None and enabled:
        if metric is None:  # NeMo-RL: no metric ranks by recency, so the newest k stay
            out["trainer.max_ckpt_to_keep"] = k
        else:
            out["trainer.keep_top_k"] = k
            out["trainer.keep_top_k_metric"] = _metric(metric, origin)
            out["trainer.keep_top_k_mode"] = "max" if higher else "min"
    loggers = ["console"]
    for name in ("wandb", "tensorboard", "mlflow", "swanlab"):
        if f.get(f"logger.{name}_enabled", False):
            if name == "swanlab":
                raise ConfigError(f"logger.swanlab_enabled=true ({origin}): posttrain has no SwanLab logger; use "
                                  "wandb, tensorboard or mlflow")
            loggers.append(name)
    if any(f.has(f"logger.{n}_enabled") for n in ("wandb", "tensorboard", "mlflow", "swanlab")):
        out["trainer.logger"] = loggers
    for key, ours in (("logger.wandb.project", "trainer.project_name"), ("logger.wandb.name", "trainer.experiment_name")):
        if f.has(key) and "wandb" in loggers:
            out[ours] = f.get(key)


def _metric(name, origin: str) -> str:
    if name in METRICS:
        return METRICS[name]
    if isinstance(name, str) and ":" in name and "/" in name.split(":", 1)[1]:
        return name.split(":", 1)[1]  # a posttrain metric name after NeMo-RL's val:/train: prefix
    raise ConfigError(f"checkpointing.metric_name={name} ({origin}) is not one posttrain records; use one of "
                      f"{', '.join(METRICS)}, null (the newest), or val:/train: followed by a posttrain metric "
                      "(val:val/score/mean)")
