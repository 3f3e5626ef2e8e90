"""posttrain's configuration: typed dataclasses, YAML files and `key=value`
overrides (posttrain's keys, verl's, NeMo-RL's layout), validated where loaded.

    cfg = load_config("run.yaml", ["actor.lr=1e-5"])

Other frameworks' keys are translated before they get here, one pass per
dialect (posttrain.config.dialects: verl's keys, NeMo-RL's files and overrides).

docs/layout.md gives each module a line. Imports go from load.py to the dialects and validate*.py, to keys.py,
presets.py, checks.py and flat.py, to schema.py and its sections (schema_*.py).
"""

from posttrain.config.flat import flatten, parse_override
from posttrain.config.load import canonicalize, config_to_dict, config_to_yaml, load_config
from posttrain.config.schema import LOGGERS, SCHEMA, Config, uses_lora
from posttrain.config.schema_rollout import VLLM_SETTINGS

__all__ = ["LOGGERS", "SCHEMA", "VLLM_SETTINGS", "Config", "canonicalize", "config_to_dict", "config_to_yaml",
           "flatten", "load_config", "parse_override", "uses_lora"]
