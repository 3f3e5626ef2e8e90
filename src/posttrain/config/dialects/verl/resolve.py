"""verl's keys that need the whole run, read over all of its layers before the merge: translate.py leaves the keys
posttrain's schema does not hold (keys.READ) in each layer, and resolve() takes them out of every layer and reads
them together, a later layer winning, as the merge would:

    layers, unused = resolve(layers, given)   # unused: ["data.return_raw_chat"], for validation's warning

The keys posttrain takes and does not use (keys.UNUSED) are dropped: the ones set to anything but their default
are returned, for the one warning line that names them (validate.py's warn_unused); so are the keys it takes at one
value only or names unused when set (keys.FIXED), checked first (fixed.py). verl's global micro-batch
sizes (global_sizes.py) and its fully asynchronous trainer's keys (fully_async.py; not for posttrain sft) become
posttrain's keys, in a layer of their own on top: they read posttrain's keys as the merge will make them (the
layers' flat view, a later one winning, over the schema's defaults). A value of a type the merge would refuse is
refused in its words: one of the dialect's keys here, one of posttrain's by the merge (the translation then left
out).
"""

from __future__ import annotations

from typing import Any

from omegaconf import BooleanNode, FloatNode, IntegerNode, OmegaConf, StringNode

from posttrain.config.flat import REFUSED, type_error
from posttrain.config.schema import SCHEMA
from posttrain.config.dialects.verl import fixed, fully_async, global_sizes
from posttrain.config.dialects.verl.keys import READ, UNUSED

_MAPPINGS = tuple(key for key, (typ, _) in READ.items() if typ.startswith("Dict["))
_NODES = {"bool": BooleanNode, "int": IntegerNode, "float": FloatNode, "str": StringNode}


class Unmergeable(ValueError):
    """A posttrain key's value the merge will refuse (its own error says so)."""


def reads(key: str) -> bool:
    """Whether `key` is one the dialect reads itself (keys.READ), or lies inside one that is a free-form mapping."""
    return key in READ or key.startswith(tuple(m + "." for m in _MAPPINGS))


def resolve(layers: list[dict], given: set[str], command: str = "train") -> tuple[list[dict], list[str]]:
    """The run's translated layers, lowest first (the presets under the run's own; `given`: the keys the run's own
    set) -> (the layers without the keys of keys.READ, and one of the posttrain keys made of them on top; the unused
    keys set to anything but their default)."""
    theirs: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if reads(key):
                _read(theirs, key, value)
    unused = [key for key, (_, default) in UNUSED.items() if theirs.get(key, default) != default]
    ours = [{k: v for k, v in layer.items() if not reads(k)} for layer in layers]
    value = _view(ours)
    try:
        unused += fixed.check(theirs, value, command)
        made = global_sizes.per_worker(theirs, value, given)
        if command != "sft":
            made.update(fully_async.translate(theirs, value, given))
    except Unmergeable:
        made = {}
    return [*ours, made], unused


def _view(layers: list[dict]):
    """-> value(key): posttrain's `key` as the merge will make it (the layers' flat view, a later one winning, over
    the schema's defaults; typed), Unmergeable where the merge will refuse it."""
    flat = {key: v for layer in layers for key, v in layer.items()}

    def value(key: str):
        try:
            return typed(SCHEMA[key][0], flat.get(key, SCHEMA[key][1]))
        except ValueError:
            raise Unmergeable(key) from None
    return value


def _read(theirs: dict[str, Any], key: str, value) -> None:
    """One layer's `key=value` into `theirs`, typed as the merge would type it (a mapping's keys added to it)."""
    mapping = next((m for m in _MAPPINGS if key.startswith(m + ".")), None)
    try:
        if mapping is None:
            value = typed(READ[key][0], value)
        else:
            value, key = {key[len(mapping) + 1:]: typed("Dict[str, Any]", {"v": value})["v"]}, mapping
    except ValueError:
        raise type_error(key, READ[key][0] if mapping is None else None, value) from None
    theirs[key] = {**theirs.get(key, {}), **value} if key in _MAPPINGS else value


def typed(typ: str, value):
    """`value` as the merge reads it into a field of type `typ` (as SCHEMA spells types: int, Optional[float],
    Dict[str, Any]), converted as OmegaConf converts it ("2" -> 2, 1 -> True); ValueError where the merge refuses it."""
    optional = typ.startswith("Optional[")
    base = typ[len("Optional["):-1] if optional else typ
    if value is None:
        if optional:
            return None
        raise ValueError(f"{typ} is not optional")
    try:
        if base.startswith("Dict["):
            if not isinstance(value, dict):
                raise ValueError(f"{typ} takes a mapping")
            return OmegaConf.to_container(OmegaConf.create(value))
        return OmegaConf.merge({"v": _NODES[base]()}, {"v": value}).v
    except REFUSED as e:
        raise ValueError(str(e)) from None
