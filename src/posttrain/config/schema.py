"""posttrain's config as typed dataclasses: every key, its type and its default.

    SCHEMA["actor.lr"]        # (float, 1e-06): every leaf key -> (type, default)
    cfg.actor.lr              # a loaded Config (load.load_config) is these dataclasses

Keys are posttrain's own; verl's spellings map onto them (dialects/verl/), NeMo-RL's
layout too (dialects/nemo_rl/). A comment beside a field says what it does where the
name does not; `posttrain train --help-config` lists them all (posttrain/help_config.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from posttrain.config.schema_algorithm import AlgorithmConfig, RewardConfig
from posttrain.config.schema_distill import DistillationConfig
from posttrain.config.schema_rollout import AsyncTrainingConfig, RolloutConfig
from posttrain.config.schema_sft import MultiturnSFTConfig

DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")  # metrics.jsonl is always written; sinks.py: the rest
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


@dataclass
class DataConfig:
    train_files: Optional[List[str]] = None  # None: data.dataset_name's file, else the embedded arith task
    val_files: Optional[List[str]] = None
    # a dataset known by name (NeMo-RL's: DeepScaler, GSM8K, AIME2024, ...; data/named.py), when no train_files:
    # its parquet under $POSTTRAIN_DATA (default <cache>/data), made by the commands a missing file's error gives
    dataset_name: Optional[str] = None
    val_dataset_name: Optional[str] = None  # the same for validation, when no val_files
    prompt_file: Optional[str] = None  # NeMo-RL's prompt file: str.format template, its one {} the problem
    system_prompt_file: Optional[str] = None  # a file whose text is a system message placed first
    # with no validation set: hold out this share of the training prompts (seeded by data.seed) for validation
    val_split_size: float = 0.0
    train_batch_size: int = 64  # prompts per step
    val_batch_size: Optional[int] = None  # prompts per validation generation chunk; None: all
    val_max_samples: Optional[int] = None
    max_prompt_length: int = 512
    max_response_length: int = 512
    shuffle: bool = True
    seed: Optional[int] = None  # None: trainer.seed
    prompt_key: str = "prompt"
    filter_overlong_prompts: bool = True
    truncation: str = "error"  # error | left | right, when not filtering
    # the rows' images (verl's list of {bytes, path} with <image> placeholders; TRL's `image` too): with a
    # vision-language model in model.path, in its prompts (data/images.py); a text-only model refuses such a row
    image_key: str = "images"
    video_key: str = "videos"  # a row with videos under this column is refused: videos are not supported yet
    # handed to the chat template, e.g. data.apply_chat_template_kwargs.enable_thinking=false (Qwen3)
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    train_max_samples: Optional[int] = None  # the first N training rows only; None or -1: all
    # posttrain sft (verl's SFT keys; `posttrain train` names them unused): the response column, reached through
    # nested keys (data.prompt_key=extra_info data.prompt_dict_keys=[question]), or whole conversations
    response_key: str = "answer"
    prompt_dict_keys: Optional[List[str]] = None
    response_dict_keys: Optional[List[str]] = None
    multiturn: MultiturnSFTConfig = field(default_factory=MultiturnSFTConfig)
    max_length: int = 1024  # tokens of one SFT example, prompt and response together
    only_last_turn: bool = False  # learn each row's last assistant turn only (the earlier ones are context)
    # a Jinja chat template (the text, or a path ending in .jinja) in place of the tokenizer's for the run, saved
    # with the checkpoints' tokenizer; None: the tokenizer's own (NeMo-RL's policy.tokenizer.chat_template)
    custom_chat_template: Optional[str] = None


@dataclass
class ModelConfig:
    path: Optional[str] = None  # None: the embedded tiny model
    # the directory of the tokenizer's files when they are not the model's (verl's model.tokenizer_path, NeMo-RL's
    # policy.tokenizer.name); None: the model directory's own. Checkpoints and exports hold this tokenizer
    tokenizer_path: Optional[str] = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    # log-prob, value and training passes: micro-batches of alike lengths, all-padding columns dropped
    use_remove_padding: bool = True
    # log-prob and training passes: a prompt's tokens run once per micro-batch, its KV shared by its samples
    share_prompt: bool = True
    # small attentions on the CPU as grouped matmuls instead of torch's fused SDPA kernel (models/attention.py)
    small_attention: bool = True
    # log-probs and entropy from the last hidden states a chunk of tokens at a time, the [N, R, V] logits never
    # whole (training/fused.py): verl's fused kernels' memory saving, in torch
    use_fused_kernels: bool = False
    # the policy's and the reference's log-prob passes, when they have no token budget (rollout. / ref.
    # log_prob_use_dynamic_bsz off): micro-batches of as many tokens as half the device's free memory holds,
    # from the model's shape (training/microbatch.py memory_token_budget); null: on CUDA yes, on the CPU no
    log_prob_budget_from_memory: Optional[bool] = None
    # LoRA (models/lora.py, peft): with lora_rank > 0 (or an adapter to start from) only low-rank adapters on
    # target_modules train, the base is frozen and is the reference model; the checkpoint holds the adapters
    lora_rank: int = 0
    lora_alpha: float = 16  # the adapters' scale is lora_alpha / lora_rank
    target_modules: Any = "all-linear"  # all-linear (every linear layer but the output) or names: [q_proj, v_proj]
    exclude_modules: Any = None
    lora_dropout: float = 0.0
    lora_adapter_path: Optional[str] = None  # a peft adapter directory to start from (its rank and targets)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla (PPO-clip, token ratios) | gspo (sequence ratio) | gpg (no ratio)


@dataclass
class MixedPrecisionConfig:
    """FSDP2's mixed precision of the policy (verl's fsdp_config.mixed_precision.*)."""

    param_dtype: Optional[str] = None  # compute dtype over the stored weights; null: bfloat16 on GPUs, none on CPUs
    reduce_dtype: str = "float32"  # gradients are reduced across workers in this dtype


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule: the first keys of the actor's section and of the critic's."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8  # AdamW's epsilon (torch's default; NeMo-RL's policy.optimizer.kwargs.eps)
    lr_warmup_steps: int = -1  # -1: lr_warmup_steps_ratio x total steps
    lr_warmup_steps_ratio: float = 0.0
    # null: warm-up factor (step + 1) / W; s in (0, 1]: torch LinearLR's s + (1 - s) * min(step, W) / W (NeMo-RL)
    lr_warmup_start_factor: Optional[float] = None
    lr_scheduler_type: str = "constant"  # after the warm-up: constant | cosine (verl's, to min_lr_ratio x lr)
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    grad_clip: float = 1.0


@dataclass
class ActorConfig(OptimizerConfig):
    ppo_mini_batch_size: int = 64  # prompts (x rollout.n sequences)
    ppo_micro_batch_size: int = 8  # sequences per worker (verl's ppo_micro_batch_size_per_gpu)
    # micro-batches filled up to a token budget (prompt + response tokens per worker) instead of
    # ppo_micro_batch_size sequences: the same loss and gradient, fewer and fuller passes on mixed lengths
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # None: clip_ratio
    clip_ratio_high: Optional[float] = None  # None: clip_ratio
    clip_ratio_c: Optional[float] = 3.0  # dual-clip bound for A < 0 (> 1); null: no dual clip (NeMo-RL's ratio_clip_c)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's divisor; null: data.max_response_length
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # an update that is exactly on-policy (ppo_epochs=1, one mini-batch, no KL in the reward) takes its old
    # log-probs from its own forward instead of a separate pass: the same loss and gradient, one pass fewer
    reuse_on_policy_log_probs: bool = True
    # Ulysses sequence parallelism: groups of this many workers take the same rows and split each sequence's
    # positions (training/ulysses.py); it must divide the workers and the model's attention heads
    ulysses_sequence_parallel_size: int = 1
    # tensor parallelism: groups of this many workers take the same rows and split each decoder layer's matmuls,
    # the embedding and the output layer's vocabulary (training/tensor_parallel.py); FSDP2 shards over the groups.
    # The reference, the critic and the teachers are split alike. It must divide the workers and the model's heads
    tensor_parallel_size: int = 1
    # with tensor parallelism, the activations between the matmuls (the residual stream, the layers' norms) split
    # over the positions too (Megatron's and NeMo-RL's sequence parallelism): 1/TP of them per worker, no more bytes
    sequence_parallel: bool = False
    # with tensor parallelism, a plan of your own in place of posttrain's (NeMo-RL's custom_parallel_plan):
    # "package.module.NAME" or "file.py:NAME", a dict {module path (`*`: any one name): ParallelStyle} or a function
    # returning one; it must split the output layer's vocabulary. Any model family
    tensor_parallel_plan: Optional[str] = None
    use_torch_compile: bool = False  # the log-prob and entropy functions torch.compile'd (the model is not)
    entropy_from_logits_with_chunking: bool = False  # the entropy 2048 tokens at a time: smaller temporaries
    entropy_checkpointing: bool = False  # the entropy's temporaries recomputed in the backward instead of kept
    # FSDP2's CPUOffloadPolicy: sharded parameters and gradients live in CPU memory, copied to the GPU layer by
    # layer for each pass, and the optimizer steps on the CPU (needs FSDP2 workers: trainer.use_ray or > 1 GPU)
    param_offload: bool = False
    optimizer_offload: bool = False  # the optimizer's state moves to the CPU between updates
    forward_prefetch: bool = False  # FSDP2: each layer gathers the next one's parameters as it starts
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    freeze_vision_tower: bool = False  # a vision-language model's image encoder keeps its weights


@dataclass
class RefConfig:
    log_prob_micro_batch_size: int = 64  # sequences per pass, per worker
    use_torch_compile: bool = False  # the reference pass's log-prob function torch.compile'd
    # param_offload: the reference's sharded parameters in CPU memory (FSDP2's CPUOffloadPolicy, as the actor's)
    log_prob_use_dynamic_bsz: Optional[bool] = None  # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # null: actor.ppo_max_token_len_per_gpu
    param_offload: bool = False
    forward_prefetch: bool = False  # as actor.forward_prefetch, for the reference's FSDP2 shards
    # the reference's nn.Linear weights stored once in autocast's lower dtype (bf16 on a GPU) instead of cast from
    # float32 at every forward; its log-probs are the same bit for bit (embeddings and norms stay float32; a tied
    # output layer gets a bf16 copy of its own). null: on where the reference runs in one process under autocast
    # in a lower dtype, not with LoRA (the reference is the policy's base) or sharded workers (FSDP2 casts);
    # true: the same, and a warning where it cannot apply; false: off (float32 weights, cast at every forward)
    cast_weights: Optional[bool] = None


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # null: the actor's model.path (or the embedded tiny model)
    enable_gradient_checkpointing: bool = False
    use_remove_padding: Optional[bool] = None  # null: model.use_remove_padding
    # FSDP2's CPU offload of the critic's parameters (and gradients), its optimizer state on the CPU between
    # updates (see actor.param_offload); verl's critic.model.fsdp_config.*
    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class CriticConfig(OptimizerConfig):
    """The value model of PPO with GAE (algorithm.adv_estimator=gae): the
    critic model's LM with a scalar value head. Its optimizer's keys are the actor's (OptimizerConfig)."""

    lr: float = 1e-5
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: Optional[int] = None  # prompts; null: actor.ppo_mini_batch_size
    # sequences per worker, verl's *_per_gpu spellings: critic.ppo_micro_batch_size and forward_micro_batch_size are
    # verl's deprecated global sizes (divided over the data-parallel workers: dialects/verl/global_sizes.py)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # null: actor.ppo_micro_batch_size
    forward_micro_batch_size_per_gpu: Optional[int] = None  # per value pass; null: rollout.log_prob_micro_batch_size
    use_dynamic_bsz: Optional[bool] = None  # token-budget micro-batches (see actor.use_dynamic_bsz); null: the actor's
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: Optional[int] = None  # value passes' budget; null: ppo_max_token_len_per_gpu
    ppo_epochs: Optional[int] = None  # null: actor.ppo_epochs
    cliprange_value: float = 0.5
    loss_coef: float = 1.0  # the value loss times this before its backward (NeMo-RL's value_loss_fn.scale)
    loss_agg_mode: Optional[str] = None  # null: actor.loss_agg_mode


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # None: total_epochs x steps per epoch
    max_epochs: Optional[int] = None  # stop after this many passes over the data even if total_training_steps is more
    save_freq: int = -1  # a checkpoint every N steps; -1 or 0: none between (verl's -1)
    save_last: bool = True  # and one at the last step (false: none there, as verl's RL trainer with save_freq=-1)
    test_freq: int = -1  # -1: only before (val_before_train) and after training
    val_before_train: bool = True
    val_at_end: bool = True  # validate after the last step (false: only if it is a test_freq multiple)
    logger: List[str] = field(default_factory=lambda: ["console"])
    project_name: str = "posttrain"
    experiment_name: Optional[str] = "default"  # null: a timestamp (a new run directory each time)
    run_dir: Optional[str] = None  # None: runs/<project_name>/<experiment_name>
    resume_mode: str = "auto"  # auto | disable | resume_path | a global_step_N directory
    resume_from_path: Optional[str] = None  # with resume_mode=resume_path (verl's spelling)
    async_save: bool = True  # write checkpoints in a background thread
    max_ckpt_to_keep: Optional[int] = None  # keep the newest K checkpoints; None: all
    keep_top_k: Optional[int] = None  # also keep the best K by keep_top_k_metric
    keep_top_k_metric: str = "val/score/mean"
    keep_top_k_mode: str = "max"  # max | min
    n_gpus_per_node: int = 1  # workers per node (devices; CPU workers with device=cpu)
    nnodes: int = 1
    device: str = "auto"  # auto | cpu | cuda
    # on the CPU, malloc keeps the memory a step frees for the next allocation instead of handing it back and
    # page-faulting it in again (malloc.py); the process keeps its peak memory
    reuse_cpu_memory: bool = True
    use_ray: Optional[bool] = None  # null: on Ray when nnodes x n_gpus_per_node > 1 or a Ray address is set
    ray_address: Optional[str] = None  # a running cluster (HEAD:6379); null: $RAY_ADDRESS, else a local cluster
    cpus_per_worker: int = 1
    collective_timeout_s: float = 600.0  # a collective (all-gather, reduce-scatter) slower than this is an error
    seed: int = 0
    critic_warmup: int = 0  # the first N steps update only the critic (PPO with gae)
    max_nonfinite_steps: int = 10  # stop (saving the last good state) after N steps in a row skipped for NaN/inf; <= 0: never
    log_val_generations: int = 0  # validation completions written to samples.jsonl at each validation
    log_samples_freq: int = 10  # every N steps a few prompts' best and worst completions go to samples.jsonl; <= 0: never
    log_samples_prompts: int = 4  # prompts per sample log (their best and worst completion each)
    peak_flops: Optional[float] = None  # FLOP/s of one device for MFU; null: GPU by name, CPU measured once
    debug: bool = False  # rewards, tools and the policy in this process: breakpoint() stops there (docs/debugging.md)


