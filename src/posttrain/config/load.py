"""From a YAML file and `key=value` overrides to a validated Config.

    cfg = load_config("run.yaml", ["actor.lr=1e-5", "actor_rollout_ref.rollout.n=4"])

Layers, later winning: the dataclass defaults < the embedded preset (only
without model.path) < algorithm.name's preset < the YAML file (posttrain's or
verl's keys, or NeMo-RL's layout: nemo_rl.py) < the overrides. OmegaConf
merges them onto the dataclasses and checks the types; validate.py the rest.
An unknown key is an error naming the nearest valid one.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config import nemo_rl, presets, verl_async, verl_sft
from posttrain.config import verl as aliases
from posttrain.config.checks import printable, repr_cut
from posttrain.config.schema import DICT_KEYS, LIST_KEYS, SCHEMA, Config
from posttrain.config.validate import validate
from posttrain.config.validate_sft import validate_sft
from posttrain.errors import ConfigError
from posttrain.text.lines import invalid_text
from posttrain.files.yamlfile import YAML_ERRORS, read_mapping


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'actor': {'lr': 1}} -> {'actor.lr': 1}."""
    if prefix.count(".") > 8:  # deeper than any key: a YAML anchor that holds itself (&a {x: *a}) never ends
        raise ConfigError(f"config key {repr_cut(prefix, 60)} nests deeper than any posttrain key; fix the YAML "
                          "(an anchor that refers to itself?)")
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in SCHEMA:
            out.update(flatten(v, key + "."))
        elif (v is None or v == {}) and _is_section(key):
            continue  # `actor:` left empty in a YAML file: a section with nothing set, not an unknown key
        else:
            out[key] = v
    return out


def _is_section(key: str) -> bool:
    """Whether `key` names a group of keys (actor, actor_rollout_ref.rollout), not one key."""
    prefixes = [*SCHEMA, *aliases.EXACT, *(verl for verl, _ in aliases.PREFIXES)]
    return key not in SCHEMA and any(k.startswith(key + ".") for k in prefixes)


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


def nearest(key: str) -> str:
    candidates = list(SCHEMA) + list(aliases.alias_table(SCHEMA))
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def canonicalize(flat: dict[str, Any], origin: str) -> dict[str, Any]:
    """Map verl keys to ours, refuse unknown keys, normalise scalars to lists."""
    out: dict[str, Any] = {}
    reward_path = flat.pop(aliases.CUSTOM_REWARD_PATH, None)
    reward_name = flat.pop(aliases.CUSTOM_REWARD_NAME, None)
    if reward_path:
        out["reward.custom_fn"] = f"{reward_path}:{reward_name or 'compute_score'}"
    separate = flat.pop(aliases.HYBRID_ENGINE, True)
    if separate not in (True, False):
        raise ConfigError(f"{aliases.HYBRID_ENGINE}={printable(separate)}: true or false")
    for key, value in flat.items():
        ours = aliases.to_canonical(key, SCHEMA) or _below_dict_key(key)
        if ours is None:
            if key.startswith(aliases.VERL_PREFIXES):
                raise ConfigError(
                    f"verl key {key!r} ({origin}) is not supported yet by posttrain{nearest(key)} "
                    "(`posttrain train --help-config` lists the supported keys)")
            raise ConfigError(f"unknown config key {key!r} ({origin}){nearest(key)}")  # repr: one line
        if ours in LIST_KEYS and isinstance(value, (str, int, float)):
            value = [value]
        if ours in LIST_KEYS and value is not None and (
                not isinstance(value, list) or any(isinstance(v, (list, dict)) for v in value)):
            # OmegaConf checks a list's element types but lets a nested list or dict through
            raise ConfigError(f"config key '{ours}' ({origin}) expects a list of plain values, got "
                              f"{repr_cut(value)}; write it as [a, b]")
        if value is None and key.endswith(".warmup_style"):
            continue  # verl's deprecated spelling, left null beside lr_scheduler_type (its own optim/fsdp.yaml)
        if ours in ("data.train_max_samples", "data.val_max_samples") and value == -1:
            value = None  # verl's "all rows"
        if invalid_text(value):  # a lone surrogate (argv in another encoding): the saved config.yaml could not hold it
            raise ConfigError(f"config key '{ours}' ({origin}) holds text that is not valid unicode; re-type the value")
        out[ours] = value
    if separate is False:  # verl's one-step off-policy: posttrain's asynchronous training, k = 1 unless set
        for key, value in aliases.SEPARATE_ROLLOUT.items():
            out.setdefault(key, value)
    return out


def _below_dict_key(key: str) -> str | None:
    """Our spelling of a key inside a free-form mapping (rollout.engine_kwargs.vllm.X), verl's prefixes mapped."""
    spellings = [key] + [ours + key[len(verl):] for verl, ours in aliases.PREFIXES if key.startswith(verl)]
    return next((k for k in spellings if any(k.startswith(d + ".") for d in DICT_KEYS)), None)


def _read_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing YAML file or only key=value overrides")
    return read_mapping(p, "config file")


