"""posttrain's configuration: typed dataclasses, YAML files and `key=value`
overrides (posttrain's keys, verl's, NeMo-RL's layout), validated where loaded."""

from posttrain.config.schema import (LOGGERS, SCHEMA, VLLM_SETTINGS, Config, canonicalize, config_to_dict,
                                     config_to_yaml, describe_keys, flatten, load_config, parse_override,
                                     save_config, uses_lora)

__all__ = ["LOGGERS", "SCHEMA", "VLLM_SETTINGS", "Config", "canonicalize", "config_to_dict", "config_to_yaml",
           "describe_keys", "flatten", "load_config", "parse_override", "save_config", "uses_lora"]
