"""load_tools: a ToolSet from verl's tool config file and/or Python functions.

    tools = load_tools("tools.yaml")                                  # verl's tool_config_path format
    tools = load_tools(functions=["mytools:lookup", "calculator"])     # functions, and built-ins by name
    tools = load_tools("tools.yaml", ["mytools:lookup"], timeout_s=10.0, memory_mb=1024)

verl's tool config (rollout.multi_turn.tool_config_path):

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool
        config: {type: native}
        tool_schema:
          type: function
          function:
            name: calc_gsm8k_reward
            description: ...
            parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}

class_name picks what runs:

- verl.tools.gsm8k_tool.Gsm8kTool: the GSM8K answer checker (tools.answer);
- verl.tools.sandbox_fusion_tools.SandboxFusionTool: the `python` tool, run
  LOCALLY in a limited process (tools.python_tool), not on the SandboxFusion
  server its config names; config.default_timeout (seconds) and
  config.memory_limit_mb are its limits, and its language must be python;
- posttrain.tools.calculator, posttrain.tools.python, posttrain.tools.check_answer:
  the built-ins (schema optional: theirs is the default);
- pkg.module:function, pkg.module.function or path/file.py:function: that
  function, called in a worker process with the arguments as keyword
  arguments, its return value str()'d (schema optional: derived from its
  signature; config.default_timeout or config.timeout: its time limit).

The tool's name, description and parameters are tool_schema.function's
(the function's own name is ignored then). verl's other tools (search, MCP,
image zoom, geo3k) do not exist here: a ConfigError names the class and what
posttrain offers. `functions` entries are function specs, or a built-in's
name (calculator, python, check_answer); their schemas are derived. Every
mistake in the file or the specs is a one-line ConfigError naming the file
(or spec) and the fix. timeout_s is each process-run tool's time limit,
memory_mb the python tool's memory limit, unless its config sets them.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

from posttrain.errors import ConfigError
from posttrain.text.redact import redact_url
from posttrain.tools import answer, calculator, python_tool
from posttrain.tools.functions import FORMS, canonical_spec, import_function
from posttrain.tools.schema import NAME_RULE, schema_of
from posttrain.tools.toolset import Tool, ToolSet
from posttrain.tools.workers import FunctionWorkers, InProcessFunctions
from posttrain.files.yamlfile import read_yaml

GSM8K_TOOL = "verl.tools.gsm8k_tool.Gsm8kTool"
SANDBOX_TOOL = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
# built-in -> (its default schema, the argument it reads)
BUILTINS = {"calculator": (calculator.SCHEMA, "expression"), "python": (python_tool.SCHEMA, "code"),
            "check_answer": (answer.SCHEMA, "answer")}
CLASSES = {GSM8K_TOOL: "check_answer", SANDBOX_TOOL: "python", **{f"posttrain.tools.{name}": name for name in BUILTINS},
           "posttrain.tools.calc_gsm8k_reward": "check_answer"}
# verl's tools that posttrain does not have: what each is for
VERL_ONLY = {"search_tool": "web search through a retrieval service", "mcp_search_tool": "search through an MCP server",
             "mcp_base_tool": "a tool of an MCP server", "image_zoom_in_tool": "zooming into images",
             "geo3k_tool": "Geometry3K answer checking"}
OFFERS = (f"{GSM8K_TOOL} (GSM8K answer checker), {SANDBOX_TOOL} (runs Python locally), posttrain.tools.calculator, "
          f"posttrain.tools.python, posttrain.tools.check_answer, or your own function as class_name: {FORMS}")
CONFIG_FORMAT = ("tools: [{class_name: ..., config: {...}, tool_schema: {type: function, function: {name: ..., "
                 "description: ..., parameters: {type: object, properties: {...}, required: [...]}}}}]")


def load_tools(tool_config_path: str | None = None, functions: list[str] | None = None, timeout_s: float = 10.0,
               memory_mb: int = 1024, in_process: bool = False) -> ToolSet:
    """The tools of a verl tool config file and of function specs (see the module); ConfigError if any is wrong.
    in_process (trainer.debug): the functions are called in this process, without a time limit
    (workers.InProcessFunctions); the python tool keeps its own limited process."""
    entries = []  # (where, target, schema or None, config)
    if tool_config_path:
        entries += _read_config(Path(tool_config_path))
    if isinstance(functions, str):
        functions = [functions]
    for i, spec in enumerate(functions or []):
        target = spec.strip() if isinstance(spec, str) else spec
        if isinstance(target, str) and target in BUILTINS:
            target = f"posttrain.tools.{target}"
        entries.append((f"functions[{i}]", target, None, {}))
    if not entries:
        raise ConfigError("no tools to load: give a tool config file (verl's tool_config_path) or functions "
                          f"({FORMS})")

    specs: list[str] = []
    planned = []  # (where, name, description, parameters, kind, detail)
    for where, target, schema, config in entries:
        planned.append(_plan(where, target, schema, config, timeout_s, memory_mb, specs))
    seen: dict[str, str] = {}
    for where, name, *_ in planned:
        if name in seen:
            raise ConfigError(f"two tools are named '{name}' ({seen[name]} and {where}); rename one in its "
                              "tool_schema.function.name")
        seen[name] = where

    workers = (InProcessFunctions if in_process else FunctionWorkers)(specs) if specs else None
    tools = [Tool(name, description, parameters, _call(kind, name, detail, workers))
             for _, name, description, parameters, kind, detail in planned]
    return ToolSet(tools, closers=[workers.close] if workers else [])


def _plan(where, target, schema, config, timeout_s, memory_mb, specs):
    """One tool: (where, name, description, parameters, kind, detail), the function's spec added to specs."""
    if not isinstance(target, str) or not target.strip():
        raise ConfigError(f"{where}: class_name must name a tool ({OFFERS})")
    target = target.strip()
    timeout = _number(config, ("default_timeout", "timeout"), timeout_s, where)
    builtin = CLASSES.get(target)
    if builtin is None and target.startswith("verl."):
        module = target.split(".")[2] if target.count(".") >= 2 else ""
        what = f" ({VERL_ONLY[module]})" if module in VERL_ONLY else ""
        raise ConfigError(f"{where}: class_name '{target}'{what} is a verl tool posttrain does not have; posttrain "
                          f"offers {OFFERS}")
    if builtin is None and target.startswith("posttrain.tools.") and ":" not in target:
        raise ConfigError(f"{where}: class_name '{target}' is not a posttrain tool; the built-ins are: "
                          f"{', '.join('posttrain.tools.' + b for b in BUILTINS)}")
    if builtin is not None:
        default, argument = BUILTINS[builtin]
        name, description, parameters = _fields(schema or default, where)
        if argument not in (parameters.get("properties") or {}):
            raise ConfigError(f"{where}: the {builtin} tool reads the argument '{argument}', which its "
                              f"tool_schema.function.parameters.properties lacks; add it")
        detail = {"timeout_s": timeout}
        if builtin == "python":
            language = config.get("default_language", "python")
            if language != "python":
                raise ConfigError(f"{where}: default_language={language!r}: the python tool runs only Python; "
                                  "set default_language: python")
            detail["memory_mb"] = _number(config, ("memory_limit_mb",), memory_mb, where)
            url = config.get("sandbox_fusion_url")
            if url:
                warnings.warn(f"{where}: tool '{name}' runs code locally, in a limited process on this machine, not "
                              f"on the SandboxFusion server {redact_url(str(url))}", stacklevel=3)
        return where, name, description, parameters, builtin, detail
    fn = import_function(target, where=where)
    name, description, parameters = _fields(schema or schema_of(fn), where)
    spec = canonical_spec(target)
    if spec not in specs:
        specs.append(spec)
    return where, name, description, parameters, "function", {"spec": spec, "timeout_s": timeout}


