"""From a YAML file and `key=value` overrides to a validated Config.

    cfg = load_config("run.yaml", ["actor.lr=1e-5", "actor_rollout_ref.rollout.n=4"])

One pass down: read the file and the overrides (flat.py) -> pick the dialect (a file in NeMo-RL's layout, and
NeMo-RL's overrides: posttrain.config.dialects.nemo_rl; posttrain's and verl's keys: posttrain.config.dialects.verl) -> the
dialect translates each layer to posttrain's keys -> canonical checks (`canonical`: unknown keys, lists, text)
-> verl's keys that need the whole run read over all its layers (dialects/verl/resolve.py: its unused keys, its
global micro-batch sizes divided over the workers, its fully asynchronous trainer's keys) -> the layers merged onto
the dataclasses (OmegaConf checks the types) -> validated (validate.py). Layers, later winning: the dataclass
defaults < the embedded preset (only without model.path) < algorithm.name's preset < the YAML file < the
overrides. An unknown key is an error naming the nearest valid one.
"""

from __future__ import annotations

import difflib
import functools
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config import presets
from posttrain.config.flat import REFUSED, below_dict_key, flatten, parse_override, type_error, unflatten
from posttrain.config.schema import LIST_KEYS, SCHEMA, Config
from posttrain.config.validate import validate
from posttrain.config.validate_sft import validate_sft
# the dialects as modules, their functions looked up when called: a dialect imports config's lower modules
from posttrain.config.dialects import nemo_rl, verl
from posttrain.config.dialects.verl.keys import READ, VERL_PREFIXES, alias_table, spellings
from posttrain.errors import ConfigError
from posttrain.files.yamlfile import read_mapping
from posttrain.text.lines import invalid_text, printable, repr_cut


def nearest(key: str) -> str:
    candidates = [*SCHEMA, *READ, *alias_table(SCHEMA)]  # posttrain's keys, verl's dialect's, verl's spellings
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def canonicalize(flat: dict[str, Any], origin: str, command: str = "train") -> dict[str, Any]:
    """One layer of posttrain's and verl's keys as posttrain's (verl's dialect, one pass), checked: unknown keys
    refused, scalars normalised to lists."""
    return canonical(verl.translate(flat, origin, command), origin)


def canonical(flat: dict[str, Any], origin: str) -> dict[str, Any]:
    """posttrain's keys (a dialect's translation) checked: unknown keys refused, scalars normalised to lists."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in SCHEMA and not below_dict_key(key) and not verl.reads(key):
            if key.startswith(VERL_PREFIXES):
                raise ConfigError(
                    f"verl key {key!r} ({origin}) is not supported yet by posttrain{nearest(key)} "
                    "(`posttrain train --help-config` lists the supported keys)")
            raise ConfigError(f"unknown config key {key!r} ({origin}){nearest(key)}")  # repr: one line
        if key in LIST_KEYS and isinstance(value, (str, int, float)):
            value = [value]
        if key in LIST_KEYS and value is not None and (
                not isinstance(value, list) or any(isinstance(v, (list, dict)) for v in value)):
            # OmegaConf checks a list's element types but lets a nested list or dict through
            raise ConfigError(f"config key '{key}' ({origin}) expects a list of plain values, got "
                              f"{repr_cut(value)}; write it as [a, b]")
        if key in ("data.train_max_samples", "data.val_max_samples") and value == -1:
            value = None  # verl's "all rows"
        if invalid_text(value):  # a lone surrogate (argv in another encoding): the saved config.yaml could not hold it
            raise ConfigError(f"config key '{key}' ({origin}) holds text that is not valid unicode; re-type the value")
        out[key] = value
    return out


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
    spellings are read too (dialects/verl/sft.py), a NeMo-RL file is its SFT layout
    (dialects/nemo_rl/sft.py), and the layers start from SFT's defaults
    (configs/sft.yaml) and its embedded preset (configs/tiny_sft.yaml)."""
    layers, nemo_tree = [], None
    if config_path:
        data = _read_config_file(config_path)
        if nemo_rl.is_layout(data):  # NeMo-RL's grpo.*/policy.*/... layout, its `defaults:` files under it
            nemo_tree = nemo_rl.load_tree(config_path)
        else:
            origin = f"in {config_path}"
            layers.append(canonicalize(flatten(data, sections=spellings()), origin, command))
    nemo_overrides, overrides = nemo_rl.split_overrides(overrides, nemo_tree)
    cli = dict(parse_override(a) for a in overrides)
    ours = canonicalize(cli, "on the command line", command)
    if nemo_tree is not None or nemo_overrides:
        origin = f"in {config_path}" if nemo_tree is not None else "on the command line"
        layers.append(canonical(nemo_rl.translate(nemo_tree, nemo_overrides, origin, command, given=ours), origin))
    layers.append(ours)
    return from_layers(layers, command)


