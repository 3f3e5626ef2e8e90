"""Typed configs: dataclass defaults, the embedded preset, a YAML file and
`key=value` overrides, merged with OmegaConf and validated where loaded.

Keys are posttrain's own (`actor.lr`) or verl's (`actor_rollout_ref.actor.optim.lr`,
see config_aliases.py). An unknown key is an error naming the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config import nemo_rl
from posttrain.config import presets as algorithm_presets
from posttrain.config import verl as aliases
from posttrain.algorithms import ADV_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, NEEDS_CRITIC, PF_PPO_METHODS, POLICY_LOSSES
from posttrain.errors import ConfigError
from posttrain.text import invalid_text

DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")  # metrics.jsonl is always written; sinks.py: the rest
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


@dataclass
class CustomDatasetClass:
    path: Optional[str] = None
    name: Optional[str] = None


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
    image_key: str = "images"  # a row with images under this column is refused: vision inputs are not supported yet
    return_raw_chat: bool = False  # verl's input for its async rollout server; posttrain tokenizes the chat itself
    # verl's own dataset class (its RLHFDataset API): not supported, posttrain reads the parquet rows itself
    custom_cls: CustomDatasetClass = field(default_factory=CustomDatasetClass)
    # handed to the chat template, e.g. data.apply_chat_template_kwargs.enable_thinking=false (Qwen3)
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class FusedKernelOptions:
    impl_backend: Optional[str] = None  # verl's torch | triton: posttrain's chunked pass is torch either way


@dataclass
class ModelConfig:
    path: Optional[str] = None  # None: the embedded tiny model
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
    fused_kernel_options: FusedKernelOptions = field(default_factory=FusedKernelOptions)
    # LoRA (models/lora.py, peft): with lora_rank > 0 (or an adapter to start from) only low-rank adapters on
    # target_modules train, the base is frozen and is the reference model; the checkpoint holds the adapters
    lora_rank: int = 0
    lora_alpha: float = 16  # the adapters' scale is lora_alpha / lora_rank
    target_modules: Any = "all-linear"  # all-linear (every linear layer but the output) or names: [q_proj, v_proj]
    exclude_modules: Any = None
    lora_dropout: float = 0.0
    lora_adapter_path: Optional[str] = None  # a peft adapter directory to start from (its rank and targets)
    use_shm: bool = False  # verl copies the model to /dev/shm first: posttrain reads it where it is


@dataclass
class ValKwargs:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's keys; rollout/multiturn.py): the model calls a tool in hermes
    format, reads its answer and goes on. Its other keys, set while it is off, are named unused."""

    enable: bool = False
    format: str = "hermes"  # the tool-call markup: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    max_assistant_turns: Optional[int] = None  # null: 5
    max_user_turns: Optional[int] = None  # verl's turns of a simulated user (interactions): not supported
    tool_config_path: Optional[str] = None  # verl's tool config YAML: tools: [{class_name, config, tool_schema}]
    tools: Optional[List[str]] = None  # Python functions as tools: [pkg.module:function, ...]
    interaction_config_path: Optional[str] = None  # verl's simulated-user interactions: not supported
    max_tool_response_length: int = 256  # tokens of one tool message (longer: cut)


@dataclass
class RolloutConfig:
    name: str = "hf"  # hf | vllm
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    do_sample: bool = True
    ignore_eos: bool = False
    micro_batch_size: Optional[int] = None  # sequences per generation pass; None: all
    shared_prefill: bool = True  # hf: a prompt is prefilled once, its KV cache shared by its n samples
    remove_padding: bool = True  # hf: ended sequences leave the decoding batch; chunks of alike prompt lengths
    early_stop: bool = True  # hf: stop decoding once every sequence has ended
    log_prob_micro_batch_size: int = 64
    # the policy's log-prob pass in token-budget micro-batches; null: actor.use_dynamic_bsz / its budget
    log_prob_use_dynamic_bsz: Optional[bool] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    # vLLM's engine (rollout.name=vllm), handed to vllm.LLM; null: vLLM's own default (VLLM_SETTINGS)
    enable_chunked_prefill: Optional[bool] = None
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_model_len: Optional[int] = None  # null: data.max_prompt_length + data.max_response_length
    enforce_eager: Optional[bool] = None
    load_format: Optional[str] = None  # verl's dummy_dtensor/dummy_hf: vLLM's dummy, the policy's weights pushed in
    # how a LoRA policy reaches the engine: adapter (the engine applies the adapters: hf samples from the policy
    # itself, vLLM gets a LoRA request) | merged (the engine holds the base with the adapters merged in: a second
    # copy on hf, full weights into vLLM); null: adapter on hf (no second copy), merged on vLLM
    lora_sync: Optional[str] = None
    trace: Dict[str, Any] = field(default_factory=dict)  # verl's rollout tracing (backend, token2text): named unused
    free_cache_engine: bool = True  # vLLM sleeps between generations: KV cache freed, weights moved to the CPU
    layered_summon: bool = False  # verl's layer-by-layer LoRA weight sync: posttrain syncs its own way (unused)
    mode: str = "sync"  # verl's sync | async (its server); posttrain's vLLM rollout is one LLM.generate per step
    # more vllm.LLM arguments by name (rollout.engine_kwargs.vllm.swap_space=4), checked against vLLM's EngineArgs
    engine_kwargs: Dict[str, Dict[str, Any]] = field(default_factory=lambda: {"vllm": {}})
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla (PPO-clip, token ratios) | gspo (sequence ratio) | gpg (no ratio)


@dataclass
class MixedPrecisionConfig:
    """FSDP2's mixed precision of the policy (verl's fsdp_config.mixed_precision.*)."""

    param_dtype: Optional[str] = None  # compute dtype over the stored weights; null: bfloat16 on GPUs, none on CPUs
    reduce_dtype: str = "float32"  # gradients are reduced across workers in this dtype
    buffer_dtype: str = "float32"  # FSDP1's: FSDP2 keeps buffers as stored (another value is named unused)


@dataclass
class ActorConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1  # -1: lr_warmup_steps_ratio x total steps
    lr_warmup_steps_ratio: float = 0.0
    # null: warm-up factor (step + 1) / W; s in (0, 1]: torch LinearLR's s + (1 - s) * min(step, W) / W (NeMo-RL)
    lr_warmup_start_factor: Optional[float] = None
    grad_clip: float = 1.0
    ppo_mini_batch_size: int = 64  # prompts (x rollout.n sequences)
    ppo_micro_batch_size: int = 8  # sequences
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
    strategy: str = "fsdp2"
    fsdp_size: int = -1  # -1: shard over every worker (verl's fsdp_config.fsdp_size; hybrid sharding is refused)
    # Ulysses sequence parallelism: groups of this many workers take the same rows and split each sequence's
    # positions (training/ulysses.py); it must divide the workers and the model's attention heads
    ulysses_sequence_parallel_size: int = 1
    use_torch_compile: bool = False  # the log-prob and entropy functions torch.compile'd (the model is not)
    entropy_from_logits_with_chunking: bool = False  # the entropy 2048 tokens at a time: smaller temporaries
    entropy_checkpointing: bool = False  # the entropy's temporaries recomputed in the backward instead of kept
    # FSDP2's CPUOffloadPolicy: sharded parameters and gradients live in CPU memory, copied to the GPU layer by
    # layer for each pass, and the optimizer steps on the CPU (needs FSDP2 workers: trainer.use_ray or > 1 GPU)
    param_offload: bool = False
    optimizer_offload: bool = False  # the optimizer's state moves to the CPU between updates
    forward_prefetch: bool = False  # FSDP2: each layer gathers the next one's parameters as it starts
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    use_orig_params: bool = False  # FSDP1's flag: FSDP2 always keeps the original parameters (named unused)
    freeze_vision_tower: bool = False  # a vision-language model's image encoder keeps its weights


