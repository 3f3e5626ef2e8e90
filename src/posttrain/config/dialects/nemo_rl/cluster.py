"""NeMo-RL's cluster split when generation has GPUs of its own (policy.generation.colocated.enabled: false), as
the `setup` of its GRPO and PPO (nemo_rl/algorithms/grpo.py, ppo.py) and of its distillation
(nemo_rl/algorithms/distillation.py) makes it, -> posttrain's trainer.* and async_training.rollout_*:

- the policy's nodes are cluster.num_nodes; GRPO and PPO, on several nodes, leave a reward-model environment's
  env.reward_model.resources.num_nodes out of them (distillation leaves nothing out);
- on one policy node, generation takes policy.generation.colocated.resources.gpus_per_node G of it (> 0;
  resources.num_nodes 1 or null) and training the rest: cluster.gpus_per_node - G (GRPO and PPO also less the
  reward model's gpus_per_node when the whole cluster is one node), at least 1;
- on several, generation takes resources.num_nodes N whole nodes (> 0; resources.gpus_per_node equal to
  cluster.gpus_per_node) and training the rest: the policy's nodes - N, at least 1.

    split(leaves, "in run.yaml", reward_share=True)
    # {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 8, "async_training.rollout_nnodes": 1,
    #  "async_training.rollout_n_gpus_per_node": 8}   (cluster 2 x 8, generation 1 x 8)

What NeMo-RL asserts against is refused in one line, naming the key.
"""

from __future__ import annotations

from posttrain.config.checks import whole
from posttrain.config.dialects.nemo_rl.policy import Leaves
from posttrain.errors import ConfigError
from posttrain.text.lines import clipped

GEN = "policy.generation.colocated.resources."
RM = "env.reward_model.resources."


def split(f: Leaves, origin: str, reward_share: bool) -> dict[str, int]:
    """The trainer's and the rollout's devices (module docstring); reward_share: GRPO's and PPO's rule (a
    reward-model environment's resources are its own), not distillation's."""
    gpus, nodes = f.get("cluster.gpus_per_node"), f.get("cluster.num_nodes")
    gen_gpus, gen_nodes = f.get(GEN + "gpus_per_node"), f.get(GEN + "num_nodes")
    for key, value, low in (("cluster.gpus_per_node", gpus, 1), ("cluster.num_nodes", nodes, 1),
                            (GEN + "gpus_per_node", gen_gpus, 0), (GEN + "num_nodes", gen_nodes, 0)):
        if not (whole(value, low) or (value is None and key.startswith(GEN))):
            raise ConfigError(f"{key}={_shown(value)} ({origin}): an integer >= {low}{' or null' * (low == 0)} "
                              "(policy.generation.colocated.enabled=false splits the cluster between training and "
                              "generation)")
    rm_nodes, rm_gpus = _reward_model(f, origin) if reward_share else (0, 0)
    policy_nodes = nodes if nodes == 1 else nodes - rm_nodes
    if policy_nodes < 1:
        raise ConfigError(f"{RM}num_nodes={rm_nodes} ({origin}) leaves none of the cluster.num_nodes={nodes} nodes "
                          "to the policy")
    if policy_nodes == 1:  # generation shares the policy's node
        if not gen_gpus:
            raise ConfigError(f"{GEN}gpus_per_node={_shown(gen_gpus)} ({origin}): the policy has one node, whose "
                              "GPUs generation and training share; set how many generation takes, > 0")
        if gen_nodes not in (None, 1):
            raise ConfigError(f"{GEN}num_nodes={gen_nodes} ({origin}): the policy has one node, which generation "
                              "shares with training; set it to 1 or null")
        rm_here = rm_gpus if nodes == 1 else 0
        train_gpus = gpus - gen_gpus - rm_here
        if train_gpus < 1:
            rm_said = f" and {RM}gpus_per_node={rm_here}" if rm_here else ""
            raise ConfigError(f"{GEN}gpus_per_node={gen_gpus}{rm_said} ({origin}) leave{'s' * (not rm_here)} no GPU "
                              f"of the node's cluster.gpus_per_node={gpus} for training")
        return _devices(1, train_gpus, 1, gen_gpus)
    if not gen_nodes:  # generation on whole nodes of its own
        raise ConfigError(f"{GEN}num_nodes={_shown(gen_nodes)} ({origin}): on several nodes generation takes whole "
                          "nodes of its own; set how many, > 0")
    if gen_gpus != gpus:
        raise ConfigError(f"{GEN}gpus_per_node={_shown(gen_gpus)} ({origin}): on several nodes generation takes whole "
                          f"nodes; set it to cluster.gpus_per_node={gpus}")
    if policy_nodes - gen_nodes < 1:
        raise ConfigError(f"{GEN}num_nodes={gen_nodes} ({origin}) leaves no node for training of the policy's "
                          f"{policy_nodes}; set it below {policy_nodes}")
    return _devices(policy_nodes - gen_nodes, gpus, gen_nodes, gpus)


def _reward_model(f: Leaves, origin: str) -> tuple[int, int]:
    """A reward-model environment's nodes and GPUs per node, where a data split names it (env_name)."""
    used = {f.flat.get(f"data.{split}.env_name") for split in ("default", "train", "validation")}
    if "reward_model" not in used:
        return 0, 0
    share = [f.flat.get(RM + "num_nodes"), f.flat.get(RM + "gpus_per_node")]
    for key, value in zip(("num_nodes", "gpus_per_node"), share):
        if not (value is None or whole(value)):
            raise ConfigError(f"{RM}{key}={clipped(value)} ({origin}): an integer >= 0 or null")
    return share[0] or 0, share[1] or 0


def _devices(train_nodes: int, train_gpus: int, gen_nodes: int, gen_gpus: int) -> dict[str, int]:
    return {"trainer.nnodes": train_nodes, "trainer.n_gpus_per_node": train_gpus,
            "async_training.rollout_nnodes": gen_nodes, "async_training.rollout_n_gpus_per_node": gen_gpus}


def _shown(value) -> str:
    return "null" if value is None else clipped(value)
