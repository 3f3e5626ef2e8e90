"""A run's tools: their schemas for the chat template, and calls answered with what the model reads.

    tools = ToolSet([Tool(name="calculator", description="...", parameters={...}, call=fn)])
    tools.schemas      # [{"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}]
    tools.run([ToolCall("calculator", {"expression": "1/0"})], context)
    # [ToolResult(name="calculator", content="error: ZeroDivisionError: division by zero", error="error")]

A call never raises for the tool's or the model's fault: it becomes a
ToolResult whose `error` says which (None: it worked), its `content` the
tool's output, or one line saying what went wrong (the model reads it as the
tool's message, and may try again):

- "unknown_tool": no tool of that name ("error: unknown tool 'calc'; the tools are: calculator");
- "bad_arguments": missing, unexpected or mistyped arguments (schema.check_arguments);
- "error": the tool raised ("error: <ExceptionType>: <message>"), or its worker process died;
- "timeout": it ran past its time limit, and the process running it was killed.

Contents longer than MAX_CONTENT_CHARS are cut (and say so). Calls run one
after another, in order; run() may be called from several threads at once.
"""

from __future__ import annotations

import bdb
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from posttrain.text.lines import one_line
from posttrain.tools.hermes import ToolCall
from posttrain.tools.schema import check_arguments

MAX_CONTENT_CHARS = 8000
UNKNOWN_TOOL, BAD_ARGUMENTS, ERROR, TIMEOUT = "unknown_tool", "bad_arguments", "error", "timeout"


class ToolFailure(Exception):
    """A tool's call failed; `content` is what the model reads (its output so far and why)."""

    def __init__(self, content: str):
        super().__init__(content)
        self.content = content


class ToolTimeout(ToolFailure):
    """A tool's call ran past its time limit and was stopped."""


@dataclass
class ToolResult:
    name: str
    content: str
    error: str | None = None  # None, UNKNOWN_TOOL, BAD_ARGUMENTS, ERROR or TIMEOUT


@dataclass(frozen=True)
class Tool:
    """One tool: its schema, and call(arguments, context) -> the text the model reads.
    call raises ToolFailure / ToolTimeout (content given) or any exception (its type and message shown)."""

    name: str
    description: str
    parameters: dict
    call: Callable[[dict, dict], str] = field(repr=False)

    @property
    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": copy.deepcopy(self.parameters)}}


class ToolSet:
    """Tools by name; run(calls, context) -> one ToolResult per call; close() stops their worker processes."""

    def __init__(self, tools: list[Tool], closers: list[Callable[[], None]] = ()):
        self._tools = {t.name: t for t in tools}
        if len(self._tools) != len(tools):
            raise ValueError(f"two tools share a name: {', '.join(t.name for t in tools)}")
        self._closers = list(closers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    @property
    def schemas(self) -> list[dict]:
        """OpenAI-style tool schemas, for the chat template's tools= (copies: changing them changes no tool)."""
        return [t.schema for t in self._tools.values()]

    def __len__(self) -> int:
        return len(self._tools)

    def run(self, calls: list[ToolCall], context: dict | None = None) -> list[ToolResult]:
        """One ToolResult per call, in order. context: the sample's {"ground_truth", "extra_info", "data_source"}."""
        context = context or {}
        return [self.run_one(call, context) for call in calls]

    def run_one(self, call: ToolCall, context: dict) -> ToolResult:
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"error: unknown tool {_quoted(call.name)}; the tools are: "
                                         f"{', '.join(self._tools) or 'none'}", UNKNOWN_TOOL)
        arguments, problem = check_arguments(call.arguments if isinstance(call.arguments, dict) else {},
                                             tool.parameters)
        if problem:
            return ToolResult(tool.name, f"error: bad arguments for '{tool.name}': {problem}", BAD_ARGUMENTS)
        try:
            content = tool.call(arguments, context)
        except ToolTimeout as e:
            return ToolResult(tool.name, _bounded(e.content), TIMEOUT)
        except ToolFailure as e:
            return ToolResult(tool.name, _bounded(e.content), ERROR)
        except bdb.BdbQuit:  # `q` at a breakpoint in a tool (trainer.debug): the run ends, as any program would
            raise
        except Exception as e:  # noqa: BLE001  a tool's fault is the model's answer, not the run's end
            return ToolResult(tool.name, f"error: {one_line(e)}", ERROR)
        return ToolResult(tool.name, _bounded(content if isinstance(content, str) else str(content)))

    def close(self) -> None:
        """Stop the tools' worker processes (a later call starts new ones)."""
        for close in self._closers:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _quoted(name: str) -> str:
    return repr(name[:64] + ("..." if len(name) > 64 else ""))


def _bounded(text: str) -> str:
    if len(text) <= MAX_CONTENT_CHARS:
        return text
    return text[:MAX_CONTENT_CHARS] + f"\n[... cut: {len(text) - MAX_CONTENT_CHARS} more characters]"
