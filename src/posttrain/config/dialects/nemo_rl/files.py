"""NeMo-RL's config files and overrides: its layout recognised, its files read (`defaults:` inheritance, as
NeMo-RL composes them), its Hydra-style overrides applied, and the resolved tree translated in one pass.

    tree = load_tree("grpo_math_8B.yaml")           # `defaults:` inheritance, as NeMo-RL composes files
    nemo, rest = split_overrides(["grpo.max_num_steps=20", "++policy.optimizer.kwargs.lr=1e-6", "actor.lr=1"], tree)
    keys = translate(tree, nemo, "in grpo_math_8B.yaml")   # {"trainer.total_training_steps": 20, ...}
    # that is: grpo.translate(resolve(apply_overrides(tree, [parse_override(a) for a in nemo])), origin)

Overrides are Hydra's: `key=value`, `+key=value` / `++key=value` (the path
created), `~key` (deleted); a value reads as NeMo-RL reads it (`1e-6` a float).
The resolved tree goes to its layout's translator: grpo.py (and ppo.py,
distillation.py below it) for `posttrain train`, sft.py for `posttrain sft`. describe() gives the lines of
`posttrain train --help-config` on NeMo-RL's keys.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Container, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config.schema import SCHEMA
from posttrain.config.dialects.nemo_rl import grpo
from posttrain.config.dialects.nemo_rl.keys import DATA_KEYS, RENAMES, SECTIONS
from posttrain.errors import ConfigError
from posttrain.files.yamlfile import YAML_ERRORS, first_line, read_mapping
from posttrain.text.lines import clipped

_ABSENT = object()
# posttrain's distillation.* keys (config/schema_distill.py): the section NeMo-RL's layout also names
OWN_DISTILLATION = ("enabled", "teacher_models", "teacher_key", "n_gpus_per_node", "nnodes", "param_offload",
                    "log_prob_micro_batch_size", "distillation_loss", "tensor_parallel_size")


# ---------------------------------------------------------------- reading the files

def is_layout(data: dict) -> bool:
    """Whether a YAML mapping is in NeMo-RL's layout (its sections, or `defaults:` naming files). A
    `distillation:` holding posttrain's (verl's) keys is posttrain's own section."""
    defaults = data.get("defaults")
    names_files = isinstance(defaults, str) or (isinstance(defaults, list) and all(isinstance(d, str) for d in defaults))
    sections = [s for s in SECTIONS if s in data and not (s == "distillation" and _ours(data[s]))]
    return bool(sections) or (names_files and bool(defaults))


def _ours(section) -> bool:
    """A distillation section in posttrain's (verl's) keys: enabled, teacher_models, distillation_loss, ..."""
    return isinstance(section, dict) and bool(section) and all(f"distillation.{k}" in SCHEMA or k in OWN_DISTILLATION
                                                                for k in section)


def describe() -> list[str]:
    """`posttrain train --help-config`'s lines on NeMo-RL's layout: its renamed keys, and where the rest are told."""
    return ["NeMo-RL's layout (a --config file with grpo:, loss_fn:, policy:, ... and `defaults:`; its keys as "
            "overrides, ++key=value, ~key):", *(f"  {nemo} -> {ours}" for nemo, ours in RENAMES.items()),
            "  env.<name>.reward_functions, env.<name>.num_workers (the VLM environment data.*.env_name names) -> "
            "reward.functions, reward.num_workers",
            "  grpo.async_grpo.max_generation_failures (async GRPO; else 0) -> async_training.max_rollout_failures",
            "  policy.generation.colocated.resources.num_nodes, gpus_per_node (colocated.enabled: false) -> "
            "async_training.rollout_nnodes, rollout_n_gpus_per_node; the rest of cluster.* -> trainer.*",
            "  ... and the keys that need a conversion (train_global_batch_size counts samples, the scheduler, "
            "keep_top_k, the loggers): docs/coming-from-nemo-rl.md"]


def is_key(key: str, tree: dict | None = None) -> bool:
    """Whether a `key=value` override is NeMo-RL's (its sections, its data keys, or a key of the file's tree);
    posttrain's own distillation.* keys (verl's spelling) are not."""
    key = key.lstrip("+~")
    parts = key.split(".")
    if parts[0] == "distillation" and len(parts) > 1 and parts[1] in OWN_DISTILLATION:
        return False
    if key.split(".", 1)[0] in SECTIONS or key.startswith(DATA_KEYS) or key in DATA_KEYS:
        return True
    return tree is not None and _lookup(tree, key) is not _ABSENT