@dataclass
class ProfilerRoleConfig:
    """verl's <role>.profiler: whether the role's phases (profiling.ROLE_PHASES) are profiled, on which ranks.
    Null: off / rank 0 (rollout's: the actor's, as in verl, whose actor worker also generates)."""

    enable: Optional[bool] = None
    all_ranks: Optional[bool] = None
    ranks: Optional[List[int]] = None  # [] or null: rank 0
    tool_config: Dict[str, Any] = field(default_factory=dict)  # <tool>.discrete, <torch|npu>.contents read


@dataclass
class TorchMemoryConfig:
    """profiler.tool=torch_memory: torch.cuda.memory._record_memory_history's settings."""

    trace_alloc_max_entries: int = 100_000
    stack_depth: int = 32  # verl's; torch records whole stacks (named unused)
    context: Optional[str] = "all"  # alloc | state | all | null
    stacks: str = "all"  # python | all


@dataclass
class ProfilerConfig:
    """Step profiling (profiling.py): verl's global_profiler.* and per-role profiler.*."""

    tool: Optional[str] = None  # torch | nsys | torch_memory | npu (torch's profiler); null: off
    steps: Optional[List[int]] = None  # RL steps, counted from 1; null: none (torch_memory: every step)
    continuous_steps: bool = False  # consecutive listed steps in one capture
    discrete: bool = False  # a capture per enabled role's phase instead of per step (default of tool_config.*.discrete)
    save_path: Optional[str] = None  # null: RUN_DIR/profile
    torch_memory: TorchMemoryConfig = field(default_factory=TorchMemoryConfig)
    global_tool_config: Dict[str, Any] = field(default_factory=dict)  # verl's nsys launch options, ...: unused
    actor: ProfilerRoleConfig = field(default_factory=ProfilerRoleConfig)
    ref: ProfilerRoleConfig = field(default_factory=ProfilerRoleConfig)
    rollout: ProfilerRoleConfig = field(default_factory=ProfilerRoleConfig)
    critic: ProfilerRoleConfig = field(default_factory=ProfilerRoleConfig)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)


def schema(cls=Config, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Every leaf key -> (type, default), e.g. 'actor.lr' -> (float, 1e-6)."""
    out = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None) or (
            f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)
        ):
            out.update(schema(f.default_factory, key + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[key] = (f.type, default)
    return out


SCHEMA = schema()
LIST_KEYS = {k for k, (t, _) in SCHEMA.items() if "List" in str(t)}
DICT_KEYS = {k for k, (t, _) in SCHEMA.items() if "Dict" in str(t)}  # free-form: any key below them
def uses_lora(cfg: Config) -> bool:
    return cfg.model.lora_rank > 0 or bool(cfg.model.lora_adapter_path)


def data_parallel_groups(cfg: Config) -> int:
    """Workers that take rows of their own: all of them, or their Ulysses or tensor-parallel groups."""
    return (cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node // cfg.actor.ulysses_sequence_parallel_size
            // max(1, cfg.actor.tensor_parallel_size))
