"""A user's reward function, loaded from `path/to/file.py:function_name`."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from pathlib import Path
from typing import Callable

from posttrain.errors import RewardError

DEFAULT_FUNCTION = "compute_score"


def load_reward_fn(spec: str) -> Callable:
    """`FILE.py:FUNCTION` (FUNCTION defaults to compute_score) -> the callable,
    expected to take (data_source, solution_str, ground_truth, extra_info=None)."""
    head, sep, tail = spec.rpartition(":")
    path_str, name = (head, tail or DEFAULT_FUNCTION) if sep and head.endswith(".py") else (spec, DEFAULT_FUNCTION)
    path = Path(path_str)
    if not path.is_file():
        raise RewardError(f"reward file '{path}' does not exist; fix reward.custom_fn=FILE.py:FUNCTION")
    module_name = f"posttrain_reward_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise RewardError(f"reward file '{path}' failed to import ({type(e).__name__}: {e}); fix the file") from e
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        raise RewardError(
            f"reward file '{path}' has no function '{name}' (it defines: {', '.join(defined) or 'none'}); "
            "fix reward.custom_fn=FILE.py:FUNCTION"
        )
    if not callable(fn):
        raise RewardError(f"'{name}' in reward file '{path}' is not callable; fix reward.custom_fn")
    return fn