def load_tree(path: str | Path, _seen: tuple = ()) -> dict:
    """A NeMo-RL YAML file with its `defaults:` files merged under it (depth first, later wins; a
    section marked `_override_: true` replaces the inherited one), interpolations left unresolved."""
    path = Path(path)
    if path.resolve() in _seen:
        raise ConfigError(f"config file '{path}' inherits from itself through `defaults:`; fix the chain "
                          f"{' -> '.join(p.name for p in (*_seen, path))}")
    if not path.is_file():
        where = f" (named by `defaults:` in {_seen[-1]})" if _seen else ""
        raise ConfigError(f"config file '{path}'{where} does not exist; pass an existing YAML file")
    data = read_mapping(path, "config file", loader=_Loader)
    defaults = data.pop("defaults", None) or []
    merged: dict = {}
    for parent in [defaults] if isinstance(defaults, str) else defaults:
        if not isinstance(parent, str):
            raise ConfigError(f"config file '{path}': `defaults:` must name YAML files, got {parent!r}")
        parent_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
        merged = _merge(merged, load_tree(parent_path, (*_seen, path.resolve())))
    return _merge(merged, data)


class _Loader(yaml.SafeLoader):
    """YAML as NeMo-RL (OmegaConf) reads it: `1e-8` is a number (plain YAML 1.1 needs `1.0e-8`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+$|^[-+]?(?:\d[\d_]*\.\d*|\.\d+)$"
               r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."))


def value_of(raw: str):
    """An override's text as NeMo-RL reads it (`1e-6` a number, `null` None, `[a, b]` a list)."""
    try:
        return yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except YAML_ERRORS:  # e.g. 2020-02-30: not a date, so the text itself
        return raw


def _merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and value.get("_override_"):
            out[key] = {k: v for k, v in value.items() if k != "_override_"}
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------- overrides on the command line

def split_overrides(overrides: Sequence[str], tree: dict | None) -> tuple[list[str], list[str]]:
    """The command line's `key=value`s -> (NeMo-RL's: its keys or a key of the file's `tree`, then Hydra's
    `~key` deletes; the rest: posttrain's and verl's), each in the order given."""
    nemo = [a for a in overrides if "=" in a and is_key(a.split("=", 1)[0], tree)]
    nemo += [a for a in overrides if a.startswith("~") and "=" not in a]
    return nemo, [a for a in overrides if a not in nemo]


def parse_override(arg: str) -> tuple[str, str, Any]:
    """A Hydra-style override: '++a.b=1' / '+a.b=1' / 'a.b=1' set, '~a.b' deletes. -> (op, key, value)."""
    if arg.startswith("~"):
        return "~", arg[1:].split("=", 1)[0], None
    key, raw = arg.split("=", 1)
    return ("+" if arg.startswith("+") else ""), key.strip().lstrip("+"), value_of(raw)


def translate(tree: dict | None, overrides: Sequence[str], origin: str, command: str = "train",
              given: Container[str] = ()) -> dict[str, Any]:
    """posttrain's keys for a NeMo-RL `tree` (None: only overrides) with NeMo-RL `overrides` applied. Data files
    among `given` (posttrain's keys set on the command line) replace the tree's dataset named instead.
    command="sft": NeMo-RL's SFT layout, for `posttrain sft` (sft.py)."""
    tree = apply_overrides(tree or {}, [parse_override(a) for a in overrides])
    if command == "sft":
        from posttrain.config.dialects.nemo_rl.sft import translate_sft

        return translate_sft(resolve(tree), origin + " (NeMo-RL's layout)", given)
    out = grpo.translate(resolve(tree), origin + " (NeMo-RL's layout)")
    for files, name in (("data.train_files", "data.dataset_name"), ("data.val_files", "data.val_dataset_name")):
        if files in given:
            out.pop(name, None)
    return out


def apply_overrides(tree: dict, overrides: list[tuple[str, str, Any]]) -> dict:
    """Hydra-style overrides (op, key, value): '' or '+'/'++' set (creating the path), '~' deletes."""
    cfg = OmegaConf.create(tree)
    for op, key, value in overrides:
        try:
            if op == "~":
                *parents, leaf = key.split(".")
                node = OmegaConf.select(cfg, ".".join(parents)) if parents else cfg
                if isinstance(node, DictConfig) and leaf in node:
                    node.pop(leaf)
            else:
                OmegaConf.update(cfg, key, value, merge=True, force_add=True)
        except (OmegaConfBaseException, ValueError, TypeError) as e:
            raise ConfigError(f"override {key}={clipped(value)} does not fit the NeMo-RL config ({first_line(e)}); "
                              "fix the key or value") from None
    return OmegaConf.to_container(cfg, resolve=False)


def resolve(tree: dict) -> dict:
    """Resolve NeMo-RL's interpolations (`${policy.model_name}`, `${mul:a,b}`, `${.temperature}`)."""
    _register_resolvers()
    try:
        return OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"NeMo-RL config key '{getattr(e, 'full_key', '')}' cannot be resolved ({first_line(e)}); "
                          "fix the interpolation") from None


def _register_resolvers() -> None:
    register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    for name, fn in {"mul": lambda a, b: a * b, "add": lambda a, b: a + b, "div": lambda a, b: a / b,
                     "max": lambda a, b: max(a, b)}.items():
        if not OmegaConf.has_resolver(name):
            register(name, fn)


def _lookup(tree: dict, key: str):
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node
