"""A Python file imported by its path: a user's reward file (rewards.custom) or tool file (tools.functions).

    module = import_file(Path("my_reward.py"), "posttrain_reward_")     # module posttrain_reward_<hash>

The module's name is the prefix and a hash of the file's absolute path, so
two files both named tools.py do not clash. The module is in sys.modules
while its code runs (dataclasses and pickling look modules up by name) and
afterwards; if its code raises (SystemExit included), it is taken out again
and CodeFailed is raised from that error. The callers turn each failure
into their own one-line error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class CodeFailed(Exception):
    """The file's code raised while it was imported: the error is `__cause__`."""


def module_name(path: Path, prefix: str) -> str:
    return f"{prefix}{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"


def import_file(path: Path, prefix: str, reuse: bool = False) -> ModuleType:
    """The module of the file at `path`, its code run now (reuse: unless this process already imported it).
    FileNotFoundError: no such file; ImportError: not importable as Python (not a .py file); CodeFailed."""
    if not path.is_file():
        raise FileNotFoundError(path)
    name = module_name(path, prefix)
    if reuse and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    if spec is None or spec.loader is None:
        raise ImportError(f"'{path}' cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)
        raise CodeFailed(str(path)) from e
    return module
