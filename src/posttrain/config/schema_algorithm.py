"""The algorithm and reward sections' dataclasses (algorithm.*, reward.*): how advantages, the KL term, dynamic
sampling and the rollout correction are computed, and how samples are scored. schema.py's Config holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction.* (both its spellings): importance weights and rejection of the
    rollout engine's tokens by the ratio pi_old / pi_rollout (algorithms/rollout_corr.py; docs/rollout-correction.md).
    All off by default; any of it on makes the engine return its log-probs (rollout.calculate_log_probs)."""

    rollout_is: Optional[str] = None  # IS weights per token | sequence; null: none
    rollout_is_threshold: Optional[float] = 2.0  # the IS weights' upper truncation; null: not truncated
    rollout_is_threshold_lower: Optional[float] = None  # and lower (NeMo-RL's and OpenRLHF's tis floor); null: none
    rollout_is_batch_normalize: bool = False  # IS weights divided by their batch mean
    # rejection: token | sequence | geometric (a band on the ratio), or verl's newer comma list of
    # token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2, seq_max_k3; null: none
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Any] = None  # the band's upper bound; k1 options: "lower_upper"; k2/k3: a bound
    rollout_rs_threshold_lower: Optional[float] = None  # the band's lower bound; null: 1 / rollout_rs_threshold
    rollout_token_veto_threshold: Optional[float] = None  # a token ratio below it rejects its whole sequence
    # the rollout's log-probs stand in for the old ones (no old-log-prob pass); corrections use pi_theta / pi_rollout
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip | reinforce (IS-weighted policy gradient, no clip)
    use_policy_gradient: bool = False  # verl's earlier spelling of loss_type=reinforce


@dataclass
class GDPOConfig:
    """GDPO (algorithm.adv_estimator=gdpo): the reward's components, each normalized in its group, then summed."""

    # the numbers a reward function returns beside "score" ({"score": ..., "correctness": ..., "format": ...})
    # that are GDPO's components; []: every one it returns, in sorted order
    reward_keys: List[str] = field(default_factory=list)
    reward_weights: Optional[List[float]] = None  # one per component, in reward_keys' order; null: all 1
    leave_one_out: bool = False  # each component's baseline: the other samples of the group (NeMo-RL's LOO)


@dataclass
class AlgorithmConfig:
    name: Optional[str] = None  # a preset: one of ALGORITHMS (presets.py); your keys win
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
    gdpo: GDPOConfig = field(default_factory=GDPOConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


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
class RewardScalingConfig:
    """Scores clamped to [source_min, source_max], then mapped linearly onto [target_min, target_max], before any
    other shaping (NeMo-RL's grpo.reward_scaling); GDPO's components too."""

    enable: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


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
    timeout_s: float = 10.0  # per call; a worker still on it timeout_s + 0.5 s later is killed
    num_workers: Optional[int] = None  # reward processes; null: min(8, CPUs); 0: in the trainer (e.g. to debug)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    # every row scored by this data_source's built-in reward (e.g. math_multi_reward) instead of its own; null: its own
    data_source: Optional[str] = None
    # every row scored by a weighted sum of rewards.vlm's functions (NeMo-RL's env.<name>.reward_functions), name ->
    # weight or {weight, kwargs}: {format: 0.2, exact_alnum: 0.8}; the weights divided by their sum. {}: by data_source
    functions: Dict[str, Any] = field(default_factory=dict)
    # a truncated response's score (no EOS within data.max_response_length) times this: 0 earns nothing, 1 no
    # penalty; null: none (ProRL v2; NeMo-RL's grpo.reward_shaping.stop_properly_penalty_coef)
    truncated_scale: Optional[float] = None
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
