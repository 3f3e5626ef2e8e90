"""The tool layer of multi-turn rollouts (posttrain.tools): hermes parsing, the built-in
tools, verl's tool config, users' functions in killable worker processes."""

import os
import textwrap
import time

import pytest

from posttrain.errors import ConfigError
from posttrain.tools import ToolCall, ToolResult, ToolSet, load_tools, parse_tool_calls
from posttrain.tools.calculator import calculator
from posttrain.tools.schema import check_arguments, schema_of

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, in shape
GSM8K_CONFIG = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

USER_TOOLS = '''
import os
import time


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    More text that is not the description.
    """
    return a + b


def shout(text: str, times: int = 1, tags: list[str] | None = None):
    return {"said": (text.upper() + "!") * times, "tags": tags}


def hang(seconds: float, pid_file: str):
    """Write this process's id, then sleep."""
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return "woke up"


def fail(why: str):
    raise ValueError(f"cannot do {why}\\nsecond line")


def pid():
    return os.getpid()


def die():
    os._exit(3)
'''


def call(name, **arguments):
    return ToolCall(name, arguments)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `user_tools_mod` importable here and in spawned workers (they inherit sys.path)."""
    (tmp_path / "user_tools_mod.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_tools_mod"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- hermes parsing

def test_parse_one_call_with_text_around():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "2+3"})], [])


def test_parse_two_calls_in_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and then '
            '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call> done')
    calls, malformed = parse_tool_calls(text)
    assert calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]})]
    assert malformed == []


def test_parse_no_calls():
    assert parse_tool_calls("The answer is 18.") == ([], [])


def test_parse_arguments_as_json_string_and_missing_arguments():
    text = ('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"name": "now"}</tool_call>')
    calls, malformed = parse_tool_calls(text)
    assert calls == [ToolCall("calc", {"expression": "1+1"}), ToolCall("now", {})]
    assert malformed == []


def test_parse_malformed_calls_are_described_one_line_each():
    text = ('<tool_call>{"name": calc}</tool_call>'                         # bad JSON
            '<tool_call>{"arguments": {"x": 1}}</tool_call>'                # no name
            '<tool_call>{"name": "c", "arguments": [1, 2]}</tool_call>'      # arguments not an object
            '<tool_call>{"name": "c", "arguments": "not json"}</tool_call>'  # a string that is no object
            '<tool_call>["c"]</tool_call>'                                 # not an object at all
            '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
            'text <tool_call>{"name": "cut", "argu')                        # unclosed: generation stopped
    calls, malformed = parse_tool_calls(text)
    assert calls == [ToolCall("ok", {})]
    assert len(malformed) == 6
    assert all("\n" not in m for m in malformed)
    assert malformed[0].startswith("not valid JSON (") and '{"name": calc}' in malformed[0]
    assert malformed[1].startswith('no "name"')
    assert "arguments of 'c' are an array, not a JSON object" in malformed[2]
    assert "arguments of 'c' are a string that is not a JSON object" in malformed[3]
    assert "not a JSON object" in malformed[4] and "an array" in malformed[4]
    assert malformed[5].startswith("<tool_call> is not closed by </tool_call>")


# ---- the calculator

@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"), ("(3 + 4) * 2 / 7", "2"), ("6 / 3", "2"), ("7 / 2", "3.5"), ("7 // 2", "3"),
    ("-7 % 3", "2"), ("2 ** 10", "1024"), ("-2 ** 2", "-4"), ("+(-3)", "-3"), ("1 / 3", "0.333333333333"),
    ("2 ** 0.5", "1.41421356237"), ("0.1 + 0.2", "0.3"), ("12345678901234567890 * 10", "123456789012345678900"),
    ("2 ** -1", "0.5"), (" 1_000 + 1 ", "1001"),
])
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, words", [
    ("x + 1", "names ('x')"), ("abs(-1)", "function calls"), ("__import__('os')", "function calls"),
    ("(1).real", "attributes"), ("[1, 2][0]", "subscripts"), ("'a' * 3", "strings"), ("1 < 2", "comparisons"),
    ("2 ^ 3", "for a power write **"), ("1, 2", "tuples"), ("10 ** 100000", "too large"),
    ("(2 ** 3000) * (2 ** 3000)", "too large"), ("10.0 ** 400", "too large"), ("(-8) ** (1 / 3)", "not a real"),
    ("1 +", "not an arithmetic expression"), ("1" * 1001, "more than 1000"), ("", "empty"),
])
def test_calculator_refusals(expression, words):
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        calculator(expression)
    assert words in str(info.value)
    assert time.monotonic() - start < 1.0  # refused, not computed


@pytest.mark.parametrize("expression", ["1 / 0", "1 // 0", "5 % 0", "0 ** -1", "1 / (2 - 2)"])
def test_calculator_division_by_zero(expression):
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        calculator(expression)


def test_calculator_as_a_tool():
    tools = load_tools(functions=["calculator"])
    assert tools.names == ("calculator",)
    assert tools.schemas[0]["function"]["parameters"]["required"] == ["expression"]
    ok, zero, name = tools.run([call("calculator", expression="(1 + 2) * 4"), call("calculator", expression="1/0"),
                                call("calculator", expression="y * 2")])
    assert ok == ToolResult("calculator", "12", None)
    assert zero == ToolResult("calculator", "error: ZeroDivisionError: division by zero", "error")
    assert name.error == "error" and name.content.startswith("error: ValueError: names ('y') are not allowed")


# ---- verl's tool config: the GSM8K answer checker

def test_verl_gsm8k_config_uses_tools_kwargs_ground_truth(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(GSM8K_CONFIG)
    tools = load_tools(str(path))
    assert tools.names == ("calc_gsm8k_reward",)
    assert tools.schemas == [{"type": "function", "function": {
        "name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k.",
        "parameters": {"type": "object", "required": ["answer"], "properties": {"answer": {
            "type": "string", "description": "The model's answer to the GSM8K math problem, must be a digits"}}}}}]
    # verl's preprocessing puts the answer in tools_kwargs; the row's ground_truth is another value here
    context = {"ground_truth": "999", "data_source": "openai/gsm8k", "extra_info": {
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
    right, wrong, prefixed, nothing = tools.run(
        [call("calc_gsm8k_reward", answer="72"), call("calc_gsm8k_reward", answer="71"),
         call("calc_gsm8k_reward", answer="#### 72"), call("calc_gsm8k_reward", answer="seventy-two")], context)
    assert right.error is None and "72" in right.content and "correct (score 1.0)" in right.content
    assert wrong.error is None and "71" in wrong.content and "incorrect (score 0.0)" in wrong.content
    assert "correct (score 1.0)" in prefixed.content
    assert nothing.error is None and "score 0.0" in nothing.content
    # no tools_kwargs: the row's ground truth
    assert "correct (score 1.0)" in tools.run([call("calc_gsm8k_reward", answer="18")],
                                              {"ground_truth": "18", "extra_info": {}})[0].content
    missing = tools.run([call("calc_gsm8k_reward", answer="18")], {"extra_info": None})[0]
    assert missing.error == "error" and "no ground truth" in missing.content
    assert tools.run([call("calc_gsm8k_reward", answer=72)], context)[0].error == "bad_arguments"


def test_verl_sandbox_fusion_config_runs_python_locally_with_its_limits(tmp_path):
    path = tmp_path / "sandbox.yaml"
    path.write_text(textwrap.dedent("""
        tools:
          - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
            config: {sandbox_fusion_url: "https://user:secret@sandbox.example/run_code", default_timeout: 1,
                     memory_limit_mb: 300, default_language: python, type: native}
            tool_schema:
              type: function
              function:
                name: code_interpreter
                description: A tool for executing code.
                parameters: {type: object, properties: {code: {type: string}}, required: [code]}
    """))
    with pytest.warns(UserWarning, match="runs code locally") as warned:
        tools = load_tools(str(path), timeout_s=30, memory_mb=4096)
    assert "secret" not in str(warned[0].message)
    assert tools.names == ("code_interpreter",)
    printed, slow, big = tools.run([call("code_interpreter", code="print(6 * 7)"),
                                    call("code_interpreter", code="import time\ntime.sleep(30)"),
                                    call("code_interpreter", code="x = bytearray(600 * 2**20)")])
    assert printed == ToolResult("code_interpreter", "42\n", None)
    assert slow.error == "timeout" and "ran past 1 s" in slow.content
    assert big.error == "error" and "MemoryError" in big.content


@pytest.mark.parametrize("text, words", [
    ("- just a list", "holds a list, not a mapping"),
    ("tool: []", "has no `tools` list"),
    ("tools: [{class_name: verl.tools.gsm8k_tool.Gsm8kTool, tool_schema: {type: function, function: "
     "{description: x}}}]", "tool_schema has no function.name"),
    ("tools: [{class_name: verl.tools.gsm8k_tool.Gsm8kTool}]", "has no tool_schema"),
    ("tools: [{class_name: verl.tools.search_tool.SearchTool, tool_schema: {function: {name: search}}}]",
     "'verl.tools.search_tool.SearchTool' (web search through a retrieval service) is a verl tool posttrain does "
     "not have; posttrain offers verl.tools.gsm8k_tool.Gsm8kTool"),
    ("tools: [{class_name: verl.tools.mcp_search_tool.MCPSearchTool, config: {type: mcp}}]", "MCP server"),
    ("tools: [{class_name: verl.tools.image_zoom_in_tool.ImageZoomInTool}]", "zooming into images"),
    ("tools: [{class_name: posttrain.tools.abacus}]", "not a posttrain tool"),
    ("tools: [{class_name: no_such_module_xyz:fn}]", "no module named 'no_such_module_xyz'"),
    ("tools: [{class_name: posttrain.tools.calculator}, {class_name: posttrain.tools.calculator}]",
     "two tools are named 'calculator'"),
    ("tools: [{class_name: posttrain.tools.python, tool_schema: {function: {name: py, parameters: "
     "{type: object, properties: {source: {type: string}}}}}}]", "reads the argument 'code'"),
    ("tools: [{class_name: posttrain.tools.python, config: {default_timeout: -1}}]", "positive number"),
    ("tools: [{class_name: posttrain.tools.calculator, tool_schema: {function: {name: 'has space'}}}]",
     "must be 1 to 64 letters"),
    ("tools: [", "is not valid YAML"),
])
def test_malformed_tool_configs_are_one_line_config_errors(tmp_path, text, words):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_tools(str(path))
    message = str(info.value)
    assert words in message, message
    assert "\n" not in message
    assert "tools.yaml" in message or "tools[" in message


def test_missing_config_file_and_no_tools(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tools(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="no tools to load"):
        load_tools()


# ---- users' functions

def test_function_schema_from_its_signature(user_module):
    tools = load_tools(functions=[f"{user_module}:add", f"{user_module}.shout"])
    add, shout = (s["function"] for s in tools.schemas)
    assert add == {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}}
    assert shout["description"] == ""
    assert shout["parameters"]["properties"] == {"text": {"type": "string"}, "times": {"type": "integer"},
                                                 "tags": {"type": ["array", "null"], "items": {"type": "string"}}}
    assert shout["parameters"]["required"] == ["text"]
    with tools:
        added, default, said, mistyped, missing, unexpected, integral = tools.run([
            call("add", a=1, b=5), call("add", a=40), call("shout", text="hi", times=2),
            call("add", a="1"), call("add", b=1), call("add", a=1, c=3), call("add", a=2.0, b=1)])
    assert added == ToolResult("add", "6", None)
    assert default.content == "42"
    assert said.content == "{'said': 'HI!HI!', 'tags': None}"  # the return value, str()'d
    assert mistyped == ToolResult("add", "error: bad arguments for 'add': argument 'a' must be an integer, got "
                                         "string \"1\"", "bad_arguments")
    assert missing.error == "bad_arguments" and "missing required argument 'a' (integer)" in missing.content
    assert unexpected.error == "bad_arguments" and "unexpected argument 'c' (the arguments are: a, b)" in \
        unexpected.content
    assert integral.content == "3"


def test_function_with_a_config_schema_takes_the_schema_name(user_module, tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(f"""
        tools:
          - class_name: {user_module}:add
            config: {{type: native}}
            tool_schema:
              type: function
              function:
                name: plus
                description: Adds.
                parameters: {{type: object, properties: {{a: {{type: integer}}, b: {{type: integer}}}},
                              required: [a, b]}}
    """))
    tools = load_tools(str(path), functions=["calculator"])
    assert tools.names == ("plus", "calculator")
    with tools:
        assert tools.run([call("plus", a=2, b=3)])[0] == ToolResult("plus", "5", None)
        assert tools.run([call("add", a=2, b=3)])[0] == ToolResult(
            "add", "error: unknown tool 'add'; the tools are: plus, calculator", "unknown_tool")


def test_function_from_a_file_path(tmp_path):
    (tmp_path / "my_tools.py").write_text("def double(n: int):\n    '''Double it.'''\n    return 2 * n\n")
    with load_tools(functions=[f"{tmp_path / 'my_tools.py'}:double"]) as tools:
        assert tools.schemas[0]["function"]["description"] == "Double it."
        assert tools.run([call("double", n=21)])[0].content == "42"


def test_bad_function_specs(user_module):
    with pytest.raises(ConfigError, match=r"functions\[0\] 'user_tools_mod:nope': user_tools_mod has no 'nope' "
                                          r"\(its functions: add, die, fail, hang, pid, shout\)"):
        load_tools(functions=[f"{user_module}:nope"])
    with pytest.raises(ConfigError, match="no module named 'not_a_module_abc'"):
        load_tools(functions=["not_a_module_abc:f"])
    with pytest.raises(ConfigError, match="is a class"):
        load_tools(functions=["collections:OrderedDict"])
    with pytest.raises(ConfigError, match="is not a function's name"):
        load_tools(functions=["nodots"])


def test_a_tool_that_raises_is_an_error_result(user_module):
    with load_tools(functions=[f"{user_module}:fail", f"{user_module}:pid"]) as tools:
        before = tools.run([call("pid")])[0].content
        failed = tools.run([call("fail", why="that")])[0]
        after = tools.run([call("pid")])[0].content
    assert failed == ToolResult("fail", "error: ValueError: cannot do that", "error")
    assert before == after != str(os.getpid())  # it ran in a worker process, which lives on


def test_a_tool_whose_process_dies_is_an_error_result(user_module):
    with load_tools(functions=[f"{user_module}:die", f"{user_module}:add"]) as tools:
        died, added = tools.run([call("die"), call("add", a=1)])
    assert died == ToolResult("die", "error: tool 'die' crashed: its worker process died (exit code 3)", "error")
    assert added.content == "3"  # a fresh worker


def test_a_tool_that_hangs_is_killed_at_its_timeout(user_module, tmp_path):
    pid_file = tmp_path / "pid"
    tools = load_tools(functions=[f"{user_module}:hang", f"{user_module}:pid"], timeout_s=1.0)
    try:
        start = time.monotonic()
        result = tools.run([call("hang", seconds=60, pid_file=str(pid_file))])[0]
        took = time.monotonic() - start
        assert result.error == "timeout"
        assert result.content == "error: tool 'hang' ran past 1 s; it was stopped"
        assert took < 10  # 1 s, and the spawn of the worker
        hung = int(pid_file.read_text())
        assert _gone(hung)  # killed and reaped
        # the next call gets a fresh worker
        assert tools.run([call("hang", seconds=0, pid_file=str(pid_file))])[0].content == "woke up"
        assert int(pid_file.read_text()) != hung
        worker = int(tools.run([call("pid")])[0].content)
        assert not _gone(worker)
    finally:
        tools.close()
    assert _gone(worker)  # close() stops the workers


def test_unknown_tool_and_toolset_basics():
    tools = ToolSet([])
    assert tools.run([call("calc", expression="1")], {}) == [
        ToolResult("calc", "error: unknown tool 'calc'; the tools are: none", "unknown_tool")]
    assert tools.run([]) == []


def test_check_arguments_rules():
    params = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "mode": {"type": "string", "enum": ["a", "b"]},
                                               "flag": {"type": "boolean"}}, "required": ["n"]}
    assert check_arguments({"n": 3.0, "x": 1}, params) == ({"n": 3, "x": 1}, None)
    assert check_arguments({"n": True}, params)[1] == "argument 'n' must be an integer, got boolean true"
    assert check_arguments({"n": 1, "mode": "c"}, params)[1] == 'argument \'mode\' must be one of "a", "b", got "c"'
    assert check_arguments({"n": 1, "flag": "yes"}, params)[1].startswith("argument 'flag' must be a boolean")
    assert check_arguments({"anything": 1}, {"type": "object"}) == ({"anything": 1}, None)  # no properties: any
    assert check_arguments({"n": 1, "more": 2}, {**params, "additionalProperties": True})[1] is None


def test_schema_of_refuses_positional_only():
    def f(a, /, b):
        return a

    with pytest.raises(ConfigError, match="positional-only parameter 'a'"):
        schema_of(f)


# ---- the python tool

def test_python_tool(tmp_path):
    with load_tools(functions=["python"], timeout_s=2.0, memory_mb=256) as tools:
        printed, failed, silent, slow, big, net, spawn, outside, flood = tools.run([
            call("python", code="for i in range(3):\n    print(i * i)"),
            call("python", code="print('before')\n1 / 0"),
            call("python", code="x = 5"),
            call("python", code="import time\nprint('started', flush=True)\ntime.sleep(60)"),
            call("python", code="x = bytearray(1024 * 2**20)\nprint(len(x))"),
            call("python", code="import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)"),
            call("python", code="import subprocess\nsubprocess.run(['true'])"),
            call("python", code=f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')"),
            call("python", code="print('x' * 100000)"),
        ])
    assert printed == ToolResult("python", "0\n1\n4\n", None)
    assert failed == ToolResult("python", "before\nerror: ZeroDivisionError: division by zero", "error")
    assert silent.error is None and "printed nothing" in silent.content
    assert slow.error == "timeout" and slow.content == "started\nerror: the code ran past 2 s; it was killed"
    assert big.error == "error" and big.content.startswith("error: MemoryError")
    assert net.error == "error" and "PermissionError: network access is disabled" in net.content
    assert spawn.error == "error" and "starting processes is disabled" in spawn.content
    assert outside.error == "error" and "writing outside the working directory" in outside.content
    assert not (tmp_path / "escaped.txt").exists()
    assert flood.error is None and len(flood.content) < 4100 and "output cut: 100001 bytes in all" in flood.content


def test_python_tool_runs_in_a_clean_directory_and_environment(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    with load_tools(functions=["posttrain.tools.python"]) as tools:
        result = tools.run([call("python", code=(
            "import os\nopen('note.txt', 'w').write('kept')\nprint(open('note.txt').read(), "
            "'HF_TOKEN' in os.environ, sorted(os.listdir('.')))"))])[0]
    assert result.error is None
    assert result.content == "kept False ['main.py', 'note.txt']\n"
