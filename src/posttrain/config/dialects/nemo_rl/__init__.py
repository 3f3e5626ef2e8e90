"""NeMo-RL's dialect: its config files (`defaults:` inheritance), its Hydra-style overrides (`++key=value`,
`~key`) and its layouts (GRPO, PPO, SFT, distillation), read as posttrain's keys.

    if is_layout(data):
        tree = load_tree(path)
    nemo, rest = split_overrides(overrides, tree)      # NeMo-RL's overrides, and posttrain's / verl's
    keys = translate(tree, nemo, "in run.yaml", command="train")   # the entry point: one pass

One job per module, imports going down this list:
    keys.py                NeMo-RL's keys -> posttrain's (tables only)
    rollout_correction.py  loss_fn's importance-sampling correction -> algorithm.rollout_correction.*
    policy.py              policy.*, checkpointing.*, logger.*: the sections every layout shares
    cluster.py             the cluster split with generation on GPUs of its own -> trainer.*, async_training.*
    ppo.py                 the PPO layout (ppo.*, value.*, value_loss_fn.*)
    distillation.py        the distillation layout (distillation.*, teacher.*, loss_fn.*)
    grpo.py                the GRPO layout (grpo.*, loss_fn.*, env.*, data.*), handing PPO and distillation on
    sft.py                 the SFT layout (sft.*), for `posttrain sft`
    files.py               the files, the overrides, and translate: the entry point (describe: its help lines)
"""

from posttrain.config.dialects.nemo_rl.files import describe, is_key, is_layout, load_tree, split_overrides, translate

__all__ = ["describe", "is_key", "is_layout", "load_tree", "split_overrides", "translate"]
