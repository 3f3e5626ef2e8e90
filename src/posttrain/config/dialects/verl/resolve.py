"""verl's keys that need the whole run, read over all of its layers before the merge: translate.py leaves the keys
posttrain's schema does not hold (keys.READ) in each layer, and resolve() takes them out of every layer and reads
them together, a later layer winning, as the merge would:

    layers, unused = resolve(layers)   # unused: ["data.return_raw_chat"], for validation's warning

The keys posttrain takes and does not use (keys.UNUSED) are dropped: the ones set to anything but their default
are returned, for the one warning line that names them (validate.py's warn_unused). A value of a type the merge
would refuse is refused in its words.
"""

from __future__ import annotations

from typing import Any

from omegaconf import BooleanNode, FloatNode, IntegerNode, OmegaConf, StringNode

from posttrain.config.flat import REFUSED, type_error
from posttrain.config.dialects.verl.keys import READ, UNUSED

_MAPPINGS = tuple(key for key, (typ, _) in READ.items() if typ.startswith("Dict["))
_NODES = {"bool": BooleanNode, "int": IntegerNode, "float": FloatNode, "str": StringNode}


def reads(key: str) -> bool:
    """Whether `key` is one the dialect reads itself (keys.READ), or lies inside one that is a free-form mapping."""
    return key in READ or key.startswith(tuple(m + "." for m in _MAPPINGS))


def resolve(layers: list[dict]) -> tuple[list[dict], list[str]]:
    """The run's translated layers, lowest first (the presets under the run's own) -> (the layers without the keys
    of keys.READ, the unused keys set to anything but their default)."""
    theirs: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if reads(key):
                _read(theirs, key, value)
    unused = [key for key, (_, default) in UNUSED.items() if theirs.get(key, default) != default]
    return [{k: v for k, v in layer.items() if not reads(k)} for layer in layers], unused


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
