"""What a run holds between steps (`Run`, built by driver/build.py), and the small objects its stages take
(`run.rollouts` for sampling and scoring, `run.scoring`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.algorithms import AdaptiveKLController, FixedKLController, estimator
from posttrain.algorithms.rollout_corr import RolloutCorrection
from posttrain.data.dataset import PromptDataset, PromptSampler
from posttrain.driver.ahead import RolloutsAhead
from posttrain.driver.env_side import EnvSide
from posttrain.driver.nonfinite import NonfiniteGuard
from posttrain.driver.rollouts import StepRollouts
from posttrain.driver.scoring import Scoring
from posttrain.metrics.flops import ModelFlops
from posttrain.rewards.model import ModelRewards
from posttrain.rewards.pool import RewardPool
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multiturn import MultiTurnSettings
from posttrain.runtime.profiling import StepProfiler
from posttrain.tools import ToolSet
from posttrain.worker.verbs import Worker

if TYPE_CHECKING:  # field types only: heavy to import
    from transformers import PreTrainedTokenizerBase

    from posttrain.checkpoint import CheckpointWriter
    from posttrain.config import Config
    from posttrain.distributed.group import WorkerGroup


@dataclass
class Run:
    """What a run holds between steps (built by `posttrain.driver.build.build_run`)."""

    cfg: Config
    run_dir: Path
    actor: Worker | WorkerGroup  # a Worker in this process, or a distributed.WorkerGroup: the same verbs
    tokenizer: PreTrainedTokenizerBase
    kl_ctrl: AdaptiveKLController | FixedKLController | None  # None: no KL in the reward
    train_data: PromptDataset
    val_data: PromptDataset | None
    sampler: PromptSampler
    sampling: SamplingParams
    val_sampling: SamplingParams
    total_steps: int
    rewards: RewardPool | ModelRewards  # score_batch(...) -> ScoreResult, in worker processes; train() closes it
    writer: CheckpointWriter | None = None
    model_dir: str = ""
    resumed_from: Path | None = None
    global_step: int = 0
    stop_signal: int | None = None
    flops: ModelFlops | None = None  # the policy's FLOPs per token (None: its config lacks a field MFU needs)
    peak_flops: float | None = None  # per device (None: unknown, no MFU)
    peak_keys: list[str] = field(default_factory=list)  # measured CPU peaks a faster step raises
    guard: NonfiniteGuard | None = None  # None: one with cfg.trainer.max_nonfinite_steps
    profiler: StepProfiler | None = None  # profiler.* (build.make_profiler); None: none
    tools: ToolSet | None = None  # with rollout.multi_turn.enable; train() closes it
    multi_turn: MultiTurnSettings | None = None  # the multi-turn rollout's limits, with tools or an environment
    env: EnvSide | None = None  # rollout.multi_turn.environment / interaction_config_path; train() closes it
    correction: RolloutCorrection | None = None  # algorithm.rollout_correction (config.validate_rollout.rollout_correction)
    ahead: RolloutsAhead | None = None  # async_training.enable: batches sampled ahead by the rollout process
    reward_messages_shown: set[str] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)  # warnings printed once per run
    processor: object = None  # a vision-language model's processor (models/processor.py); None: a text model

    def __post_init__(self):
        if self.guard is None:
            self.guard = NonfiniteGuard(self.cfg.trainer.max_nonfinite_steps)
        if self.profiler is None:
            self.profiler = StepProfiler()

    @property
    def has_ref(self) -> bool:
        return self.cfg.actor.use_kl_loss or self.cfg.algorithm.use_kl_in_reward

    @property
    def on_policy_update(self) -> bool:
        """Whether the actor's update sees only the weights that sampled (one
        epoch, one mini-batch) and nothing needs old log-probs before it (no KL
        in the reward): its forward's own log-probs, detached, are the old ones
        (actor.reuse_on_policy_log_probs; see training.actor.micro_loss)."""
        a = self.cfg.actor
        return (a.reuse_on_policy_log_probs and a.ppo_epochs == 1 and not self.cfg.algorithm.use_kl_in_reward
                and a.ppo_mini_batch_size >= self.cfg.data.train_batch_size and not self.sampling.logprobs)

    @property
    def bypass(self) -> bool:
        """algorithm.rollout_correction.bypass_mode: the engine's log-probs are the old ones (no old pass)."""
        return self.cfg.algorithm.rollout_correction.bypass_mode

    @property
    def has_critic(self) -> bool:
        return estimator(self.cfg.algorithm.adv_estimator).needs_critic

    def draw(self) -> tuple[int, list]:
        """The next batch of prompts: (its epoch, its PromptItems)."""
        epoch, indices = self.sampler.next_batch()
        return epoch, [self.train_data[i] for i in indices]

    @property
    def scoring(self) -> Scoring:
        """What scoring takes (scoring.py); the reward messages shown are the run's."""
        return Scoring(self.rewards, self.cfg.reward, self.cfg.data.max_response_length, self.env,
                       self.reward_messages_shown)

    @property
    def rollouts(self) -> StepRollouts:
        """What the step's sampling and scoring take (rollouts.py): this run's engine, settings and records."""
        r = self.cfg.rollout
        return StepRollouts(
            actor=self.actor, tokenizer=self.tokenizer, sampling=self.sampling, scoring=self.scoring,
            draw=lambda: self.draw()[1], filter_groups=self.cfg.algorithm.filter_groups, tools=self.tools,
            multi_turn=self.multi_turn, env=self.env, flops=self.flops,
            # a prompt's samples share its prefill
            shared_prefill=self.sampling.n if r.shared_prefill or r.name == "vllm" else 1,
            greedy_baseline=estimator(self.cfg.algorithm.adv_estimator).greedy_baseline, warned=self.warned,
            processor=self.processor)