@dataclass
class RefConfig:
    log_prob_micro_batch_size: int = 64
    strategy: str = "fsdp2"
    fsdp_size: int = -1
    ulysses_sequence_parallel_size: Optional[int] = None  # null: the actor's (one size for all of a worker's models)
    use_torch_compile: bool = False  # the reference pass's log-prob function torch.compile'd
    entropy_from_logits_with_chunking: bool = False  # verl's: the reference pass computes no entropy (unused)
    # param_offload: the reference's sharded parameters in CPU memory (FSDP2's CPUOffloadPolicy, as the actor's)
    log_prob_use_dynamic_bsz: Optional[bool] = None  # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # null: actor.ppo_max_token_len_per_gpu
    param_offload: bool = False
    forward_prefetch: bool = False  # as actor.forward_prefetch, for the reference's FSDP2 shards


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: drop groups whose metric is the same for every sample."""

    enable: bool = False
    metric: str = "acc"  # acc | score (the reward before shaping) | seq_reward | seq_final_reward (after)
    max_num_gen_batches: int = 10  # most generation rounds per step (<= 0: no cap)


@dataclass
class PFPPOConfig:
    """PF-PPO's policy filtration (algorithm.use_pf_ppo): the update's rows redrawn, favouring reliable rewards."""

    reweight_method: str = "pow"  # pow | max_min | max_random (algorithms.pf_ppo_weights)
    weight_pow: float = 2.0


@dataclass
class AlgorithmConfig:
    name: Optional[str] = None  # a preset: one of ALGORITHMS (algorithm_presets.py); your keys win
    adv_estimator: str = "grpo"  # grpo | grpo_loo | gae | rloo | ...: algorithms.ADV_ESTIMATORS
    norm_adv_by_std_in_grpo: bool = True  # grpo, grpo_loo, grpo_passk: divide by the (group's) std
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    gamma: float = 1.0
    lam: float = 1.0
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    use_pf_ppo: bool = False  # after GAE, as verl: needs adv_estimator=gae
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    # truncated responses (no EOS within data.max_response_length) count in their group's advantages, but add
    # nothing to the policy loss, KL loss or token counts (NeMo-RL's grpo.overlong_filtering)
    overlong_filtering: bool = False


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment: a penalty growing linearly from 0 to
    -penalty_factor over the last `len` tokens before data.max_response_length."""

    enable: bool = False
    len: Optional[int] = None  # tokens; null: a fifth of max_resp_len
    penalty_factor: float = 1.0
    log: bool = True
    # the length the penalty is counted back from (verl's reward_model.reward_kwargs.max_resp_len);
    # null: data.max_response_length
    max_resp_len: Optional[int] = None


@dataclass
class RewardModelConfig:
    """A sequence-classification model that scores each (prompt, response): verl's reward_model.*."""

    enable: bool = False  # its score is the reward (with reward.custom_fn: that function's extra_info["rm_score"])
    path: Optional[str] = None
    micro_batch_size: int = 64  # chats per scoring pass (verl's reward_model.micro_batch_size_per_gpu)
    max_length: Optional[int] = None  # chats cut to this many of the reward model's tokens; null: not cut
    trust_remote_code: bool = False
    use_remove_padding: bool = True  # chats of alike length share a scoring pass
    param_offload: bool = False  # its weights wait in CPU memory between scoring calls (verl's fsdp_config.*)
    input_tokenizer: Optional[str] = None  # verl's: responses are decoded by the policy's tokenizer either way
    use_reward_loop: bool = False  # verl's choice of its reward workers; named unused
    rollout: Dict[str, Any] = field(default_factory=dict)  # verl's vLLM server for the model; named unused


@dataclass
class SandboxFusionConfig:
    """A SandboxFusion service that runs code sources' responses against their tests (rewards.sandbox)."""

    url: Optional[str] = None  # its /run_code endpoint; null: code sources (apps, taco, ...) score 0 as errors
    max_concurrent: int = 64  # requests in flight, shared equally by the reward processes (each at least 1)
    memory_limit_mb: int = 1024  # per program run


@dataclass
class RewardConfig:
    custom_fn: Optional[str] = None  # FILE.py:FUNCTION (FUNCTION defaults to compute_score)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward_manager: str = "naive"  # verl's naive | prime | dapo | batch: posttrain scores in worker processes
    timeout_s: float = 10.0  # per call; a worker still on it timeout_s + 0.5 s later is killed
    num_workers: Optional[int] = None  # reward processes; null: min(8, CPUs); 0: in the trainer (e.g. to debug)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # null: the actor's model.path (or the embedded tiny model)
    enable_gradient_checkpointing: bool = False
    use_remove_padding: Optional[bool] = None  # null: model.use_remove_padding
    # FSDP2's CPU offload of the critic's parameters (and gradients), its optimizer state on the CPU between
    # updates (see actor.param_offload); verl's critic.model.fsdp_config.*
    param_offload: bool = False
    optimizer_offload: bool = False
    fsdp_size: int = -1


