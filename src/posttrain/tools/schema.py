"""Tool schemas (OpenAI's function format) and the check of a call's arguments against one.

    schema_of(fn)          # {"name": "add", "description": "Add two numbers.", "parameters": {...}}
    check_arguments({"a": 1}, schema["parameters"])   # (None, "missing required argument 'b' (integer)")

A function's schema: its name, the first line of its docstring, and one
property per parameter, typed from its annotation (int -> integer, float ->
number, str -> string, bool -> boolean, list / list[X] -> array, dict ->
object, Literal[...] -> enum, X | None -> [X, null]; anything else, or no
annotation: any JSON value), required when it has no default.

Arguments are checked before a tool runs: every required property present,
each value of its property's type (and in its enum, if any), and no argument
the schema does not name (unless it sets additionalProperties). An integral
number (3.0) passes for an integer, and is given to the tool as 3.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing

from posttrain.errors import ConfigError
from posttrain.text.lines import cut

NAME_RULE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object",
               tuple: "array", type(None): "null"}


def schema_of(fn) -> dict:
    """{"name", "description", "parameters"} of a function, from its signature (ConfigError if it cannot be)."""
    where = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"tool function {where} has no signature to make a schema from ({e}); "
                          "give it one in a tool config's tool_schema") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001  an annotation that does not resolve: that parameter takes any value
        hints = {}
    properties, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.POSITIONAL_ONLY:
            raise ConfigError(f"tool function {where} has a positional-only parameter '{p.name}'; tools are called "
                              "with keyword arguments: remove the '/'")
        properties[p.name] = json_schema_of(hints.get(p.name, p.annotation))
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return {"name": fn.__name__, "description": doc.strip().splitlines()[0] if doc.strip() else "",
            "parameters": {"type": "object", "properties": properties, "required": required}}


def json_schema_of(annotation) -> dict:
    """The JSON schema of values of a Python type annotation ({} when it says nothing JSON can check)."""
    if annotation is inspect.Parameter.empty or annotation is typing.Any:
        return {}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        types_ = {_JSON_TYPES.get(type(a)) for a in args}
        return {**({"type": types_.pop()} if len(types_) == 1 and None not in types_ else {}), "enum": list(args)}
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            schema = json_schema_of(inner[0])
            if "type" in schema and len(inner) < len(args):
                schema = {**schema, "type": [schema["type"], "null"]}
            return schema
        return {}
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple):
        schema = {"type": "array"}
        if origin in (list, set, frozenset) and len(args) == 1:
            item = json_schema_of(args[0])
            if item:
                schema["items"] = item
        return schema
    if origin is dict or annotation is dict:
        return {"type": "object"}
    json_type = _JSON_TYPES.get(annotation)
    return {"type": json_type} if json_type and json_type != "null" else {}


def check_arguments(arguments: dict, parameters: dict) -> tuple[dict | None, str | None]:
    """(the arguments to call the tool with, None), or (None, what is wrong with them in one line)."""
    parameters = parameters if isinstance(parameters, dict) else {}
    named = isinstance(parameters.get("properties"), dict)  # no properties at all: any arguments
    properties = parameters["properties"] if named else {}
    required = parameters.get("required")
    for name in required if isinstance(required, list) else []:
        if name not in arguments:
            kind = _type_names(properties.get(name))
            return None, f"missing required argument '{name}'" + (f" ({kind})" if kind else "")
    extra = [k for k in arguments if k not in properties]
    if extra and named and parameters.get("additionalProperties") in (None, False):
        known = ", ".join(properties) or "none"
        return None, f"unexpected argument '{extra[0]}' (the arguments are: {known})"
    out = {}
    for name, value in arguments.items():
        schema = properties.get(name)
        if isinstance(schema, dict):
            value, problem = _check_value(value, schema)
            if problem:
                return None, f"argument '{name}' {problem}"
        out[name] = value
    return out, None


def _check_value(value, schema: dict):
    """(value, None) when it fits schema (an integral float made an int), else (value, what is wrong)."""
    wanted = schema.get("type")
    wanted = [wanted] if isinstance(wanted, str) else wanted if isinstance(wanted, list) else None
    if wanted:
        for t in wanted:
            ok, converted = _fits(value, t)
            if ok:
                value = converted
                break
        else:
            return value, f"must be {' or '.join(_article(t) for t in wanted)}, got {_describe(value)}"
    enum = schema.get("enum")
    if isinstance(enum, list) and value not in enum:
        return value, f"must be one of {', '.join(map(_json_cut, enum))}, got {_json_cut(value)}"
    return value, None


def _fits(value, json_type: str) -> tuple[bool, object]:
    if json_type == "integer":
        if isinstance(value, bool):
            return False, value
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, value
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    python = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}.get(json_type)
    return (isinstance(value, python) if python else True), value  # an unknown type name: not checked


def _type_names(schema) -> str:
    t = schema.get("type") if isinstance(schema, dict) else None
    return " or ".join(t) if isinstance(t, list) else t or ""


def _article(json_type: str) -> str:
    return {"integer": "an integer", "array": "an array", "object": "an object", "null": "null"}.get(
        json_type, f"a {json_type}")


def _describe(value) -> str:
    name = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)
    return f"{name} {_json_cut(value)}"


def _json_cut(value) -> str:
    """A value as a tool call would spell it (JSON; repr when it is not JSON), cut at 40 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return cut(text, 40)
