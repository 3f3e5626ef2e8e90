"""What a worker is built from: plain settings for the policy, the reference, the rollout engine and the
critic of one device (made from the config by `driver.settings.worker_spec`, read by `verbs.Worker.setup`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.models.lora import LoraSettings
from posttrain.training.actor import UpdateSettings
from posttrain.training.critic import CriticSettings
from posttrain.training.sft import SFTSettings


@dataclass
class CriticSpec:
    """The critic's model and optimizer (algorithm.adv_estimator=gae)."""

    model_dir: str  # a causal LM (the value head starts from scratch) or a saved critic
    update: CriticSettings
    lr: float = 1e-5
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8  # AdamW's epsilon
    warmup_steps: int = 0
    warmup_start_factor: float | None = None  # critic.lr_warmup_start_factor (training.actor.warmup_lr_factor)
    lr_scheduler_type: str = "constant"  # critic.lr_scheduler_type, min_lr_ratio, num_cycles (training.actor.lr_factor)
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_steps: int = 0  # the run's RL steps: the cosine reaches min_lr_ratio at the last one
    gradient_checkpointing: bool = False
    param_offload: bool = False  # FSDP2's CPUOffloadPolicy (sharded workers)
    optimizer_offload: bool = False  # the optimizer's state on the CPU between updates


@dataclass
class RefSpec:
    """The reference model (a frozen copy of the starting policy; with LoRA, the policy with its adapters off)."""

    needed: bool = False  # its log-probs are needed: a KL loss, or KL in the reward
    param_offload: bool = False  # its sharded parameters in CPU memory (FSDP2, workers)
    log_prob_micro_batch_size: int = 64
    log_prob_max_tokens: int | None = None  # ref.log_prob_use_dynamic_bsz: a token budget per micro-batch
    torch_compile: bool = False  # ref.use_torch_compile: its log-prob function compiled
    forward_prefetch: bool = False  # FSDP2: each layer prefetches the next one's parameters (parallelize)
    # ref.cast_weights: its Linear weights stored in autocast's lower dtype (models/cast.py); None: where it applies
    cast_weights: bool | None = None


@dataclass
class TeacherSpec:
    """On-policy distillation's teacher: a frozen model of its own, placed and run as the reference is."""

    model_dir: str
    key: str | None = None  # several teachers: the rows it scores are those whose routing value is this
    param_offload: bool = False  # its sharded parameters in CPU memory (FSDP2, workers)
    log_prob_micro_batch_size: int = 64
    log_prob_max_tokens: int | None = None
    tensor_parallel: int | None = None  # its own TP size (distillation.tensor_parallel_size); None: the policy's


@dataclass
class RolloutSpec:
    """The rollout engine that samples from the policy: hf (rollout/hf.py) or vllm (rollout/vllm.py)."""

    name: str = "hf"
    micro_batch_size: int | None = None  # hf: sequences per generate pass
    shared_prefill: bool = True  # the hf engine's fast paths (rollout/hf.py)
    remove_padding: bool = True
    early_stop: bool = True
    stop_check_every: int | None = None  # None: 1 on the CPU, 8 on a GPU (stop_check_every_of)
    static_decoding: bool | None = None  # None: on with CUDA where the model allows (static_decoding_of)
    enforce_eager: bool | None = None  # vLLM's (in engine_kwargs too); hf: static decoding without CUDA graphs
    tensor_parallel_size: int = 1  # vLLM's engine from here on
    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = None
    engine_kwargs: dict = field(default_factory=dict)  # more vllm.LLM arguments (specs.vllm_engine_kwargs)
    free_cache_engine: bool = True  # vLLM sleeps between generations
    weights_from_policy: bool = False  # vLLM loaded no weights (load_format=dummy): push the policy's at start
    kv_cache_sequences: int = 256  # vLLM on the CPU: its KV cache holds this many sequences of max_model_len
    # the engine's weights in this dtype (rollout.dtype); None: the policy's compute dtype. On hf a dtype other
    # than that one gives the engine a copy of the policy in it (a low-precision rollout)
    dtype: str | None = None
    # the engine samples with the policy's weights of this many updates ago, k: the last k + 1 versions are kept
    # on the CPU (not checkpointed: after a resume the engine starts from the resumed weights)
    stale_updates: int = 0
    # async_training.enable: the engine runs in a process of its own (rollout/remote.py) with this many torch
    # threads (None: torch's default), and takes the weights of the version the driver names before each batch
    remote: bool = False
    threads: int | None = None
    # ... in `workers` processes of their own (rollout/pool.py: Ray actors beside a trainer group, worker 0 holding
    # them); a dead one is replaced up to `max_failures` times over the run
    workers: int = 1
    max_failures: int = 0
    placement_group: str | None = None  # beside a trainer group: the name of the rollout workers' placement group
    in_flight: bool = False  # async_training.in_flight_weight_updates: new weights reach it mid-batch
    # async_training.stream_samples: the workers take a batch's prompts this many at a time from one queue (0: one
    # chunk each); rollout/pool.py
    piece_size: int = 0


