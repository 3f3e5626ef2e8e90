"""Imports only go down the floors (docs/layout.md states them; FLOORS here is the truth), and docs/layout.md
maps every module.

Every module of src/posttrain has a floor in FLOORS; an import (at module level, inside a
function or under `if TYPE_CHECKING:`, `import x` or `from x import y`, absolute or relative) may reach a
module on its own floor or a lower one, or any module of its own package, never one higher up. The sources are
read with `ast`, nothing is imported. A lower module that needs a helper from a higher one
means the helper lives in the wrong room: move the helper down, do not lift the floor.
"""

from __future__ import annotations

import ast
from pathlib import Path


SRC = Path(__file__).resolve().parent.parent / "src" / "posttrain"

# Top to bottom; keys are module names under posttrain ("models.lora") or package prefixes
# ("models" holds models.*, "config" holds config.schema, config.load, ...). "__init__" is
# posttrain/__init__.py itself. Entries for modules that do not exist (yet) are harmless.
# Keep this table and DESIGN.md's floors the same picture.
FLOORS: list[tuple[str, ...]] = [
    ("cli", "__main__", "help_config"),  # help_config: what --help-config prints
    ("driver",),  # building a run, the RL and SFT loops, sampling and scoring, validation, rollouts ahead
    ("distributed",),
    ("worker",),  # the verbs of one device, what it is built from, its rollout engine
    ("training", "checkpoint", "tiny"),  # tiny: the tiny models' warm-up recipes
    ("models", "metrics"),
    ("rollout", "agents", "report", "deploy"),
    ("config", "configs", "tools", "envs", "arguments"),  # config.dialects: verl's and NeMo-RL's keys
    ("rewards", "data"),
    # the small helpers: they import nothing of posttrain above this floor
    ("algorithms", "errors", "text", "files", "runtime", "__init__"),
]
FLOOR = {key: len(FLOORS) - i for i, keys in enumerate(FLOORS) for key in keys}  # higher number, higher floor


def module_name(path: Path) -> str:
    """src/posttrain/models/lora.py -> "models.lora"; a package's __init__.py -> the package."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def floor_of(module: str) -> int | None:
    """The floor of `module`: its own entry, else its nearest package's."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in FLOOR:
            return FLOOR[key]
    return None