def _call(kind: str, name: str, detail: dict, workers: FunctionWorkers | InProcessFunctions | None):
    if kind == "calculator":
        return lambda arguments, context: calculator.calculator(arguments["expression"])
    if kind == "python":
        return lambda arguments, context: python_tool.run_python(arguments["code"], detail["timeout_s"],
                                                                 detail["memory_mb"])
    if kind == "check_answer":
        return functools.partial(_check_answer, name)
    return functools.partial(_call_function, workers, detail["spec"], detail["timeout_s"], name)


def _check_answer(name: str, arguments: dict, context: dict) -> str:
    return answer.check_gsm8k_answer(arguments, context, tool_name=name)


def _call_function(workers: FunctionWorkers | InProcessFunctions, spec: str, timeout_s: float, name: str,
                   arguments: dict, context: dict) -> str:
    return workers.call(spec, arguments, timeout_s, name)


def _read_config(path: Path) -> list[tuple]:
    """The entries of verl's tool config file: (where, class_name, tool_schema or None, config)."""
    fix = f"write it as verl's tool config: {CONFIG_FORMAT}"
    if not path.is_file():
        raise ConfigError(f"tool config '{path}' does not exist; give the path of a YAML file ({CONFIG_FORMAT})")
    data = read_yaml(path, "tool config")
    if not isinstance(data, dict):
        raise ConfigError(f"tool config '{path}' holds {_kind(data)}, not a mapping; {fix}")
    tools = data.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ConfigError(f"tool config '{path}' has no `tools` list (keys: {', '.join(map(str, data)) or 'none'}); "
                          f"{fix}")
    entries = []
    for i, tool in enumerate(tools):
        where = f"tool config '{path}', tools[{i}]"
        if not isinstance(tool, dict):
            raise ConfigError(f"{where} is {_kind(tool)}, not a mapping; {fix}")
        config = tool.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: config is {_kind(config)}, not a mapping; write config: {{type: native}}")
        target = tool.get("class_name")
        schema = tool.get("tool_schema")
        verl_class = isinstance(target, str) and target.strip().startswith("verl.") and target.strip() in CLASSES
        if schema is None and verl_class:
            raise ConfigError(f"{where} ({target}) has no tool_schema; add tool_schema: {{type: function, function: "
                              "{name: ..., description: ..., parameters: {...}}}")
        if schema is not None:
            schema = _function_schema(schema, where)
        entries.append((where, target, schema, config))
    return entries


