"""Tools for multi-turn rollouts: the model calls a tool, reads its answer, and goes on.

    from posttrain.tools import load_tools, parse_tool_calls

    tools = load_tools("tools.yaml")                       # verl's tool_config_path format (tools.loading)
    tools = load_tools(functions=["mytools:lookup", "calculator"], timeout_s=10.0, memory_mb=1024)
    tools.schemas      # OpenAI-style [{"type": "function", "function": {...}}], for the chat template's tools=
    tools.names        # ("lookup", "calculator")

    calls, malformed = parse_tool_calls(model_text)       # hermes <tool_call>{...}</tool_call> (tools.hermes)
    results = tools.run(calls, {"ground_truth": "18", "extra_info": {}, "data_source": "openai/gsm8k"})
    results[0].content, results[0].error                  # what the model reads; None or why it failed
    tools.close()                                         # stop the worker processes

The modules: hermes (parsing calls), toolset (ToolSet, ToolResult: running
calls, never raising for a tool's fault), schema (schemas from signatures,
argument checks), loading (load_tools: verl's config, function specs),
functions (importing a function spec), workers (user functions in killable
worker processes), and the built-in tools: calculator, python_tool (code in
a limited local process), answer (verl's GSM8K answer checker).
"""

from posttrain.tools.hermes import ToolCall, parse_tool_calls
from posttrain.tools.loading import load_tools
from posttrain.tools.toolset import Tool, ToolResult, ToolSet

__all__ = ["Tool", "ToolCall", "ToolResult", "ToolSet", "load_tools", "parse_tool_calls"]
