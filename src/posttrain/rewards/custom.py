"""A user's reward function, loaded from `path/to/file.py:function_name`
(`reward.custom_fn`; verl's custom_reward_function.path + .name).

    fn = load_reward_fn("my_reward.py")                  # its compute_score
    fn = load_reward_fn("rewards/mine.py:score_answer")
    fn("openai/gsm8k", "... #### 18", "18", {})           # called as verl calls it

The function is called as fn(data_source, solution_str, ground_truth,
extra_info) and returns a number (or verl's {"score": number, ...}).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

from posttrain.errors import RewardError
from posttrain.files.pyfile import CodeFailed, import_file
from posttrain.text.lines import one_line

DEFAULT_FUNCTION = "compute_score"
_FIX = "fix reward.custom_fn=FILE.py:FUNCTION"


def parse_spec(spec: str) -> tuple[Path, str]:
    """'dir/f.py:fn' -> (Path('dir/f.py'), 'fn'); 'dir/f.py' -> (..., 'compute_score').
    Only a colon after '.py' splits, so a Windows drive letter stays in the path."""
    head, sep, tail = spec.rpartition(":")
    if sep and head.endswith(".py"):
        return Path(head), tail.strip() or DEFAULT_FUNCTION
    return Path(spec), DEFAULT_FUNCTION


def load_reward_fn(spec: str) -> Callable:
    """Import the file by path (under a module name unique to that path) and
    return its function; RewardError, with the fix, when it cannot."""
    path, name = parse_spec(spec)
    try:
        module = import_file(path, "posttrain_reward_")
    except FileNotFoundError:
        raise RewardError(f"reward file '{path}' does not exist; {_FIX}") from None
    except ImportError:
        raise RewardError(f"reward file '{path}' cannot be imported as Python; give a .py file; {_FIX}") from None
    except CodeFailed as e:
        raise RewardError(f"reward file '{path}' failed to import ({one_line(e.__cause__)}); fix the file"
                          ) from e.__cause__
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(
            f"reward file '{path}' has no function '{name}' (it defines: {', '.join(defined) or 'nothing callable'}); "
            f"{_FIX}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"'{name}' in reward file '{path}' is not callable (its type is {type(fn).__name__}); {_FIX}")
    if inspect.isclass(fn):
        raise RewardError(f"'{name}' in reward file '{path}' is a class, not a function; {_FIX}")
    return fn