def _absolute(module: str, node: ast.ImportFrom, is_package: bool = False) -> str:
    """The dotted name (under posttrain, "posttrain" itself for the top) a `from` import reads from;
    `is_package`: `module` is a package's __init__.py (its relative imports start inside it)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(["posttrain", *base, *([node.module] if node.module else [])])


def _ours(name: str) -> str | None:
    """A dotted name -> the posttrain module it is (the nearest existing one), else None."""
    if name != "posttrain" and not name.startswith("posttrain."):
        return None
    parts = name.split(".")[1:]
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) or "__init__"


def imports(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported posttrain module) for every import in `module`'s source, nested ones too."""
    found = []
    for node in ast.walk(ast.parse(source)):  # under `if TYPE_CHECKING:` too
        if isinstance(node, ast.Import):
            found += [(node.lineno, _ours(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(module, node, is_package)
            # `from posttrain.models import lora` imports the module posttrain.models.lora
            found += [(node.lineno, _ours(f"{origin}.{alias.name}")) for alias in node.names]
    return sorted({(line, target) for line, target in found if target is not None and target != module})


def _floor_name(module: str) -> str:
    return "'" + ", ".join(FLOORS[len(FLOORS) - floor_of(module)]) + "'"


def climbs(module: str, source: str, where: str, is_package: bool = False) -> list[str]:
    """One message per import in `source` (module `module`, file `where`) that reaches a higher floor
    outside its own package."""
    found = []
    for line, target in imports(module, source, is_package):
        mine, theirs = floor_of(module), floor_of(target)
        same_package = module.split(".")[0] == target.split(".")[0]
        if mine is not None and theirs is not None and theirs > mine and not same_package:
            found.append(f"{where}:{line}: {module} (floor {_floor_name(module)}) imports {target} "
                         f"(floor {_floor_name(target)}), a higher floor")
    return found


def test_every_module_has_a_floor():
    missing = [m for m in MODULES if floor_of(m) is None]
    assert not missing, (f"no floor for {', '.join(missing)}: add it to FLOORS in tests/test_floors.py "
                         f"and to DESIGN.md's floors")


def test_imports_only_go_down():
    found = []
    for module, path in MODULES.items():
        found += climbs(module, path.read_text(encoding="utf-8"), str(path.relative_to(SRC.parent.parent)),
                        is_package=path.name == "__init__.py")
    assert not found, "imports that climb (move the helper down instead):\n" + "\n".join(found)


def test_the_checker_finds_every_kind_of_import():
    """The checker's own cases: nested, relative, `from package import module`, and its message."""
    assert _ours("posttrain.models.lora") == "models.lora"
    assert _ours("posttrain.models.lora.add_adapters") == "models.lora"
    assert _ours("posttrain") == "__init__"
    assert _ours("torch.nn") is None
    assert floor_of("config.schema") == floor_of("config") and floor_of("data.preprocess.gsm8k") == floor_of("data")
    assert floor_of("cli") > floor_of("driver.build") > floor_of("worker.verbs") > floor_of("models") > floor_of("errors")
    rel = ast.parse("from .lora import x\nfrom . import loader\nfrom .. import errors\n").body
    assert _absolute("models.fetch", rel[0]) == "posttrain.models.lora"
    assert _absolute("models.fetch", rel[1]) == "posttrain.models"
    assert _absolute("models.fetch", rel[2]) == "posttrain"
    assert _absolute("models", rel[0], is_package=True) == "posttrain.models.lora"  # in models/__init__.py
    source = ("import posttrain.errors\nfrom posttrain.models import lora\n\n\ndef f():\n"
              "    from ..checkpoint import manifest\n    import posttrain.cli as c\n"
              "    from . import gguf\n    from posttrain.driver import loop\n")
    assert climbs("models.fetch", source, "src/posttrain/models/fetch.py") == [
        "src/posttrain/models/fetch.py:6: models.fetch (floor 'models, metrics') imports checkpoint.manifest "
        "(floor 'training, checkpoint, tiny'), a higher floor",
        "src/posttrain/models/fetch.py:7: models.fetch (floor 'models, metrics') imports cli "
        "(floor 'cli, __main__, help_config'), a higher floor",
        "src/posttrain/models/fetch.py:9: models.fetch (floor 'models, metrics') imports driver.loop "
        "(floor 'driver'), a higher floor",
    ]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from posttrain.driver.loop import Run\nimport posttrain.cli\n"
    # an import for annotations only is still a dependency: it climbs too
    assert [m.split(": ")[0] for m in climbs("models.fetch", typed, "f.py")] == ["f.py:3", "f.py:4"]


LAYOUT = SRC.parent.parent / "docs" / "layout.md"


def layout_entries(text: str) -> list[str]:
    """The module paths docs/layout.md lists, one per line: a line `  name.py  what it holds` under a package
    line `  package/` (indented by two more per level) inside its ```src/posttrain/``` block."""
    block = text.split("```\nsrc/posttrain/\n", 1)[1].split("```", 1)[0]
    entries, parents = [], []
    for line in block.splitlines():
        if not line.strip() or not line.startswith("  "):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        name = line.split()[0]
        if depth > len(parents):  # a continuation line of the one above
            continue
        parents = parents[:depth]
        if name.endswith("/"):
            parents.append(name)
        elif name.endswith(".py"):
            entries.append("".join(parents) + name)
    return entries


def test_layout_lists_every_module_once():
    """docs/layout.md is the map: every module of src/posttrain has its line (packages' __init__.py may), and
    every module it lists exists."""
    listed = layout_entries(LAYOUT.read_text(encoding="utf-8"))
    files = {str(p.relative_to(SRC)) for p in MODULES.values()}
    missing = sorted(f for f in files - set(listed) if not f.endswith("__init__.py"))
    gone = sorted(set(listed) - files)
    twice = sorted({e for e in listed if listed.count(e) > 1})
    assert not missing and not gone and not twice, (
        f"docs/layout.md: not listed {missing}; listed but no such module {gone}; listed twice {twice}")


def test_layout_states_the_floors():
    """docs/layout.md's floors section is FLOORS, top to bottom, one line a floor."""
    text = LAYOUT.read_text(encoding="utf-8")
    block = text.split("## Floors", 1)[1].split("```", 2)[1]
    stated = [tuple(x.strip() for x in line.split("|")[0].split(",")) for line in block.strip().splitlines()]
    assert stated == FLOORS, "docs/layout.md's floors differ from tests/test_floors.py's FLOORS"


def test_layout_reader():
    text = "```\nsrc/posttrain/\n  cli.py   the top\n           more about it.py\n  driver/\n    loop.py  the loop\n" \
           "    sub/\n      x.py  x\n  errors.py  errors\n```\n"
    assert layout_entries(text) == ["cli.py", "driver/loop.py", "driver/sub/x.py", "errors.py"]