def _function_schema(tool_schema, where: str) -> dict:
    """tool_schema's function part, checked to have a name; ConfigError naming where and the fix."""
    fix = "write tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}"
    if not isinstance(tool_schema, dict):
        raise ConfigError(f"{where}: tool_schema is {_kind(tool_schema)}, not a mapping; {fix}")
    if tool_schema.get("type", "function") != "function":
        raise ConfigError(f"{where}: tool_schema.type is {tool_schema.get('type')!r}; only function tools exist; {fix}")
    function = tool_schema.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        raise ConfigError(f"{where}: tool_schema has no function.name; {fix}")
    return function


def _fields(function: dict, where: str) -> tuple[str, str, dict]:
    """(name, description, parameters) of a schema's function part, checked."""
    name = function["name"].strip()
    if not NAME_RULE.match(name):
        raise ConfigError(f"{where}: tool name {name!r} must be 1 to 64 letters, digits, '_' or '-'; rename it")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ConfigError(f"{where}: the description of tool '{name}' is {_kind(description)}, not text")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
        raise ConfigError(f"{where}: the parameters of tool '{name}' must be a JSON schema object {{type: object, "
                          "properties: {...}, required: [...]}")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ConfigError(f"{where}: the parameters' `required` of tool '{name}' must be a list of argument names")
    return name, description.strip(), parameters


def _number(config: dict, keys: tuple[str, ...], default, where: str):
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{where}: config.{key} must be a positive number, got {value!r}")
        return value
    return default


def _kind(value) -> str:
    return "nothing" if value is None else f"a {type(value).__name__}"