@dataclass
class WorkerSpec:
    """Plain settings for building a worker (made from the config by specs.worker_spec): the policy's
    model, optimizer and passes here; the reference, rollout engine and critic in their own parts."""

    model_dir: str
    update: UpdateSettings
    policy_dir: str | None = None  # a single-process checkpoint's actor/ when resuming
    tokenizer_dir: str | None = None  # model.tokenizer_path: the tokenizer's own directory (None: model_dir's)
    dtype: str = "float32"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    small_attention: bool = True  # models/attention.py
    reuse_cpu_memory: bool = True  # runtime/malloc.py: on the CPU, freed memory kept for reuse
    param_offload: bool = False  # the policy's sharded parameters and gradients in CPU memory (FSDP2, workers)
    optimizer_offload: bool = False  # the policy optimizer's state on the CPU between updates
    device: str = "cpu"  # cpu | cuda
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8  # AdamW's epsilon
    warmup_steps: int = 0
    warmup_start_factor: float | None = None  # actor.lr_warmup_start_factor (training.actor.warmup_lr_factor)
    lr_scheduler_type: str = "constant"  # actor.lr_scheduler_type, min_lr_ratio, num_cycles (training.actor.lr_factor)
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_steps: int = 0  # the run's RL steps: the cosine reaches min_lr_ratio at the last one
    log_prob_micro_batch_size: int = 64  # the policy's log-prob pass (rollout.log_prob_micro_batch_size)
    log_prob_max_tokens: int | None = None  # rollout.log_prob_use_dynamic_bsz: a token budget per micro-batch
    # model.log_prob_budget_from_memory: the policy's and the reference's log-prob passes without a budget take
    # one from the device's free memory (passes.memory_budget); None: on when the model is on CUDA
    log_prob_budget_from_memory: bool | None = None
    forward_prefetch: bool = False  # FSDP2: each layer prefetches the next one's parameters (parallelize)
    freeze_vision_tower: bool = False  # a vision-language model's image encoder does not train
    sequence_parallel: int = 1  # Ulysses: workers per group that split each sequence's positions
    tensor_parallel: int = 1  # workers per group that split each layer's matmuls (training/tensor_parallel.py)
    tensor_sequence_parallel: bool = False  # with tensor_parallel: the activations between them split by position
    tensor_parallel_plan: str | None = None  # a plan of the user's in place of posttrain's (actor.tensor_parallel_plan)
    lora: LoraSettings | None = None  # adapters train, the base is frozen (and is the reference)
    temperature: float = 1.0  # the rollout's: log-probs are taken at the temperature that sampled
    # compute dtype over float32 weights and optimizer, e.g. "bfloat16" on GPUs: the dtype of FSDP2's
    # gathered parameters with several workers, and torch.autocast's in every pass (`Worker.autocast`)
    mixed_precision: str | None = None
    reduce_dtype: str = "float32"  # FSDP2's gradient reduction across workers (actor.mixed_precision.reduce_dtype)
    seed: int = 0
    collective_timeout_s: float = 600.0
    threads: int | None = None  # torch threads in a worker process
    env: dict = field(default_factory=dict)
    ref: RefSpec = field(default_factory=RefSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    critic: CriticSpec | None = None  # PPO with GAE: a value model beside the policy
    sft: SFTSettings | None = None  # posttrain sft: the supervised update's micro-batches and clipping
    teachers: tuple[TeacherSpec, ...] = ()  # on-policy distillation (distillation.enabled): one, or one per key
