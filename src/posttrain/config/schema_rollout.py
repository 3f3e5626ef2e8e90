"""The rollout section of posttrain's config (`rollout.*`): the engine, its sampling, the engine's own weights,
validation's sampling (val_kwargs) and multi-turn tools. Part of config.schema's Config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# rollout keys that configure vLLM's engine: other engines name them as unused (unused_engine_settings)
VLLM_SETTINGS = ("enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                 "enforce_eager", "load_format")


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
    max_user_turns: Optional[int] = None  # the environment's / simulated user's turns at most; null: no limit
    tool_config_path: Optional[str] = None  # verl's tool config YAML: tools: [{class_name, config, tool_schema}]
    tools: Optional[List[str]] = None  # Python functions as tools: [pkg.module:function, ...]
    # verl's simulated user: a YAML of interaction: [{name, class_name, config}] (envs.interactions)
    interaction_config_path: Optional[str] = None
    max_tool_response_length: int = 256  # tokens of one tool / environment message (longer: cut)
    # an environment class (pkg.module:Class or path/file.py:Class) with reset(row) and step(text): envs.base
    environment: Optional[str] = None
    environment_kwargs: Dict[str, Any] = field(default_factory=dict)  # its __init__'s keyword arguments
    environment_workers: int = 2  # worker processes running the conversations' environments
    environment_timeout_s: float = 30.0  # each reset / step call at most (longer: that conversation fails)
    environment_memory_mb: int = 4096  # each worker's address space (0: no limit)
    # an agent program (pkg.module:function or path/file.py:function), agent(row, client) -> reward or None, that
    # talks to the policy through an OpenAI-compatible endpoint (client: base_url, api_key, model): posttrain.agents
    agent: Optional[str] = None
    agent_workers: int = 64  # agent runs at once (threads; the engine samples their requests together)
    agent_timeout_s: float = 600.0  # one agent run at most (longer: that sample fails)
    # a conversation's score: env (the sum of the environment's turn rewards, or the agent's number), rule (the
    # reward function on the last answer), sum (both); null: env with an environment or an agent, rule with verl's
    # interactions (verl's way)
    reward_from: Optional[str] = None


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
    # hf: tokens decoded between two checks for ended sequences (early_stop, remove_padding: one host read each);
    # null: 1 on the CPU (fastest there), 8 on a GPU (not measured on one yet); the samples are the same for any
    stop_check_every: Optional[int] = None
    # hf: decode with a static-shape step (buffers allocated once, positions held on the device: rollout/static.py),
    # recorded as CUDA graphs on CUDA (rollout.enforce_eager=true: not recorded); the same samples as the eager
    # loop. null: on with CUDA where the model takes prebuilt SDPA masks (transformers' own classes), off on the CPU
    static_decoding: Optional[bool] = None
    log_prob_micro_batch_size: int = 64  # sequences per pass, per worker
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
    enforce_eager: Optional[bool] = None  # vLLM: no CUDA graphs; hf: static decoding's step not recorded as one
    load_format: Optional[str] = None  # verl's dummy_dtensor/dummy_hf: vLLM's dummy, the policy's weights pushed in
    # how a LoRA policy reaches the engine: adapter (the engine applies the adapters: hf samples from the policy
    # itself, vLLM gets a LoRA request) | merged (the engine holds the base with the adapters merged in: a second
    # copy on hf, full weights into vLLM); null: adapter on hf (no second copy), merged on vLLM
    lora_sync: Optional[str] = None
    free_cache_engine: bool = True  # vLLM sleeps between generations: KV cache freed, weights moved to the CPU
    # the engine returns each sampled token's log-prob, and every step logs how far it is from the trainer's
    # (training/rollout_probs_diff_*, rollout_corr/*: algorithms/rollout_corr.py); null: on with vLLM
    calculate_log_probs: Optional[bool] = None
    # the engine's weights in this dtype (bfloat16, float16, float32; verl's rollout.dtype): hf samples from a copy
    # of the policy in it, vLLM loads in it; null: the policy's compute dtype (no copy)
    dtype: Optional[str] = None
    # the engine samples with the policy's weights of this many updates ago (0: the current ones): a measured,
    # controlled off-policy gap for algorithm.rollout_correction (hf keeps a copy, both keep k CPU snapshots)
    stale_updates: int = 0
    mode: str = "sync"  # verl's sync | async (its server); posttrain's vLLM rollout is one LLM.generate per step
    # more vllm.LLM arguments by name (rollout.engine_kwargs.vllm.swap_space=4), checked against vLLM's EngineArgs
    engine_kwargs: Dict[str, Dict[str, Any]] = field(default_factory=lambda: {"vllm": {}})
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class AsyncTrainingConfig:
    """Asynchronous training (docs/async.md): the rollout engine samples in rollout workers of its own while the
    trainer (one process or a group of FSDP2 workers) updates, up to max_trajectory_age_steps updates ahead.
    NeMo-RL's grpo.async_grpo.* and policy.generation.colocated.* map here, and so do verl's one-step off-policy
    and fully asynchronous trainers' keys (dialects/verl/fully_async.py)."""

    enable: bool = False
    # k: a batch trains weights at most k updates newer than those that sampled it (0: the synchronous algorithm,
    # the engine still in its own process). NeMo-RL's name; verl's one-step off-policy is k = 1
    max_trajectory_age_steps: int = 1
    # NeMo-RL's: each new version reaches the rollout at its next token, the sequences in flight go on with it
    # (their KV cache as it was); fresher samples, not reproducible. false: between batches, deterministic
    in_flight_weight_updates: bool = False
    rollout_threads: Optional[int] = None  # the rollout process's torch threads on a CPU; null: half the cores
    # the rollout workers' own devices (verl's one-step off-policy rollout.nnodes / rollout.n_gpus_per_node, NeMo-RL's
    # policy.generation.colocated.resources): nnodes x n_gpus_per_node / rollout.tensor_model_parallel_size rollout
    # workers, each an engine over rollout.tensor_model_parallel_size of them
    rollout_nnodes: int = 1
    rollout_n_gpus_per_node: int = 1
    # how many times over a run a dead rollout worker is replaced (its unfinished prompts sampled again) before the
    # run stops; 0: the first failure stops it
    max_rollout_failures: int = 3
    # the rollout workers take each batch's prompts a piece at a time from one queue and hand each piece back as it
    # is done: a fast worker takes more, and the next batch's pieces start while this one's last finish (k >= 1).
    # Each piece is sampled from its own seed: the samples do not depend on the workers' number or speed
    stream_samples: bool = False
    stream_piece_size: int = 0  # prompts per piece (each with its n samples); 0: the batch's over 4 x rollout workers
