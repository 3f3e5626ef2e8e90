"""Reading a YAML file, every way it can fail turned into one line.

    data = read_mapping(Path("c.yaml"), "config file")   # {} for an empty file
    # ConfigError: config file 'c.yaml' is not valid YAML (while parsing a flow sequence); fix the file

`load_yaml` gives the reason alone (UnreadableYaml) for callers with errors of
their own (a checkpoint's saved config); `read_yaml` and `read_mapping` name
the file in a ConfigError. The loader is PyYAML's safe one unless a caller
passes another (NeMo-RL's files are read as OmegaConf reads them, `1e-8` a
float): a `!!python/...` tag is an error, never a call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import ConfigError

# PyYAML raises plain errors too: ValueError ('2020-02-30', '!!float abc', and a file that is not UTF-8: a
# UnicodeDecodeError), KeyError ('!!bool x'), AttributeError ('!!timestamp x'), RecursionError ('[' x 2000)
YAML_ERRORS = (yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError, RecursionError)


class UnreadableYaml(Exception):
    """A YAML file that cannot be read or parsed; its text is one line ending in what to do, the cause chained."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's text (its type's name when it has none), at most 160 characters."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def load_yaml(path: Path, loader: type = yaml.SafeLoader) -> Any:
    """The document in `path` read as UTF-8 (None for an empty file); UnreadableYaml says why not."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except YAML_ERRORS as e:
        raise UnreadableYaml(f"is not valid YAML ({first_line(e)}); fix the file") from e
    except OSError as e:
        raise UnreadableYaml(f"cannot be read ({e.strerror or e}); check its permissions") from e


def read_yaml(path: Path, what: str, loader: type = yaml.SafeLoader) -> Any:
    """The document in `path`; a ConfigError naming it as `what` ("config file 'c.yaml' ...") when unreadable."""
    try:
        return load_yaml(path, loader)
    except UnreadableYaml as e:
        raise ConfigError(f"{what} '{path}' {e}") from e.__cause__


def read_mapping(path: Path, what: str, loader: type = yaml.SafeLoader) -> dict:
    """The mapping in `path` ({} for an empty file), as read_yaml; anything else is a ConfigError."""
    data = read_yaml(path, what, loader) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping of keys, not {type(data).__name__}")
    return data
