"""What every config a user can write loads to: a corpus of cases, each with its resolved config, its
warnings or its error, written as JSON lines; two such files compared case by case. For a change to the
config's code that must not change what users see: capture before, capture after, compare.

    .venv/bin/python bench/config_corpus.py --out before.jsonl [--verl-configs DIR] [--nemo-rl DIR]
    .venv/bin/python bench/config_corpus.py --out after.jsonl ...
    .venv/bin/python bench/config_corpus.py --compare before.jsonl after.jsonl

--cases-from before.jsonl runs an earlier capture's cases again, those of a key that has left the schema since
included (a case that names a file is that file as --config; the others are one key=value override).

The cases, each for `posttrain train` and `posttrain sft`: every schema key set to each of VALUES; every
algorithm preset; every YAML file of examples/, configs/ and tests/ as --config; with --verl-configs,
verl's trainer/config/*.yaml (e.g. .venv/verl/verl/trainer/config) as --config; with --nemo-rl, a
NeMo-RL checkout's examples/configs/**/*.yaml as --config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VALUES = [None, "x", "0", "-1", "1", "2.5", "true", "null"]  # None: the key's own default, as typed
COMMANDS = ("train", "sft")


def cases(verl_configs: Path | None, nemo_rl: Path | None, values=VALUES, commands=COMMANDS):
    """-> (name, command, config file or None, overrides) for every case."""
    from posttrain.config import SCHEMA
    from posttrain.config.presets import ALGORITHMS

    files = sorted(p for d in ("examples", "configs", "tests") for p in (ROOT / d).rglob("*.yaml"))
    if verl_configs:
        files += sorted(Path(verl_configs).glob("*.yaml"))
    if nemo_rl:
        files += sorted((Path(nemo_rl) / "examples" / "configs").rglob("*.yaml"))
    for command in commands:
        for key, (_, default) in SCHEMA.items():
            for value in values:
                text = value if value is not None else default if isinstance(default, str) else json.dumps(default)
                yield f"{key}={text}", command, None, [f"{key}={text}"]
        for name in ALGORITHMS:
            yield f"algorithm.name={name}", command, None, [f"algorithm.name={name}"]
        for path in files:
            yield str(path), command, str(path), []


def replayed(path: Path):
    """-> the cases of an earlier capture, as cases() gives them."""
    for record in map(json.loads, path.read_text().splitlines()):
        case = record["case"]
        yield (case, record["command"], case, []) if case.startswith("/") else (case, record["command"], None, [case])


def outcome(command: str, path: str | None, overrides: list[str]) -> dict:
    """The resolved config (or the error), and the warnings, of one case. The config as dataclasses.asdict gives
    it: the same mapping as config.config_to_dict's (OmegaConf's structured copy, about three quarters of a case's
    time) for a loaded Config, whose values are plain already."""
    from posttrain.config import load_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = {"config": dataclasses.asdict(load_config(path, overrides, command=command))}
        except Exception as e:  # what a user sees: the error's type and its line
            result = {"error": f"{type(e).__name__}: {e}"}
    result["warnings"] = [str(w.message) for w in caught]
    return result


def capture(out: Path, verl_configs: Path | None, nemo_rl: Path | None, values=VALUES, commands=COMMANDS,
            cases_from: Path | None = None) -> int:
    count = 0
    with out.open("w") as f:
        for name, command, path, overrides in (replayed(cases_from) if cases_from else
                                               cases(verl_configs, nemo_rl, values, commands)):
            record = {"case": name, "command": command, **outcome(command, path, overrides)}
            f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
            count += 1
    print(f"{count} cases -> {out}")
    return 0


def compare(a: Path, b: Path, show: int = 10) -> int:
    def read(p):
        return {(r["command"], r["case"]): r for r in map(json.loads, p.read_text().splitlines())}

    before, after = read(a), read(b)
    only = sorted(set(before) ^ set(after))
    differ = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    print(f"{len(before)} cases in {a}, {len(after)} in {b}: {len(differ)} differ, {len(only)} in one file only")
    for key in differ[:show]:
        x, y = before[key], after[key]
        parts = [f for f in ("error", "warnings") if x.get(f) != y.get(f)]
        if x.get("config") != y.get("config"):
            flat = [k for k in set(x.get("config") or {}) | set(y.get("config") or {})
                    if (x.get("config") or {}).get(k) != (y.get("config") or {}).get(k)]
            parts.append(f"config sections {sorted(flat)}")
        print(f"  {key[0]} {key[1]}: {', '.join(parts)}")
    for key in only[:show]:
        print(f"  {key[0]} {key[1]}: only in {a if key in before else b}")
    return 1 if differ or only else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the corpus's outcomes here (JSON lines)")
    p.add_argument("--verl-configs", type=Path, help="verl's trainer/config folder: its YAML files join the corpus")
    p.add_argument("--nemo-rl", type=Path, help="a NeMo-RL checkout: its examples/configs join the corpus")
    p.add_argument("--values", help="the values each key is set to, comma-separated ('default' for its own; "
                                     "default: all of VALUES)")
    p.add_argument("--commands", default=",".join(COMMANDS), help="train,sft (default: both)")
    p.add_argument("--cases-from", type=Path, help="run the cases of an earlier capture (its keys, files, commands)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two outputs")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("give --out FILE to capture, or --compare BEFORE AFTER")
    values = VALUES if not args.values else [None if v == "default" else v for v in args.values.split(",")]
    return capture(args.out, args.verl_configs, args.nemo_rl, values, tuple(args.commands.split(",")), args.cases_from)


if __name__ == "__main__":
    sys.exit(main())
