"""Algorithms by name: `algorithm.name=dapo` sets the keys the paper's recipe
uses; any key you set yourself wins over the preset.

Each entry: the paper, and the config keys it sets (posttrain's names; the
verl spellings of the same keys are accepted too, see dialects/verl/keys.py).
A preset only sets what differs from the defaults that matter, so every
algorithm is also reachable with plain keys, as in verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    paper: str
    keys: dict = field(default_factory=dict)


ALGORITHMS: dict[str, Preset] = {
    "grpo": Preset(
        "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)",
        {"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": True}),
    "ppo": Preset(
        "Schulman et al. 2017 (arXiv:1707.06347); GAE: Schulman et al. 2015 (arXiv:1506.02438)",
        {"algorithm.adv_estimator": "gae"}),
    "rloo": Preset(
        "Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740)",
        {"algorithm.adv_estimator": "rloo"}),
    "reinforce_pp": Preset(
        "Hu 2025, REINFORCE++ (arXiv:2501.03262)",
        {"algorithm.adv_estimator": "reinforce_plus_plus"}),
    "reinforce_pp_baseline": Preset(
        "Hu 2025, REINFORCE++ with a group baseline (arXiv:2501.03262)",
        {"algorithm.adv_estimator": "reinforce_plus_plus_baseline"}),
    "drgrpo": Preset(
        "Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO, arXiv:2503.20783)",
        {"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False,
         "actor.loss_agg_mode": "seq-mean-token-sum-norm"}),
    "dapo": Preset(
        "Yu et al. 2025, DAPO (arXiv:2503.14476)",
        {"algorithm.adv_estimator": "grpo", "actor.clip_ratio_low": 0.2, "actor.clip_ratio_high": 0.28,
         "actor.loss_agg_mode": "token-mean", "algorithm.filter_groups.enable": True,
         "reward.overlong_buffer.enable": True, "actor.use_kl_loss": False, "algorithm.use_kl_in_reward": False}),
    "gspo": Preset(
        "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)",
        {"algorithm.adv_estimator": "grpo", "actor.policy_loss.loss_mode": "gspo",
         "actor.loss_agg_mode": "seq-mean-token-mean", "actor.clip_ratio_low": 3e-4, "actor.clip_ratio_high": 4e-4}),
    "remax": Preset(
        "Li et al. 2023, ReMax (arXiv:2310.10505)",
        {"algorithm.adv_estimator": "remax"}),
    "gpg": Preset(
        "Chu et al. 2025, GPG: Group Policy Gradient (arXiv:2504.02546)",
        {"algorithm.adv_estimator": "gpg", "actor.policy_loss.loss_mode": "gpg"}),
    "grpo_passk": Preset(
        "Tang et al. 2025, inference-time objectives: pass@k (arXiv:2503.19595)",
        {"algorithm.adv_estimator": "grpo_passk"}),
    "grpo_loo": Preset(
        "NeMo-RL's GRPO: a leave-one-out baseline and std (the baseline of RLOO, Ahmadian et al. 2024, "
        "arXiv:2402.14740)",
        {"algorithm.adv_estimator": "grpo_loo", "algorithm.norm_adv_by_std_in_grpo": True}),
    "gdpo": Preset(
        "GDPO: group reward-decoupled normalization (arXiv:2601.05242; NeMo-RL's gdpo estimator)",
        {"algorithm.adv_estimator": "gdpo", "algorithm.norm_adv_by_std_in_grpo": True}),
}


def preset_layer(name: str | None) -> dict:
    """The flat keys of preset `name` ({} for None); ValueError for an unknown name."""
    if name is None:
        return {}
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm.name={name} is not one of: {', '.join(ALGORITHMS)}")
    return dict(ALGORITHMS[name].keys)
