"""Tool calls in hermes format, as Qwen2.5/Qwen3 and verl's `hermes` parser write them.

    calls, malformed = parse_tool_calls('I will add. <tool_call>{"name": "calculator", '
                                        '"arguments": {"expression": "2+3"}}</tool_call>')
    calls        # [ToolCall(name='calculator', arguments={'expression': '2+3'})]
    malformed    # []

Every `<tool_call>...</tool_call>` in the text is one call, in order, its body
a JSON object {"name": str, "arguments": {...}}. "arguments" may also be a
JSON string holding an object (some models write it so), "parameters" is
read when "arguments" is absent, and neither means no arguments ({}). A call
that cannot be read is left out of `calls` and described by one line in
`malformed`: not JSON, not an object, no name, arguments that are not an
object, or a `<tool_call>` with no `</tool_call>` after it (the model stopped
mid-call). Text around the calls is ignored here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from posttrain.text.lines import cut

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
SHOWN_CHARS = 80  # of a malformed call's text, in its message


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """(the calls read from text, one line per call that could not be read)."""
    calls: list[ToolCall] = []
    malformed: list[str] = []
    end = 0
    for match in _CALL.finditer(text):
        call = _read_call(match.group(1))
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            malformed.append(call)
        end = match.end()
    if OPEN in text[end:]:
        rest = text[end:].split(OPEN, 1)[1]
        malformed.append(f"<tool_call> is not closed by </tool_call>: {_show(rest)}")
    return calls, malformed


def _read_call(body: str) -> ToolCall | str:
    """The ToolCall in one <tool_call> body, or a line saying what is wrong with it."""
    try:
        obj = json.loads(body)
    except ValueError as e:  # JSONDecodeError; also a number too long to convert
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e).splitlines()[0]
        return f"not valid JSON ({reason}): {_show(body)}"
    except RecursionError:
        return f"not valid JSON (nested too deeply): {_show(body)}"
    if not isinstance(obj, dict):
        return f"not a JSON object {{\"name\": ..., \"arguments\": {{...}}}} but {_json_type(obj)}: {_show(body)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"no \"name\" (a non-empty string) in {_show(body)}"
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return f"the arguments of '{name.strip()}' are a string that is not a JSON object: {_show(arguments)}"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f"the arguments of '{name.strip()}' are {_json_type(arguments)}, not a JSON object: {_show(body)}"
    return ToolCall(name.strip(), arguments)


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _show(text: str) -> str:
    """text on one line, at most SHOWN_CHARS characters."""
    flat = " ".join(text.split())
    return cut(flat, SHOWN_CHARS)
