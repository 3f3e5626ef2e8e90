"""A user's Python function named by a spec: `pkg.module:function`, `pkg.module.function` or `path/file.py:function`.

    import_function("mytools.search:lookup")       # mytools/search.py's lookup (importable: installed or on sys.path)
    import_function("mytools.search.lookup")       # the same
    import_function("tools/search.py:lookup")      # a file, by path (relative: to the current directory)

A file is imported under a module name unique to its absolute path (as
reward.custom_fn files are), so two files both named tools.py do not clash.
Whatever cannot be imported, or is not a function, is a one-line ConfigError.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from posttrain.errors import ConfigError
from posttrain.files.pyfile import CodeFailed, import_file
from posttrain.text.lines import one_line

FORMS = "pkg.module:function, pkg.module.function or path/file.py:function"


def canonical_spec(spec: str) -> str:
    """The spec with a file's path made absolute (a worker process may start elsewhere)."""
    head, sep, tail = spec.strip().rpartition(":")
    if sep and head.endswith(".py"):
        return f"{Path(head).resolve()}:{tail}"
    return spec.strip()


def import_function(spec: str, where: str = "tool function", want_class: bool = False, want_any: bool = False):
    """The function a spec names (want_class: the class; want_any: whatever object it names); ConfigError
    '<where> '<spec>': <what is wrong>; <fix>' when there is none."""
    spec = spec.strip() if isinstance(spec, str) else spec
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{where} {spec!r} is not a function's name; write it as {FORMS}")
    head, sep, attr = spec.rpartition(":")
    if sep and head.endswith(".py"):
        module = _import_file(Path(head), spec, where)
    else:
        if not sep:
            head, _, attr = spec.rpartition(".")
        if not head or not attr or not all(part.isidentifier() for part in head.split(".") + attr.split(".")):
            raise ConfigError(f"{where} '{spec}' is not a function's name; write it as {FORMS}")
        module = _import_module(head, spec, where)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                             and v.__module__ == module.__name__)
            raise ConfigError(f"{where} '{spec}': {module.__name__} has no '{attr}' (its functions: "
                              f"{', '.join(defined) or 'none'}); fix the name")
        obj = getattr(obj, part)
    if want_any:
        return obj
    if want_class:
        if not inspect.isclass(obj):
            raise ConfigError(f"{where} '{spec}' is a {type(obj).__name__}, not a class; name the class")
        return obj
    if inspect.isclass(obj) or not callable(obj):
        what = "a class" if inspect.isclass(obj) else f"not callable (a {type(obj).__name__})"
        raise ConfigError(f"{where} '{spec}' is {what}; name a function, called with the tool's arguments as "
                          "keyword arguments")
    return obj


def _import_module(name: str, spec: str, where: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(f"{where} '{spec}': no module named '{e.name}'; install it, or put its directory on "
                              "PYTHONPATH") from None
        raise ConfigError(f"{where} '{spec}': importing {name} failed ({one_line(e)}); fix the module") from e
    except (Exception, SystemExit) as e:
        raise ConfigError(f"{where} '{spec}': importing {name} failed ({one_line(e)}); fix the module") from e


def _import_file(path: Path, spec: str, where: str):
    try:
        return import_file(path, "posttrain_tool_", reuse=True)
    except FileNotFoundError:
        raise ConfigError(f"{where} '{spec}': file '{path}' does not exist; fix the path (relative paths start at "
                          "the current directory)") from None
    except ImportError:
        raise ConfigError(f"{where} '{spec}': '{path}' cannot be imported as Python; give a .py file") from None
    except CodeFailed as e:
        raise ConfigError(f"{where} '{spec}': importing '{path}' failed ({one_line(e.__cause__)}); fix the file"
                          ) from e.__cause__
