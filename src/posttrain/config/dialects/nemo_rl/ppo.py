"""NeMo-RL's PPO layout (examples/run_ppo.py, e.g. ppo_math_1B.yaml) -> posttrain's keys: ppo.* is grpo.*'s layout
(async_ppo for async_grpo) with GAE, PPO epochs and a critic warm-up; value.* is the value model, a policy section
of its own, translated as one and moved to critic.*; value_loss_fn is its loss's scale and clip range.

    translate_ppo(tree, "in ppo_math_1B.yaml", translate)   # translate: grpo.translate, for the rest
"""

from __future__ import annotations

from typing import Any, Callable

from posttrain.config.dialects.nemo_rl.keys import VALUE_KEYS
from posttrain.errors import ConfigError
from posttrain.text.lines import clipped


def translate_ppo(tree: dict, origin: str, translate: Callable[[dict, str], dict]) -> dict[str, Any]:
    """NeMo-RL's PPO layout (examples/run_ppo.py): ppo.* is grpo.*'s layout (async_ppo for async_grpo) with GAE,
    PPO epochs and a critic warm-up; value.* is the critic, a policy section of its own; value_loss_fn its loss."""
    ppo = dict(tree["ppo"] or {})
    epochs, warmup = ppo.pop("ppo_epochs", 1), ppo.pop("policy_training_start_step", 0)
    adv = dict(ppo.pop("adv_estimator", None) or {})
    if "async_ppo" in ppo:  # off, its other settings do nothing
        a = dict(ppo.pop("async_ppo") or {})
        failures = a.pop("max_generation_failures", None)  # not NeMo-RL's PPO's: its collector tolerates none
        if a.get("enabled") and failures not in (None, 0):
            raise ConfigError(f"ppo.async_ppo.max_generation_failures={clipped(failures)} ({origin}): NeMo-RL's "
                              "asynchronous PPO has no such key (its first failed rollout batch stops the run); set "
                              "it to 0 or drop it")
        ppo["async_grpo"] = a if a.get("enabled") else {"enabled": False}
    value, value_loss = tree.get("value") or {}, dict(tree.get("value_loss_fn") or {})
    rest = {k: v for k, v in tree.items() if k not in ("ppo", "value", "value_loss_fn")}
    try:
        out = translate({**rest, "grpo": ppo}, origin)
        critic = _value(value, ppo.get("num_generations_per_prompt"), out, origin, translate)
    except ConfigError as e:  # its keys as the file spells them
        raise ConfigError(str(e).replace("grpo.async_grpo", "ppo.async_ppo").replace("grpo.", "ppo.")) from None
    name = adv.pop("name", "gae")
    if name != "gae":
        raise ConfigError(f"ppo.adv_estimator.name={clipped(name)} ({origin}): NeMo-RL's PPO estimates with gae")
    out.update({"algorithm.adv_estimator": "gae", "algorithm.lam": adv.pop("gae_lambda", 1.0),
                "algorithm.gamma": adv.pop("gae_gamma", 1.0), "actor.ppo_epochs": epochs,
                "trainer.critic_warmup": warmup, **critic})
    for key, off in (("normalize_advantages", (True,)), ("gae_lambda_value", (None, out["algorithm.lam"])),
                     ("gae_lambda_policy", (None, out["algorithm.lam"])), ("length_adaptive_alpha", (0, 0.0, None))):
        value_of = adv.pop(key, off[0])
        if value_of not in off:  # VAPO's decoupled and length-adaptive lambdas; GAE's advantages are whitened
            raise ConfigError(f"ppo.adv_estimator.{key}={clipped(value_of)} ({origin}) is not supported by posttrain; "
                              f"set it to {' or '.join('null' if v is None else str(v).lower() for v in off)}")
    if adv:
        raise ConfigError(f"NeMo-RL key 'ppo.adv_estimator.{next(iter(adv))}' ({origin}) is not supported by posttrain")
    if value_loss.get("scale") is not None:
        out["critic.loss_coef"] = value_loss.pop("scale")
    if value_loss.get("cliprange") is not None:
        out["critic.cliprange_value"] = value_loss.pop("cliprange")
    if value_loss:
        raise ConfigError(f"NeMo-RL key 'value_loss_fn.{next(iter(value_loss))}' ({origin}) is not supported by "
                          "posttrain (value_loss_fn.scale and cliprange are)")
    return out


# the value model's parallel sizes that must be the policy's (its workers are the policy's; context parallelism:
# critic.ulysses_sequence_parallel_size's own check)
SPLITS = {"actor.tensor_parallel_size": "tensor_parallel_size"}


def _value(value: dict, n, policy_out: dict, origin: str, translate) -> dict[str, Any]:
    """value.* (NeMo-RL's value model) translated as a policy section, its keys moved to critic.*."""
    value = dict(value)
    head = value.pop("reward_model_cfg", None) or {}  # the value head: posttrain's critic has a scalar one
    try:
        got = translate({"policy": value, "grpo": {"num_generations_per_prompt": n}}, origin)
    except ConfigError as e:
        raise ConfigError(str(e).replace("policy.", "value.")) from None
    if head.get("enabled") is False:  # NeMo-RL's FSDP2 value worker needs it too
        raise ConfigError(f"value.reward_model_cfg.enabled=false ({origin}): the value model needs its scalar head; "
                          "set it to true")
    out = {}
    for key, v in got.items():
        if key in VALUE_KEYS:
            out[VALUE_KEYS[key]] = v
        elif key.startswith("model.lora"):
            raise ConfigError(f"value.dtensor_cfg.lora_cfg.enabled=true ({origin}): LoRA on the value model is not "
                              "supported; set it to false")
        elif key in SPLITS and v != policy_out.get(key, 1):  # the critic is split as the policy is
            raise ConfigError(f"value.dtensor_cfg.{SPLITS[key]}={v} ({origin}): posttrain splits the value model as "
                              f"the policy (policy.dtensor_cfg.{SPLITS[key]}={policy_out.get(key, 1)}); set them alike")
        elif key == "model.dtype" and v != policy_out.get("model.dtype", v):
            raise ConfigError(f"value.precision={v} ({origin}): posttrain trains the critic in the policy's "
                              f"precision ({policy_out['model.dtype']}); set them alike")
    if out.get("critic.model.path") == policy_out.get("model.path"):
        out.pop("critic.model.path")  # null: the actor's model (what ${policy.model_name} resolved to)
    return out