@dataclass
class CriticConfig:
    """The value model of PPO with GAE (algorithm.adv_estimator=gae): the
    critic model's LM with a scalar value head."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ulysses_sequence_parallel_size: Optional[int] = None  # null: the actor's
    lr: float = 1e-5
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_warmup_start_factor: Optional[float] = None  # as actor.lr_warmup_start_factor, for the critic's warm-up
    grad_clip: float = 1.0
    ppo_mini_batch_size: Optional[int] = None  # prompts; null: actor.ppo_mini_batch_size
    ppo_micro_batch_size: Optional[int] = None  # sequences; null: actor.ppo_micro_batch_size
    forward_micro_batch_size: Optional[int] = None  # sequences per value pass; null: rollout.log_prob_micro_batch_size
    use_dynamic_bsz: Optional[bool] = None  # token-budget micro-batches (see actor.use_dynamic_bsz); null: the actor's
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: Optional[int] = None  # value passes' budget; null: ppo_max_token_len_per_gpu
    ppo_epochs: Optional[int] = None  # null: actor.ppo_epochs
    cliprange_value: float = 0.5
    loss_agg_mode: Optional[str] = None  # null: actor.loss_agg_mode


@dataclass
class TrainerConfig:
    use_legacy_worker_impl: str = "auto"  # verl's choice of its own worker classes: posttrain has one kind
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # None: total_epochs x steps per epoch
    max_epochs: Optional[int] = None  # stop after this many passes over the data even if total_training_steps is more
    save_freq: int = -1  # -1: never
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
    # verl keeps the critic's apart; a posttrain checkpoint holds both, so it may only equal max_ckpt_to_keep
    max_critic_ckpt_to_keep: Optional[int] = None
    keep_top_k: Optional[int] = None  # also keep the best K by keep_top_k_metric
    keep_top_k_metric: str = "val/score/mean"
    keep_top_k_mode: str = "max"  # max | min
    n_gpus_per_node: int = 1  # workers per node (devices; CPU workers with device=cpu)
    nnodes: int = 1
    device: str = "auto"  # auto | cpu | cuda
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
# rollout keys that configure vLLM's engine: other engines name them as unused (unused_engine_settings)
VLLM_SETTINGS = ("enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                 "enforce_eager", "load_format")


# ---------------------------------------------------------------- loading

def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'actor': {'lr': 1}} -> {'actor.lr': 1}."""
    if prefix.count(".") > 8:  # deeper than any key: a YAML anchor that holds itself (&a {x: *a}) never ends
        raise ConfigError(f"config key {_short(prefix, 60)} nests deeper than any posttrain key; fix the YAML "
                          "(an anchor that refers to itself?)")
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in SCHEMA:
            out.update(flatten(v, key + "."))
        elif (v is None or v == {}) and _is_section(key):
            continue  # `actor:` left empty in a YAML file: a section with nothing set, not an unknown key
        else:
            out[key] = v
    return out


def _is_section(key: str) -> bool:
    """Whether `key` names a group of keys (actor, actor_rollout_ref.rollout), not one key."""
    prefixes = [*SCHEMA, *aliases.EXACT, *(verl for verl, _ in aliases.PREFIXES)]
    return key not in SCHEMA and any(k.startswith(key + ".") for k in prefixes)


def unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def parse_override(arg: str) -> tuple[str, Any]:
    """'a.b=1e-5' -> ('a.b', 1e-05); '+a=x' (Hydra's add syntax) is accepted."""
    if "=" not in arg:
        raise ConfigError(f"override {arg!r} is not key=value")  # repr: a newline in it stays on one line
    key, raw = arg.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except _YAML_ERRORS:
        value = raw
    return key, value


# PyYAML's safe_load raises plain errors too: ValueError ('2020-02-30', '!!float abc'), KeyError ('!!bool x'),
# AttributeError ('!!timestamp x'), RecursionError ('[' x 2000)
_YAML_ERRORS = (yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError, RecursionError)


def _nemo_override(arg: str) -> tuple[str, str, Any]:
    """A Hydra-style override: '++a.b=1' / '+a.b=1' / 'a.b=1' set, '~a.b' deletes. -> (op, key, value)."""
    if arg.startswith("~"):
        return "~", arg[1:].split("=", 1)[0], None
    key = parse_override(arg)[0]
    return ("+" if arg.startswith("+") else ""), key, nemo_rl.value_of(arg.split("=", 1)[1])


def nearest(key: str) -> str:
    candidates = list(SCHEMA) + list(aliases.alias_table(SCHEMA))
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def canonicalize(flat: dict[str, Any], origin: str) -> dict[str, Any]:
    """Map verl keys to ours, refuse unknown keys, normalise scalars to lists."""
    out: dict[str, Any] = {}
    reward_path = flat.pop(aliases.CUSTOM_REWARD_PATH, None)
    reward_name = flat.pop(aliases.CUSTOM_REWARD_NAME, None)
    if reward_path:
        out["reward.custom_fn"] = f"{reward_path}:{reward_name or 'compute_score'}"
    for key, value in flat.items():
        if key in aliases.IGNORED:
            if value != aliases.IGNORED[key]:
                raise ConfigError(f"{key}={_show(value)} is not supported; posttrain always runs with {key}="
                                  f"{aliases.IGNORED[key]}")
            continue
        ours = aliases.to_canonical(key, SCHEMA) or _below_dict_key(key)
        if ours is None:
            if key.startswith(aliases.VERL_PREFIXES):
                raise ConfigError(
                    f"verl key {key!r} ({origin}) is not supported yet by posttrain{nearest(key)} "
                    "(`posttrain train --help-config` lists the supported keys)")
            raise ConfigError(f"unknown config key {key!r} ({origin}){nearest(key)}")  # repr: one line
        if ours in LIST_KEYS and isinstance(value, (str, int, float)):
            value = [value]
        if ours in LIST_KEYS and value is not None and (
                not isinstance(value, list) or any(isinstance(v, (list, dict)) for v in value)):
            # OmegaConf checks a list's element types but lets a nested list or dict through
            raise ConfigError(f"config key '{ours}' ({origin}) expects a list of plain values, got "
                              f"{_short(value)}; write it as [a, b]")
        if invalid_text(value):  # a lone surrogate (argv in another encoding): the saved config.yaml could not hold it
            raise ConfigError(f"config key '{ours}' ({origin}) holds text that is not valid unicode; re-type the value")
        out[ours] = value
    return out




