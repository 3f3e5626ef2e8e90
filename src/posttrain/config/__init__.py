"""posttrain's configuration: typed dataclasses, YAML files and `key=value`
overrides (posttrain's keys, verl's, NeMo-RL's layout), validated where loaded.

    cfg = load_config("run.yaml", ["actor.lr=1e-5"])

One job per module, imports going down this list:
    schema_rollout.py  the rollout section's dataclasses (rollout.*)
    schema_distill.py  the distillation section's (distillation.*, verl's on-policy distillation)
    schema_sft.py      posttrain sft's data dataclasses (data.multiturn.*)
    schema.py          the dataclasses: every key, its type and default (SCHEMA)
    verl.py            verl's keys -> posttrain's
    presets.py         algorithm.name=dapo|gspo|... -> the keys each sets
    nemo_rl_keys.py    NeMo-RL's keys -> posttrain's (tables)
    nemo_rl_translate.py  a NeMo-RL tree -> posttrain's keys
    nemo_rl_ppo.py     NeMo-RL's PPO layout (ppo.*, value.*) -> posttrain's keys, the rest by nemo_rl_translate
    nemo_rl_sft.py     NeMo-RL's SFT layout (sft.*, policy.*) -> posttrain sft's keys
    nemo_rl.py         NeMo-RL's files (`defaults:`) and Hydra-style overrides
    keys.py            what `posttrain train --help-config` prints
    checks.py          the one-line checks validation is written in (need, choice, positive, ...)
    validate_rollout.py  the rollout's settings and algorithm.rollout_correction checked
    validate.py        ranges, choices and cross-field rules, section by section
    verl_sft.py        verl's SFT trainer keys -> posttrain sft's
    validate_sft.py    posttrain sft's checks
    load.py            YAML + overrides merged onto the dataclasses, then validated: load_config
"""

from posttrain.config.keys import describe_keys
from posttrain.config.load import canonicalize, config_to_dict, config_to_yaml, flatten, load_config, parse_override
from posttrain.config.schema import LOGGERS, SCHEMA, Config, uses_lora
from posttrain.config.schema_rollout import VLLM_SETTINGS

__all__ = ["LOGGERS", "SCHEMA", "VLLM_SETTINGS", "Config", "canonicalize", "config_to_dict", "config_to_yaml",
           "describe_keys", "flatten", "load_config", "parse_override", "uses_lora"]
