"""posttrain's configuration: typed dataclasses, YAML files and `key=value`
overrides (posttrain's keys, verl's, NeMo-RL's layout), validated where loaded.

    cfg = load_config("run.yaml", ["actor.lr=1e-5"])

Other frameworks' keys are translated before they get here, one pass per
dialect (posttrain.config.dialects: verl's keys, NeMo-RL's files and overrides).

One job per module, imports going down this list:
    schema_rollout.py  the rollout section's dataclasses (rollout.*)
    schema_distill.py  the distillation section's (distillation.*, verl's on-policy distillation)
    schema_sft.py      posttrain sft's data dataclasses (data.multiturn.*)
    schema_algorithm.py  the algorithm and reward sections' dataclasses (algorithm.*, reward.*)
    schema.py          the dataclasses: every key, its type and default (SCHEMA)
    checks.py          the one-line checks validation is written in (need, choice, in_range, fill, ...)
    flat.py            flat dotted keys: a mapping flattened and back, a key=value override parsed
    presets.py         algorithm.name=dapo|gspo|... -> the keys each sets
    keys.py            what happens to the keys posttrain does not simply honour (--help-config says it)
    validate_rollout.py  the rollout's settings and algorithm.rollout_correction checked
    validate_distill.py  distillation.* checked
    validate.py        ranges, choices and cross-field rules, section by section
    validate_sft.py    posttrain sft's checks
    load.py            file and overrides -> the dialect's translation -> canonical checks -> merged onto
                       the dataclasses -> validated: load_config
"""

from posttrain.config.flat import flatten, parse_override
from posttrain.config.load import canonicalize, config_to_dict, config_to_yaml, load_config
from posttrain.config.schema import LOGGERS, SCHEMA, Config, uses_lora
from posttrain.config.schema_rollout import VLLM_SETTINGS

__all__ = ["LOGGERS", "SCHEMA", "VLLM_SETTINGS", "Config", "canonicalize", "config_to_dict", "config_to_yaml",
           "flatten", "load_config", "parse_override", "uses_lora"]
