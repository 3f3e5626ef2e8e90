"""Flat dotted keys, the form every layer of a config takes on its way in: a YAML mapping flattened
({'actor': {'lr': 1}} -> {'actor.lr': 1}) and back, a `key=value` override parsed, and a key below a free-form
mapping told. The bottom of config: load.py and the dialects (posttrain.config.dialects) both read their input with it.

    flatten({"actor": {"lr": 1e-6}})   # {"actor.lr": 1e-06}
    parse_override("actor.lr=1e-5")    # ("actor.lr", 1e-05)
"""

from __future__ import annotations

from typing import Any, Sequence

import yaml
from omegaconf.errors import OmegaConfBaseException

from posttrain.config.schema import DICT_KEYS, SCHEMA
from posttrain.errors import ConfigError
from posttrain.files.yamlfile import YAML_ERRORS
from posttrain.text.lines import repr_cut


def flatten(d: dict, prefix: str = "", sections: Sequence[str] = ()) -> dict[str, Any]:
    """{'actor': {'lr': 1}} -> {'actor.lr': 1}. `sections`: a dialect's keys and key prefixes besides posttrain's
    (an empty `actor_rollout_ref:` is a section of verl's)."""
    if prefix.count(".") > 8:  # deeper than any key: a YAML anchor that holds itself (&a {x: *a}) never ends
        raise ConfigError(f"config key {repr_cut(prefix, 60)} nests deeper than any posttrain key; fix the YAML "
                          "(an anchor that refers to itself?)")
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in SCHEMA:
            out.update(flatten(v, key + ".", sections))
        elif (v is None or v == {}) and _is_section(key, sections):
            continue  # `actor:` left empty in a YAML file: a section with nothing set, not an unknown key
        else:
            out[key] = v
    return out


def _is_section(key: str, sections: Sequence[str]) -> bool:
    """Whether `key` names a group of keys (actor, actor_rollout_ref.rollout), not one key."""
    prefixes = [*SCHEMA, *sections]
    return key not in SCHEMA and any(k.startswith(key + ".") for k in prefixes)


def below_dict_key(key: str) -> bool:
    """Whether posttrain's `key` lies inside a free-form mapping (rollout.engine_kwargs.vllm.X)."""
    return any(key.startswith(d + ".") for d in DICT_KEYS)


def unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def parse_override(arg: str) -> tuple[str, Any]:
    """'a.b=1e-5' -> ('a.b', 1e-05); '+a=x' (Hydra's add syntax) is accepted."""
    if "=" not in arg:
        raise ConfigError(f"override {arg!r} is not key=value")  # repr: a newline in it stays on one line
    key, raw = arg.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except YAML_ERRORS:
        value = raw
    return key, value


# how OmegaConf refuses a value: its own errors, and a few plain ones (an int too large for a float
# field: OverflowError; a dict onto a list: TypeError; a YAML alias that holds itself: RecursionError)
REFUSED = (OmegaConfBaseException, TypeError, ValueError, OverflowError, RecursionError)


def type_error(key: str, typ: str | None, value) -> ConfigError:
    """The merge's refusal of `value` for `key`, a field of type `typ` (None: a key below a free-form mapping)."""
    kind = typ or "a number, text, true/false or a list of them"
    return ConfigError(f"config key '{key}' expects {kind}, got {repr_cut(value)}; fix the value")