def preset(name: str = "tiny_arith.yaml") -> dict[str, Any]:
    """A preset shipped in posttrain/configs: the embedded default (tiny_arith.yaml), posttrain sft's defaults
    (sft.yaml) and its embedded default (tiny_sft.yaml)."""
    text = resources.files("posttrain.configs").joinpath(name).read_text()
    return flatten(yaml.safe_load(text))


def load_config(config_path: str | None = None, overrides: Sequence[str] = (), command: str = "train") -> Config:
    """Defaults < embedded preset (only without model.path) < algorithm.name's
    preset < YAML file < overrides. command="sft" (`posttrain sft`): verl's SFT
    spellings are read too (verl_sft.py), a NeMo-RL file is its SFT layout
    (nemo_rl_sft.py), and the layers start from SFT's defaults
    (configs/sft.yaml) and its embedded preset (configs/tiny_sft.yaml)."""
    sft = command == "sft"
    layers, nemo_tree = [], None
    if config_path:
        data = _read_config_file(config_path)
        if nemo_rl.is_layout(data):  # NeMo-RL's grpo.*/policy.*/... layout, its `defaults:` files under it
            nemo_tree = nemo_rl.load_tree(config_path)
        else:
            layers.append(canonicalize(_sft_keys(flatten(data), f"in {config_path}", sft), f"in {config_path}"))
    nemo_overrides, overrides = nemo_rl.split_overrides(overrides, nemo_tree)
    cli = _sft_keys(dict(parse_override(a) for a in overrides), "on the command line", sft)
    ours = canonicalize(cli, "on the command line")
    if nemo_tree is not None or nemo_overrides:
        origin = f"in {config_path}" if nemo_tree is not None else "on the command line"
        layers.append(canonicalize(nemo_rl.layer(nemo_tree, nemo_overrides, origin, given=ours, sft=sft), origin))
    layers.append(ours)
    given = {key for layer in layers for key in layer}  # the run's own keys, not a preset's
    if not sft:
        layers.insert(0, _algorithm_layer(layers))
    if not any("model.path" in layer for layer in layers):
        layers.insert(0, preset("tiny_sft.yaml" if sft else "tiny_arith.yaml"))
    if sft:
        layers.insert(0, preset("sft.yaml"))
    cfg = _merge(layers)
    if sft:
        validate_sft(cfg, given)
        return cfg
    verl_async.resolve(cfg, given)
    validate(cfg)
    return cfg


def _sft_keys(flat: dict[str, Any], origin: str, sft: bool) -> dict[str, Any]:
    return verl_sft.translate(flat, origin) if sft else flat


def _algorithm_layer(layers: list[dict]) -> dict:
    """The keys of the algorithm.name the last layer naming one picks ({} without one)."""
    name = next((layer["algorithm.name"] for layer in reversed(layers) if "algorithm.name" in layer), None)
    if name is not None and (not isinstance(name, str) or name not in presets.ALGORITHMS):
        shown = printable(name) if isinstance(name, str) else repr_cut(name)  # e.g. [a]: a list is no name
        raise ConfigError(f"algorithm.name={shown} is not one of: {', '.join(presets.ALGORITHMS)}")
    try:
        return presets.preset_layer(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _merge(layers: list[dict]) -> Config:
    """The layers (flat keys) merged in order onto the dataclasses' defaults, OmegaConf checking the types."""
    merged = OmegaConf.structured(Config)
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(unflatten(layer)))
        except _REFUSED:
            raise _type_error(merged, layer) from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # e.g. '${x}' in a value: OmegaConf's interpolation, resolved here
        raise ConfigError(f"config key '{getattr(e, 'full_key', '')}' cannot be resolved "
                          f"({repr_cut(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)}); "
                          "'${...}' in a value is an OmegaConf interpolation: fix it or escape it as '\\${...}'") from None


# how OmegaConf refuses a value: its own errors, and a few plain ones (an int too large for a float
# field: OverflowError; a dict onto a list: TypeError; a YAML alias that holds itself: RecursionError)
_REFUSED = (OmegaConfBaseException, TypeError, ValueError, OverflowError, RecursionError)


def _type_error(merged, layer: dict) -> ConfigError:
    """Find the key of `layer` that OmegaConf refused, and say what it expects."""
    for key, value in layer.items():
        try:
            OmegaConf.merge(merged, OmegaConf.create(unflatten({key: value})))
        except _REFUSED:
            if key not in SCHEMA:  # below a free-form mapping (rollout.engine_kwargs.vllm.X): e.g. a date
                return ConfigError(f"config key '{key}' expects a number, text, true/false or a list of them, got "
                                   f"{repr_cut(value)}; fix the value")
            kind = getattr(SCHEMA[key][0], "__name__", str(SCHEMA[key][0])).replace("typing.", "")
            return ConfigError(f"config key '{key}' expects {kind}, got {repr_cut(value)}; fix the value")
    return ConfigError(f"config values {repr_cut(layer, 200)} do not fit the config's types; fix them")


def config_to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def config_to_yaml(cfg: Config | dict) -> str:
    """A Config, or its config_to_dict (e.g. redacted), as YAML in the Config's key order."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