def from_layers(layers: list[dict], command: str = "train") -> Config:
    """The run's layers, translated and checked (canonicalize), lowest first -> its validated Config: under them
    the presets (algorithm.name's, the embedded run's without a model.path, sft's defaults), verl's keys that need
    the whole run resolved (its global sizes, its fully asynchronous keys), the whole merged onto the dataclasses,
    validated."""
    sft = command == "sft"
    layers = list(layers)
    given = {key for layer in layers for key in layer}  # the run's own keys, not a preset's
    if not sft:
        layers.insert(0, _algorithm_layer(layers))
    if not any("model.path" in layer for layer in layers):
        layers.insert(0, preset("tiny_sft.yaml" if sft else "tiny_arith.yaml"))
    if sft:
        layers.insert(0, preset("sft.yaml"))
    layers, unused = verl.resolve(layers, given, command)  # verl's keys that posttrain's schema does not hold
    cfg = _merge(layers)
    if sft:
        validate_sft(cfg, given, unused)
        return cfg
    validate(cfg, unused)
    return cfg


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


@functools.cache
def _defaults():
    """The dataclasses' defaults as OmegaConf's typed tree, made once (merges copy it, never change it)."""
    return OmegaConf.structured(Config)


def _merge(layers: list[dict]) -> Config:
    """The layers (flat keys) merged in order onto the dataclasses' defaults, OmegaConf checking the types."""
    try:
        merged = OmegaConf.merge(_defaults(), *(OmegaConf.create(unflatten(layer)) for layer in layers))
    except REFUSED:  # again a layer at a time, to name the key refused
        merged = _defaults()
        for layer in layers:
            try:
                merged = OmegaConf.merge(merged, OmegaConf.create(unflatten(layer)))
            except REFUSED:
                raise _type_error(merged, layer) from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # e.g. '${x}' in a value: OmegaConf's interpolation, resolved here
        raise ConfigError(f"config key '{getattr(e, 'full_key', '')}' cannot be resolved "
                          f"({repr_cut(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)}); "
                          "'${...}' in a value is an OmegaConf interpolation: fix it or escape it as '\\${...}'") from None


def _type_error(merged, layer: dict) -> ConfigError:
    """Find the key of `layer` that OmegaConf refused, and say what it expects."""
    for key, value in layer.items():
        try:
            OmegaConf.merge(merged, OmegaConf.create(unflatten({key: value})))
        except REFUSED:  # below a free-form mapping (rollout.engine_kwargs.vllm.X) when not in SCHEMA: e.g. a date
            return type_error(key, SCHEMA[key][0] if key in SCHEMA else None, value)
    return ConfigError(f"config values {repr_cut(layer, 200)} do not fit the config's types; fix them")


def config_to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def config_to_yaml(cfg: Config | dict) -> str:
    """A Config, or its config_to_dict (e.g. redacted), as YAML in the Config's key order."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