def _below_dict_key(key: str) -> str | None:
    """Our spelling of a key inside a free-form mapping (rollout.engine_kwargs.vllm.X), verl's prefixes mapped."""
    spellings = [key] + [ours + key[len(verl):] for verl, ours in aliases.PREFIXES if key.startswith(verl)]
    return next((k for k in spellings if any(k.startswith(d + ".") for d in DICT_KEYS)), None)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _read_yaml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing YAML file or only key=value overrides")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except _YAML_ERRORS as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(f"config file '{p}' is not valid YAML ({first}); fix the file") from e
    except UnicodeDecodeError as e:  # another encoding, or not text at all
        raise ConfigError(f"config file '{p}' is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from e
    except OSError as e:
        raise ConfigError(f"config file '{p}' cannot be read ({e.strerror or e}); check its permissions") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of keys, not {type(data).__name__}")
    return data


def preset() -> dict[str, Any]:
    text = resources.files("posttrain.configs").joinpath("tiny_arith.yaml").read_text()
    return flatten(yaml.safe_load(text))


def load_config(config_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults < embedded preset (only without model.path) < algorithm.name's
    preset < YAML file < overrides."""
    layers, nemo_tree = [], None
    if config_path:
        data = _read_yaml(config_path)
        if nemo_rl.is_layout(data):  # NeMo-RL's grpo.*/policy.*/... layout, its `defaults:` files under it
            nemo_tree = nemo_rl.load_tree(config_path)
        else:
            layers.append(canonicalize(flatten(data), f"in {config_path}"))
    nemo_overrides = [a for a in overrides if "=" in a and nemo_rl.is_key(a.split("=", 1)[0], nemo_tree)]
    nemo_overrides += [a for a in overrides if a.startswith("~") and "=" not in a]  # Hydra's delete
    overrides = [a for a in overrides if a not in nemo_overrides]
    ours = canonicalize(dict(parse_override(a) for a in overrides), "on the command line")
    if nemo_tree is not None or nemo_overrides:
        origin = f"in {config_path}" if nemo_tree is not None else "on the command line"
        tree = nemo_rl.apply_overrides(nemo_tree or {}, [_nemo_override(a) for a in nemo_overrides])
        nemo = nemo_rl.translate(nemo_rl.resolve(tree), origin + " (NeMo-RL's layout)")
        for files, name in (("data.train_files", "data.dataset_name"), ("data.val_files", "data.val_dataset_name")):
            if files in ours:  # files on the command line replace the file's dataset
                nemo.pop(name, None)
        layers.append(canonicalize(nemo, origin))
    layers.append(ours)
    name = next((layer["algorithm.name"] for layer in reversed(layers) if "algorithm.name" in layer), None)
    if name is not None and (not isinstance(name, str) or name not in algorithm_presets.ALGORITHMS):
        shown = _show(name) if isinstance(name, str) else _short(name)  # e.g. [a]: a list is no name
        raise ConfigError(f"algorithm.name={shown} is not one of: {', '.join(algorithm_presets.ALGORITHMS)}")
    try:
        layers.insert(0, algorithm_presets.preset_layer(name))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not any("model.path" in layer for layer in layers):
        layers.insert(0, preset())
    merged = OmegaConf.structured(Config)
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(unflatten(layer)))
        except _REFUSED:
            raise _type_error(merged, layer) from None
    try:
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # e.g. '${x}' in a value: OmegaConf's interpolation, resolved here
        raise ConfigError(f"config key '{getattr(e, 'full_key', '')}' cannot be resolved "
                          f"({_short(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)}); "
                          "'${...}' in a value is an OmegaConf interpolation: fix it or escape it as '\\${...}'") from None
    validate(cfg)
    return cfg


# how OmegaConf refuses a value: its own errors, and a few plain ones (an int too large for a float
# field: OverflowError; a dict onto a list: TypeError; a YAML alias that holds itself: RecursionError)
_REFUSED = (OmegaConfBaseException, TypeError, ValueError, OverflowError, RecursionError)


def _type_error(merged, layer: dict) -> ConfigError:
    """Find the key of `layer` that OmegaConf refused, and say what it expects."""
    for key, value in layer.items():
        try:
            OmegaConf.merge(merged, OmegaConf.create(unflatten({key: value})))
        except _REFUSED:
            if key not in SCHEMA:  # below a free-form mapping (rollout.engine_kwargs.vllm.X): e.g. a date
                return ConfigError(f"config key '{key}' expects a number, text, true/false or a list of them, got "
                                   f"{_short(value)}; fix the value")
            kind = getattr(SCHEMA[key][0], "__name__", str(SCHEMA[key][0])).replace("typing.", "")
            return ConfigError(f"config key '{key}' expects {kind}, got {_short(value)}; fix the value")
    return ConfigError(f"config values {_short(layer, 200)} do not fit the config's types; fix them")


# ---------------------------------------------------------------- validation

def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(key: str, value, allowed) -> None:
    _need(value in allowed, f"{key}={_show(value)} is not one of: {', '.join(map(str, allowed))}")


def _show(value) -> str:
    """A value for a one-line message: as typed, or repr'd when it holds a newline or another
    unprintable character ('a\\nb')."""
    text = str(value)
    return text if text.isprintable() else repr(value)


def validate(cfg: Config) -> None:
    """Ranges, choices and cross-field rules; fills derived values in place."""
    d, r, a, alg, tr = cfg.data, cfg.rollout, cfg.actor, cfg.algorithm, cfg.trainer
    for key in ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "rollout.n",
                "rollout.log_prob_micro_batch_size", "ref.log_prob_micro_batch_size", "actor.ppo_mini_batch_size",
                "actor.ppo_micro_batch_size", "actor.ppo_epochs", "rollout.val_kwargs.n",
                "rollout.tensor_model_parallel_size", "trainer.n_gpus_per_node", "trainer.nnodes",
                "trainer.total_epochs", "trainer.cpus_per_worker"):
        value = _get(cfg, key)
        _need(value > 0, f"{key} must be a positive integer, got {value}")
    for key in ("data.val_batch_size", "data.val_max_samples", "rollout.micro_batch_size",
                "trainer.total_training_steps"):
        value = _get(cfg, key)
        _need(value is None or value > 0, f"{key} must be a positive integer or null, got {value}")
    _need(0 <= d.val_split_size < 1, f"data.val_split_size must be in [0, 1) (the share of training prompts held "
          f"out for validation), got {d.val_split_size}")
    _need(a.lr > 0, f"actor.lr must be > 0, got {a.lr}")
    _need(a.grad_clip > 0, f"actor.grad_clip must be > 0, got {a.grad_clip}")
    _need(len(a.betas) == 2 and all(0 <= b < 1 for b in a.betas), f"actor.betas must be two numbers in [0, 1), got {a.betas}")
    _need(r.temperature >= 0, f"rollout.temperature must be >= 0, got {r.temperature}")
    _need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _need(0 < r.gpu_memory_utilization <= 1, f"rollout.gpu_memory_utilization must be in (0, 1], got {r.gpu_memory_utilization}")
    _need(a.clip_ratio_c is None or a.clip_ratio_c > 1,
          f"actor.clip_ratio_c must be > 1, or null (no dual clip), got {a.clip_ratio_c}")
    for key in ("actor.lr_warmup_start_factor", "critic.lr_warmup_start_factor"):
        value = _get(cfg, key)
        _need(value is None or 0 < value <= 1, f"{key} must be in (0, 1] (the LR factor of the first step, as "
              f"torch's LinearLR start_factor) or null (warm-up from 1/W), got {value}")
    _need(tr.max_epochs is None or tr.max_epochs >= 1,
          f"trainer.max_epochs must be >= 1 or null (no cap on passes over the data), got {tr.max_epochs}")
    _need(cfg.reward.timeout_s > 0, f"reward.timeout_s must be > 0, got {cfg.reward.timeout_s}")
    _need(cfg.reward.num_workers is None or cfg.reward.num_workers >= 0,
          f"reward.num_workers must be >= 0 (0: score in the trainer process) or null (min(8, CPUs)), "
          f"got {cfg.reward.num_workers}")
    _need(tr.collective_timeout_s > 0, f"trainer.collective_timeout_s must be > 0, got {tr.collective_timeout_s}")
    for key in ("model.dtype", "actor.mixed_precision.param_dtype", "actor.mixed_precision.reduce_dtype",
                "actor.mixed_precision.buffer_dtype"):
        section, leaf = key.rsplit(".", 1)
        value = DTYPE_SPELLINGS.get(_get(cfg, key), _get(cfg, key))  # verl's bf16 / fp32 / fp16
        setattr(_get(cfg, section), leaf, value)
        if value is not None:
            _choice(key, value, ("float32", "bfloat16", "float16"))
    _choice("data.truncation", d.truncation, ("error", "left", "right"))
    _need(not d.custom_cls.path, f"data.custom_cls.path={_show(d.custom_cls.path)}: a verl dataset class is not "
          "supported; posttrain reads parquet rows itself (prompt, data_source, reward_model.ground_truth): write "
          "the data in that layout (`posttrain preprocess` has examples) and leave data.custom_cls out")
    validate_dataset_names(d)
    taken = sorted({"conversation", "tokenize", "add_generation_prompt", "return_dict"} & set(d.apply_chat_template_kwargs))
    _need(not taken, f"data.apply_chat_template_kwargs.{', '.join(taken)}: posttrain sets it (prompts are tokenized "
                     "for the assistant's turn); leave it out")
    _need(r.name not in ("sglang", "trtllm"), f"rollout.name={r.name}: posttrain has no {r.name} engine; use "
          "rollout.name=vllm (GPUs) or hf")
    _choice("rollout.name", r.name, ("hf", "vllm"))
    if r.lora_sync is not None:
        _choice("rollout.lora_sync", r.lora_sync, ("adapter", "merged"))
    _choice("rollout.mode", r.mode, ("sync", "async"))
    _need(isinstance(r.engine_kwargs, dict) and all(isinstance(v, dict) for v in r.engine_kwargs.values()),
          "rollout.engine_kwargs maps an engine's name to its arguments (rollout.engine_kwargs.vllm.swap_space=4)")
    for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        _need(getattr(r, key) is None or getattr(r, key) > 0, f"rollout.{key} must be > 0, got {getattr(r, key)}")
    unused = unused_engine_settings(r)
    if unused:
        warnings.warn(f"{', '.join(unused)}: set, but unused by rollout.name={r.name}", stacklevel=2)
    _choice("actor.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    _choice("actor.kl_loss_type", a.kl_loss_type, KL_KINDS)
    _choice("actor.strategy", a.strategy, ("fsdp", "fsdp2"))
    _choice("ref.strategy", cfg.ref.strategy, ("fsdp", "fsdp2"))
    validate_verl_switches(cfg)
    validate_reward_model(cfg)
    _choice("algorithm.kl_penalty", alg.kl_penalty, KL_KINDS)
    _choice("algorithm.kl_ctrl.type", alg.kl_ctrl.type, ("fixed", "adaptive"))
    _choice("trainer.device", tr.device, ("auto", "cpu", "cuda"))
    _choice("trainer.keep_top_k_mode", tr.keep_top_k_mode, ("max", "min"))
    _need(tr.resume_mode != "resume_path" or bool(tr.resume_from_path),
          "trainer.resume_mode=resume_path needs trainer.resume_from_path=<a global_step_N directory>")
    _need(tr.max_critic_ckpt_to_keep in (None, tr.max_ckpt_to_keep) or alg.adv_estimator not in NEEDS_CRITIC,
          f"trainer.max_critic_ckpt_to_keep={tr.max_critic_ckpt_to_keep}: a posttrain checkpoint holds the actor and "
          f"the critic together; set trainer.max_ckpt_to_keep (verl's max_actor_ckpt_to_keep, now "
          f"{tr.max_ckpt_to_keep}) to the count you want for both")
    for key in ("trainer.max_ckpt_to_keep", "trainer.keep_top_k"):
        _need(_get(cfg, key) is None or _get(cfg, key) > 0, f"{key} must be a positive integer or null")
    _need(alg.adv_estimator in ADV_ESTIMATORS,
          f"algorithm.adv_estimator={_show(alg.adv_estimator)} is not supported; supported: {', '.join(ADV_ESTIMATORS)}")
    if alg.kl_ctrl.type == "adaptive":
        _need(alg.kl_ctrl.target_kl > 0 and alg.kl_ctrl.horizon > 0,
              "the adaptive KL controller needs algorithm.kl_ctrl.target_kl > 0 and algorithm.kl_ctrl.horizon > 0")
    _choice("actor.policy_loss.loss_mode", a.policy_loss.loss_mode, POLICY_LOSSES)
    _need(a.loss_scale_factor is None or a.loss_scale_factor > 0,
          f"actor.loss_scale_factor must be > 0 or null, got {a.loss_scale_factor}")
    _choice("algorithm.filter_groups.metric", alg.filter_groups.metric, FILTER_METRICS)
    _need(alg.gamma >= 0 and 0 <= alg.lam <= 1, f"algorithm.gamma must be >= 0 and algorithm.lam in [0, 1], got "
          f"{alg.gamma} and {alg.lam}")
    _need(alg.adv_estimator != "grpo_passk" or r.n >= 2,
          f"algorithm.adv_estimator=grpo_passk compares the samples of a prompt: it needs rollout.n >= 2, got {r.n}")
    _need(alg.adv_estimator != "grpo_loo" or r.n >= 2,
          f"algorithm.adv_estimator=grpo_loo compares each sample with the other samples of its prompt: it needs "
          f"rollout.n >= 2 (with one sample every advantage is 0), got {r.n}")
    _need(not (alg.overlong_filtering and r.ignore_eos),
          "algorithm.overlong_filtering=true with rollout.ignore_eos=true: every response runs to "
          "data.max_response_length without ending, so every one would be filtered out of the loss; turn one off")
    if alg.use_pf_ppo:
        _choice("algorithm.pf_ppo.reweight_method", alg.pf_ppo.reweight_method, PF_PPO_METHODS)
        _need(alg.adv_estimator in NEEDS_CRITIC, f"algorithm.use_pf_ppo=true resamples the batch after GAE (as verl): "
              f"it needs algorithm.adv_estimator=gae, got {alg.adv_estimator}")
    _need(tr.critic_warmup >= 0, f"trainer.critic_warmup must be >= 0, got {tr.critic_warmup}")
    _need(tr.critic_warmup == 0 or alg.adv_estimator in NEEDS_CRITIC,
          f"trainer.critic_warmup={tr.critic_warmup} needs a critic: set algorithm.adv_estimator=gae "
          "(or algorithm.name=ppo), or trainer.critic_warmup=0")
    validate_critic(cfg)
    validate_overlong(cfg)
    validate_profiler(cfg)
    for sink in tr.logger:
        _need(sink in LOGGERS, f"trainer.logger {sink!r} is not one of: {', '.join(LOGGERS)} (metrics.jsonl is always "
                               "written in the run directory)")
    _need(tr.peak_flops is None or tr.peak_flops > 0, f"trainer.peak_flops must be > 0 FLOP/s, got {tr.peak_flops}")
    _need(tr.log_samples_prompts >= 0 and tr.log_val_generations >= 0,
          "trainer.log_samples_prompts and trainer.log_val_generations must be >= 0")
    # cross-field rules (mini-batches count prompts, micro-batches count sequences, as in verl)
    _need(a.ppo_mini_batch_size <= d.train_batch_size,
          f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} is larger than data.train_batch_size={d.train_batch_size}")
    _need(d.train_batch_size % a.ppo_mini_batch_size == 0,
          f"data.train_batch_size={d.train_batch_size} must be divisible by actor.ppo_mini_batch_size="
          f"{a.ppo_mini_batch_size}")
    _need(a.use_dynamic_bsz or (a.ppo_mini_batch_size * r.n) % a.ppo_micro_batch_size == 0,
          f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size * r.n} sequences must be divisible by "
          f"actor.ppo_micro_batch_size={a.ppo_micro_batch_size}")
    validate_token_budgets(cfg)
    world = data_parallel_groups(cfg)
    _need((a.ppo_mini_batch_size * r.n) % world == 0,
          f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size * r.n} sequences must be divisible by the "
          f"{world} workers (trainer.nnodes x trainer.n_gpus_per_node"
          f"{' / actor.ulysses_sequence_parallel_size' if world != tr.nnodes * tr.n_gpus_per_node else ''}): each "
          "takes an equal share of every mini-batch")
    if a.use_kl_loss and alg.use_kl_in_reward:
        warnings.warn("both actor.use_kl_loss and algorithm.use_kl_in_reward are on: KL is penalised twice",
                      stacklevel=2)
    # derived values
    a.clip_ratio_low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    a.clip_ratio_high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    _need(0 <= a.clip_ratio_low < 1 and a.clip_ratio_high >= 0, "actor.clip_ratio_low must be in [0, 1) and "
          "actor.clip_ratio_high >= 0")
    d.seed = tr.seed if d.seed is None else d.seed


# set to anything but their default, these are named in one warning line as unused
LORA_ONLY_KEYS = ("model.lora_alpha", "model.target_modules", "model.exclude_modules", "model.lora_dropout",
                  "rollout.lora_sync")
VERL_ONLY_KEYS = ("data.return_raw_chat", "trainer.use_legacy_worker_impl", "reward.model.use_reward_loop",
                  "reward.model.rollout", "model.use_shm", "rollout.layered_summon", "rollout.trace",
                  "ref.entropy_from_logits_with_chunking", "actor.use_orig_params")


def uses_lora(cfg: Config) -> bool:
    return cfg.model.lora_rank > 0 or bool(cfg.model.lora_adapter_path)


def data_parallel_groups(cfg: Config) -> int:
    """Workers that take rows of their own: all of them, or their Ulysses groups."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node // cfg.actor.ulysses_sequence_parallel_size


def validate_dataset_names(d: DataConfig) -> None:
    """data.dataset_name / val_dataset_name: known, usable for their split, and not set beside the files they
    replace. Names only: whether the files are there is for build time (data.named.resolve)."""
    from posttrain.data import named

    for files, name, split in (("train_files", "dataset_name", "train"), ("val_files", "val_dataset_name", "test")):
        value = getattr(d, name)
        _need(value is None or getattr(d, files) is None,
              f"data.{files} and data.{name}={_show(value)} are both set; keep one (files, or a known dataset name)")
        if value is not None:
            named.lookup(value, split)


def validate_verl_switches(cfg: Config) -> None:
    """verl's switches for what posttrain does not do: the value that means "off" is accepted (it is
    what posttrain does), any other is refused with the alternative; verl-only inputs are named as unused."""
    validate_sequence_parallel(cfg)
    for sec in ("actor", "ref", "critic.model"):
        n = _get(cfg, f"{sec}.fsdp_size")
        _need(n == -1, f"{sec}.fsdp_size={n}: hybrid sharding is not supported, FSDP2 shards over every worker; "
                       "set it to -1")
    backend = cfg.model.fused_kernel_options.impl_backend
    _need(backend in (None, "torch", "triton"), f"model.fused_kernel_options.impl_backend={_show(backend)} is not one "
          "of: torch, triton")
    m = cfg.model
    _need(m.lora_rank >= 0, f"model.lora_rank must be >= 0 (0: train all weights), got {m.lora_rank}")
    _need(0 <= m.lora_dropout < 1, f"model.lora_dropout must be in [0, 1), got {m.lora_dropout}")
    _need(not uses_lora(cfg) or m.lora_alpha > 0, f"model.lora_alpha must be > 0, got {m.lora_alpha}")
    validate_multi_turn(cfg)
    lora_only = [k for k in LORA_ONLY_KEYS if _get(cfg, k) != SCHEMA[k][1]] if not uses_lora(cfg) else []
    if not cfg.rollout.multi_turn.enable:
        lora_only += [k for k in SCHEMA if k.startswith("rollout.multi_turn.") and _get(cfg, k) != SCHEMA[k][1]]
    inert = [k for k in VERL_ONLY_KEYS if _get(cfg, k) != SCHEMA[k][1]]
    if cfg.trainer.max_critic_ckpt_to_keep is not None and cfg.algorithm.adv_estimator not in NEEDS_CRITIC:
        inert.append("trainer.max_critic_ckpt_to_keep (no critic)")
    if cfg.data.custom_cls.name and not cfg.data.custom_cls.path:
        inert.append("data.custom_cls.name (no path)")
    if cfg.actor.mixed_precision.buffer_dtype != "float32":
        inert.append(f"actor.mixed_precision.buffer_dtype={cfg.actor.mixed_precision.buffer_dtype}")
    if backend == "triton" or (backend and not m.use_fused_kernels):
        inert.append(f"model.fused_kernel_options.impl_backend={backend}")  # our fused pass is torch code
    if lora_only:
        warnings.warn(f"{', '.join(lora_only)}: settings of LoRA (off: model.lora_rank=0) or multi-turn rollouts "
                      "(rollout.multi_turn.enable=false), which are off; set, but unused", stacklevel=3)
    if inert:
        warnings.warn(f"{', '.join(inert)}: verl's settings for what posttrain does its own way (its servers, "
                      "worker classes, kernels: `posttrain train --help-config` says each); set, but unused",
                      stacklevel=3)


def validate_multi_turn(cfg: Config) -> None:
    """rollout.multi_turn.*: hermes tool calls, at least one tool, no simulated user."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    _choice("rollout.multi_turn.format", mt.format, ("hermes",))
    _need(bool(mt.tool_config_path or mt.tools), "rollout.multi_turn.enable=true needs tools: "
          "rollout.multi_turn.tool_config_path=TOOLS.yaml (verl's format) or rollout.multi_turn.tools=[pkg.mod:fn]")
    _need(mt.interaction_config_path is None and mt.max_user_turns is None,
          "rollout.multi_turn.interaction_config_path / max_user_turns (a simulated user between turns) are not "
          "supported; remove them (the model's turns alternate with tool messages only)")
    _need(mt.max_assistant_turns is None or mt.max_assistant_turns >= 1,
          f"rollout.multi_turn.max_assistant_turns must be >= 1 or null (5), got {mt.max_assistant_turns}")
    _need(mt.max_tool_response_length >= 1,
          f"rollout.multi_turn.max_tool_response_length must be >= 1, got {mt.max_tool_response_length}")


def validate_sequence_parallel(cfg: Config) -> None:
    """Ulysses: one size for a worker's models (the reference's and critic's null: the actor's), dividing
    the workers; each group of that many workers takes the same rows."""
    size = cfg.actor.ulysses_sequence_parallel_size
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    _need(size >= 1, f"actor.ulysses_sequence_parallel_size must be >= 1, got {size}")
    for sec in (cfg.ref, cfg.critic):
        sec.ulysses_sequence_parallel_size = sec.ulysses_sequence_parallel_size or size
    for key in ("ref.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"):
        _need(_get(cfg, key) == size, f"{key}={_get(cfg, key)} differs from actor.ulysses_sequence_parallel_size="
              f"{size}: posttrain's workers hold the actor, reference and critic together and split sequences "
              "one way for all of them; set them equal (or leave this one out)")
    if size == 1:
        return
    _need(world % size == 0, f"actor.ulysses_sequence_parallel_size={size} must divide the {world} workers "
          "(trainer.nnodes x trainer.n_gpus_per_node)")
    _need(not cfg.model.use_fused_kernels, f"model.use_fused_kernels=true with actor.ulysses_sequence_parallel_size="
          f"{size}: the fused pass does not split sequences yet; turn one of them off")


def validate_reward_model(cfg: Config) -> None:
    rm = cfg.reward.model
    _need(not rm.enable or bool(rm.path), "reward.model.enable=true needs reward.model.path (verl's "
          "reward_model.model.path): a Hugging Face sequence-classification model directory")
    _need(rm.micro_batch_size > 0, f"reward.model.micro_batch_size must be > 0, got {rm.micro_batch_size}")
    _choice("reward.reward_manager", cfg.reward.reward_manager, ("naive", "prime", "dapo", "batch"))
    sf = cfg.reward.sandbox_fusion
    _need(not sf.url or (sf.url.startswith(("http://", "https://")) and sf.url.isprintable() and " " not in sf.url),
          f"reward.sandbox_fusion.url must be an http:// or https:// URL (a SandboxFusion /run_code endpoint), "
          f"got {_show(sf.url)}")
    for key in ("max_concurrent", "memory_limit_mb"):
        _need(getattr(sf, key) > 0, f"reward.sandbox_fusion.{key} must be > 0, got {getattr(sf, key)}")


def unused_engine_settings(r: RolloutConfig) -> list[str]:
    """The rollout settings given that the chosen engine does not use (one warning line names them)."""
    out = [f"rollout.engine_kwargs.{name}" for name, kw in r.engine_kwargs.items() if kw and name != r.name]
    if r.name != "vllm":  # vLLM's engine settings
        out += [f"rollout.{k}" for k in VLLM_SETTINGS if getattr(r, k) is not None]
        out += ["rollout.free_cache_engine=false"] if not r.free_cache_engine else []
    if r.mode == "async":  # verl's server mode: posttrain's rollout generates a step's batch in one call either way
        out.append("rollout.mode=async")
    return out


def validate_token_budgets(cfg: Config) -> None:
    """Fill the log-prob passes' null dynamic-batch settings from the actor's
    (as verl does) and check every budget."""
    a = cfg.actor
    for sec in (cfg.rollout, cfg.ref):
        if sec.log_prob_use_dynamic_bsz is None:
            sec.log_prob_use_dynamic_bsz = a.use_dynamic_bsz
        if sec.log_prob_max_token_len_per_gpu is None:
            sec.log_prob_max_token_len_per_gpu = a.ppo_max_token_len_per_gpu
    for key in ("actor.ppo_max_token_len_per_gpu", "rollout.log_prob_max_token_len_per_gpu",
                "ref.log_prob_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu"):
        _need(_get(cfg, key) > 0, f"{key} must be a positive number of tokens, got {_get(cfg, key)}")


def validate_critic(cfg: Config) -> None:
    """Fill the critic's null sizes from the actor's and check them (only
    when a critic is used: algorithm.adv_estimator=gae)."""
    c, a = cfg.critic, cfg.actor
    c.ppo_mini_batch_size = a.ppo_mini_batch_size if c.ppo_mini_batch_size is None else c.ppo_mini_batch_size
    c.ppo_micro_batch_size = a.ppo_micro_batch_size if c.ppo_micro_batch_size is None else c.ppo_micro_batch_size
    c.ppo_epochs = a.ppo_epochs if c.ppo_epochs is None else c.ppo_epochs
    c.loss_agg_mode = a.loss_agg_mode if c.loss_agg_mode is None else c.loss_agg_mode
    if c.forward_micro_batch_size is None:
        c.forward_micro_batch_size = cfg.rollout.log_prob_micro_batch_size
    c.use_dynamic_bsz = a.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
    if c.forward_max_token_len_per_gpu is None:
        c.forward_max_token_len_per_gpu = c.ppo_max_token_len_per_gpu
    _need(c.forward_max_token_len_per_gpu > 0, "critic.forward_max_token_len_per_gpu must be a positive number "
          f"of tokens, got {c.forward_max_token_len_per_gpu}")
    if cfg.algorithm.adv_estimator not in NEEDS_CRITIC:
        return
    for key in ("critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size", "critic.ppo_epochs",
                "critic.forward_micro_batch_size"):
        _need(_get(cfg, key) > 0, f"{key} must be a positive integer, got {_get(cfg, key)}")
    _need(c.lr > 0, f"critic.lr must be > 0, got {c.lr}")
    _need(c.grad_clip > 0, f"critic.grad_clip must be > 0, got {c.grad_clip}")
    _need(c.cliprange_value > 0, f"critic.cliprange_value must be > 0, got {c.cliprange_value}")
    _choice("critic.loss_agg_mode", c.loss_agg_mode, LOSS_AGG_MODES)
    _need(len(c.betas) == 2 and all(0 <= b < 1 for b in c.betas),
          f"critic.betas must be two numbers in [0, 1), got {c.betas}")
    n, d = cfg.rollout.n, cfg.data
    _need(d.train_batch_size % c.ppo_mini_batch_size == 0,
          f"data.train_batch_size={d.train_batch_size} must be divisible by critic.ppo_mini_batch_size="
          f"{c.ppo_mini_batch_size}")
    world = data_parallel_groups(cfg)
    _need((c.ppo_mini_batch_size * n) % world == 0,
          f"critic.ppo_mini_batch_size x rollout.n = {c.ppo_mini_batch_size * n} sequences must be divisible by the "
          f"{world} workers")


def validate_overlong(cfg: Config) -> None:
    ob = cfg.reward.overlong_buffer
    ob.max_resp_len = cfg.data.max_response_length if ob.max_resp_len is None else ob.max_resp_len
    max_len = ob.max_resp_len
    _need(max_len > 0, f"reward.overlong_buffer.max_resp_len must be > 0, got {max_len}")
    if ob.len is None:
        ob.len = max(1, max_len // 5)
    if ob.enable:
        _need(0 < ob.len <= max_len, f"reward.overlong_buffer.len={ob.len} must be in 1..reward.overlong_buffer."
              f"max_resp_len={max_len} (the penalty grows over the last len tokens before it)")
        _need(ob.penalty_factor >= 0, f"reward.overlong_buffer.penalty_factor must be >= 0, got {ob.penalty_factor}")


def validate_profiler(cfg: Config) -> None:
    """profiler.*: checked; the roles' nulls filled (rollout's from the actor's, as verl's colocated worker;
    the others': off, rank 0); what posttrain does not use named in one warning line."""
    from posttrain.profiling import CONTENTS, ROLE_PHASES, TOOLS, tool_settings

    p, tm = cfg.profiler, cfg.profiler.torch_memory
    _need(p.tool is None or p.tool in TOOLS,
          f"profiler.tool={_show(p.tool)} (verl's global_profiler.tool) is not one of: {', '.join(TOOLS)}")
    _need(all(s > 0 for s in p.steps or ()), f"profiler.steps must list RL steps counted from 1, got {p.steps}")
    _need(tm.trace_alloc_max_entries > 0, "profiler.torch_memory.trace_alloc_max_entries must be > 0")
    _choice("profiler.torch_memory.context", tm.context, (None, "alloc", "state", "all"))
    _choice("profiler.torch_memory.stacks", tm.stacks, ("python", "all"))
    for name in ROLE_PHASES:  # the actor's first
        role, base = getattr(p, name), p.actor if name == "rollout" else ProfilerRoleConfig(False, False, [])
        role.enable = base.enable if role.enable is None else role.enable
        role.all_ranks = base.all_ranks if role.all_ranks is None else role.all_ranks
        role.ranks = list(base.ranks) if role.ranks is None else role.ranks
        _need(all(r >= 0 for r in role.ranks), f"profiler.{name}.ranks must be ranks >= 0, got {role.ranks}")
    for key in [f"profiler.{name}.tool_config" for name in ROLE_PHASES] + ["profiler.global_tool_config"]:
        _need(all(isinstance(v, dict) for v in _get(cfg, key).values()),
              f"{key} maps a tool's name to its settings ({key}.nsys.discrete=true)")
    read, unused = tool_settings(p.tool, {name: getattr(p, name).tool_config for name in ROLE_PHASES})
    for name, settings in read.items():
        contents = settings.get("contents") or []
        discrete = settings.get("discrete", False)
        _need(isinstance(discrete, bool),
              f"profiler.{name}.tool_config.{p.tool}.discrete must be true or false, got {_short(discrete)}")
        _need(isinstance(contents, list) and all(c in CONTENTS for c in contents),
              f"profiler.{name}.tool_config.{p.tool}.contents={_short(contents)} must list some of: "
              f"{', '.join(CONTENTS)}")
    unused += [f"profiler.global_tool_config.{t}.{k}" for t, kw in p.global_tool_config.items()
               for k, v in kw.items() if v not in (None, {})]
    unused += ["profiler.torch_memory.stack_depth"] * (tm.stack_depth != SCHEMA["profiler.torch_memory.stack_depth"][1])
    unused += ["profiler.steps (profiler.tool is null)"] * (p.tool is None and bool(p.steps))
    npu = ("profiler.tool=npu: posttrain runs on CUDA or the CPU, not Ascend NPUs; traced with torch's profiler "
           "instead (torch_npu's profiler is its API), chrome traces in profiler.save_path") if p.tool == "npu" else ""
    if npu or unused:
        warnings.warn("; ".join(filter(None, [npu, unused and f"{', '.join(unused)}: set, but unused"])),
                      stacklevel=3)


# ---------------------------------------------------------------- output

def config_to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def config_to_yaml(cfg: Config | dict) -> str:
    """A Config, or its config_to_dict (e.g. redacted), as YAML in the Config's key order."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(config_to_yaml(cfg))


# What happens to a key, as --help-config shows it; every key not named here is honoured.
ENGINE, ONLY_OFF, UNUSED = "vLLM's engine (named unused on hf)", "only this value; others refused", "verl only: unused"
KEY_STATUS = {**{f"rollout.{k}": ENGINE for k in (*VLLM_SETTINGS, "free_cache_engine", "engine_kwargs")},
              "rollout.mode": "async: named unused", "data.image_key": "rows with images refused",
              **{k: ONLY_OFF for k in ("actor.fsdp_size", "ref.fsdp_size", "critic.model.fsdp_size")},
              **{f"{k}.ulysses_sequence_parallel_size": "only the actor's value" for k in ("ref", "critic")},
              "model.fused_kernel_options.impl_backend": "triton: named unused (the fused pass is torch code)",
              "trainer.max_critic_ckpt_to_keep": "with a critic: only trainer.max_ckpt_to_keep's value",
              "data.custom_cls.path": "only null; a dataset class is refused", "data.custom_cls.name": "with path only",
              **{k: UNUSED for k in VERL_ONLY_KEYS},
              "reward.model.input_tokenizer": "the policy's tokenizer decodes responses either way",
              "reward.reward_manager": "posttrain scores in worker processes whichever",
              **{k: "with model.lora_rank > 0 (without: named unused)" for k in LORA_ONLY_KEYS},
              "profiler.tool": "npu: torch's profiler instead", "profiler.global_tool_config": "named unused",
              "profiler.torch_memory.stack_depth": "named unused (torch records whole stacks)",
              **{f"profiler.{r}.{k}": "the loop's process counts as rank 0"
                 for r in ("actor", "ref", "rollout", "critic") for k in ("ranks", "all_ranks")},
              **{f"profiler.{r}.tool_config": "<tool>.discrete, <torch|npu>.contents read; the rest named unused"
                 for r in ("actor", "ref", "rollout", "critic")}}


def describe_keys() -> str:
    lines = ["posttrain config keys (type = default) [what happens to it, when not simply honoured]:"]
    for key, (typ, default) in SCHEMA.items():
        name = getattr(typ, "__name__", str(typ)).replace("typing.", "")
        status = f"  [{KEY_STATUS[key]}]" if key in KEY_STATUS else ""
        lines.append(f"  {key}: {name} = {default!r}{status}")
    lines.append("")
    lines.append("verl keys accepted (verl key -> posttrain key [what happens to it]):")
    for verl, ours in sorted(aliases.alias_table(SCHEMA).items()):
        lines.append(f"  {verl} -> {ours}  [{KEY_STATUS.get(ours, 'honoured')}]")
    lines.append(f"  actor_rollout_ref.rollout.engine_kwargs.vllm.* -> rollout.engine_kwargs.vllm.*  [{ENGINE}]")
    lines.append("  global_profiler.global_tool_config.* (the rest) -> profiler.global_tool_config.*  [named unused]")
    lines.append("")
    lines.append("Any other verl key is refused with a line naming it (`not supported yet`).")
    lines.append("")
    lines.append("NeMo-RL's layout (a --config file with grpo:, loss_fn:, policy:, ... and `defaults:`; its keys as "
                 "overrides, ++key=value, ~key):")
    for nemo, ours in nemo_rl.RENAMES.items():
        lines.append(f"  {nemo} -> {ours}")
    lines.append("  ... and the keys that need a conversion (train_global_batch_size counts samples, the scheduler, "
                 "keep_top_k, the loggers): docs/coming-from-nemo-rl.md")
    return "\n".join(lines)
