"""NeMo-RL's example configs through `posttrain train --config FILE`'s (and `posttrain sft`'s) loading and checks.

Every top-level `examples/configs/*.yaml` of a NeMo-RL checkout (GRPO's and PPO's,
SFT's, and the other trainers' files, which are refused naming their section) goes
through what `posttrain train` does before it builds anything, or `posttrain sft`
for a file with an `sft:` section: the CLI's parser,
split_train_args and load_config (the file with its `defaults:` files, its
keys mapped onto posttrain's, the result validated). That opens no model and no
dataset (a dataset name is checked against posttrain's list, its files only
when a run is built), so no override is needed to stand in for them. A file
refused for Megatron is tried again with the guide's FSDP2 switch
(docs/coming-from-nemo-rl.md, section 2), its learning rate the file's own
Megatron one. The table says, per file: loads, loads with the FSDP2 switch, or
refused, with the refusal's line (its "(in FILE (NeMo-RL's layout))" left out).

    python bench/nemo_rl_configs.py --nemo-rl ~/RL                # the commit read, the table
    python bench/nemo_rl_configs.py --nemo-rl ~/RL --recipes      # and examples/configs/recipes/llm/grpo-*.yaml
    python bench/nemo_rl_configs.py --nemo-rl ~/RL --tensor-parallel   # and every file that sets dtensor TP > 1
    python bench/nemo_rl_configs.py --nemo-rl ~/RL --generate tests/data/nemo_rl   # the tests' data, below

`--generate DIR` writes DIR/examples_COMMIT.json (with --tensor-parallel also DIR/tensor_parallel_COMMIT.json,
those files keyed by their path under examples/configs): each top-level file's tree as
posttrain's loader reads it (nemo_rl.load_tree: its `defaults:` files merged
in, `${...}` interpolations as written so overrides still flow through them,
YAML comments gone), under a header naming the source, its commit, its license
and this command. tests/test_nemo_rl_config.py writes each tree back to a YAML
file and checks the outcome the guide's section 6 states for it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from posttrain.arguments import split_train_args
from posttrain.cli import build_parser
from posttrain.config import load_config
from posttrain.config.dialects.nemo_rl import files as nemo_rl
from posttrain.errors import ConfigError

SOURCE = "https://github.com/NVIDIA-NeMo/RL"
TOP, RECIPES = "examples/configs/*.yaml", "examples/configs/recipes/llm/grpo-*.yaml"
LOADS, SWITCHED, REFUSED = "loads", "loads with the FSDP2 switch", "refused"
MEGATRON = "policy.megatron_cfg.enabled=true"  # how the Megatron refusal starts
SWITCH = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
DEFAULT_LR = 1e-6  # for a Megatron file without megatron_cfg.optimizer.lr


def command_of(checkout: Path, file: str) -> str:
    """The command that reads the file: `sft` for NeMo-RL's SFT layout (an `sft:` section), else `train`."""
    return "sft" if "sft" in nemo_rl.load_tree(checkout / file) else "train"


def train_config(checkout: Path, file: str, overrides: list[str]):
    """`posttrain train --config FILE OVERRIDES` (`posttrain sft` for an SFT file) up to the Config, run from
    the checkout as the guide does."""
    command = command_of(checkout, file)
    args = build_parser().parse_args([command, "--config", file, *overrides])
    here = os.getcwd()
    os.chdir(checkout)
    try:
        return load_config(*split_train_args(args.args, args.config), command=command)
    finally:
        os.chdir(here)


def fsdp2_switch(checkout: Path, file: str) -> list[str]:
    """Section 2's switch, with the learning rate the file gives Megatron's optimizer."""
    tree = nemo_rl.resolve(nemo_rl.load_tree(checkout / file))
    megatron = (tree.get("policy") or {}).get("megatron_cfg") or {}
    lr = (megatron.get("optimizer") or {}).get("lr", DEFAULT_LR)
    return [*SWITCH, f"++policy.optimizer.kwargs.lr={lr}"]


def one_line(error: ConfigError, file: str) -> str:
    return str(error).replace(f" (in {file} (NeMo-RL's layout))", "")


def outcome(checkout: Path, file: str) -> tuple[str, str]:
    """(LOADS | SWITCHED | REFUSED, what to know: the switch's learning rate, or the refusal's line)."""
    try:
        train_config(checkout, file, [])
        return LOADS, ""
    except ConfigError as e:
        if not str(e).startswith(MEGATRON):
            return REFUSED, one_line(e, file)
    switch = fsdp2_switch(checkout, file)
    try:
        train_config(checkout, file, switch)
        return SWITCHED, switch[-1]
    except ConfigError as e:
        return REFUSED, "with the FSDP2 switch: " + one_line(e, file)


def table(checkout: Path, files: list[str]) -> list[str]:
    rows = ["| file | outcome | switch's learning rate, or the refusal |", "|---|---|---|"]
    counts: dict[str, int] = {}
    for file in files:
        kind, note = outcome(checkout, file)
        counts[kind] = counts.get(kind, 0) + 1
        note = f"`{note}`" if kind == SWITCHED else note.replace("|", "\\|")
        rows.append(f"| `{Path(file).stem}` | {kind} | {note} |")
    rows.append("")
    rows.append(", ".join(f"{kind}: {counts.get(kind, 0)}" for kind in (LOADS, SWITCHED, REFUSED))
                + f" (of {len(files)})")
    return rows


def commit_of(checkout: Path) -> str:
    """`git rev-parse HEAD` of the checkout; "unknown" if it is not the top of a git work tree."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")  # not a directory inside another repository (e.g. posttrain's)
    commit = git("rev-parse", "HEAD") if top and Path(top).resolve() == checkout.resolve() else None
    return commit or "unknown"


def generate(checkout: Path, files: list[str], commit: str, out_dir: str, kind: str = "examples") -> Path:
    """out_dir/KIND_COMMIT.json: the header, then one line per file (its merged tree), keyed by its name (the
    top-level examples) or its path under examples/configs (the tensor-parallel files, from several folders)."""
    what = ("NeMo-RL's top-level examples/configs/*.yaml" if kind == "examples" else
            "every NeMo-RL examples/configs/**/*.yaml whose policy.dtensor_cfg.tensor_parallel_size is above 1")
    about = {
        "what": f"{what} as posttrain's loader reads each one "
                "(posttrain.config.dialects.nemo_rl.load_tree): its `defaults:` files merged in, `${...}` interpolations "
                "as written, YAML comments dropped. tests/test_nemo_rl_config.py writes each back to a YAML file.",
        "source": SOURCE,
        "commit": commit,
        "license": "Apache-2.0 (NeMo-RL's LICENSE)",
        "attribution": "Derived from NVIDIA NeMo-RL (https://github.com/NVIDIA-NeMo/RL), Copyright (c) NVIDIA "
                       "CORPORATION, licensed under the Apache License, Version 2.0 "
                       "(http://www.apache.org/licenses/LICENSE-2.0). Changed: each file merged with its "
                       "`defaults:` files and written as JSON without comments.",
        "generated_by": f"python bench/nemo_rl_configs.py --nemo-rl DIR --generate {out_dir}" +
                        (" --tensor-parallel" if kind != "examples" else ""),
    }
    lines = []
    for file in files:
        tree = nemo_rl.load_tree(checkout / file)
        text = json.dumps(tree, ensure_ascii=False)
        if json.loads(text) != tree:  # e.g. a YAML date: it would not come back as the loader read it
            sys.exit(f"{file}: its tree does not survive JSON unchanged; extend --generate")
        name = Path(file).name if kind == "examples" else str(Path(file).relative_to("examples/configs"))
        lines.append(f"  {json.dumps(name)}: {text}")
    out = Path(out_dir) / f"{kind}_{commit[:7]}.json"
    header = json.dumps({"about": about}, indent=1, ensure_ascii=False)[:-2]  # without the closing "\n}"
    out.write_text(header + ',\n "configs": {\n' + ",\n".join(lines) + "\n }\n}\n")
    json.loads(out.read_text())  # well-formed
    return out


def checkout_of(path: str) -> Path:
    """The --nemo-rl directory, or exit saying why it is not a NeMo-RL checkout."""
    root = Path(path).expanduser()
    if not root.is_dir():
        sys.exit(f"--nemo-rl {path}: no such directory; give a NeMo-RL checkout (git clone {SOURCE})")
    if not sorted(root.glob(TOP)):
        bare = (root / "HEAD").is_file() and (root / "objects").is_dir()
        hint = (f" ({path} is a bare git repository: `git -C {path} archive HEAD | tar -x -C DIR` or "
                f"`git clone --shared {path} DIR` gives a directory)") if bare else ""
        sys.exit(f"--nemo-rl {path} is not a NeMo-RL checkout: it has no {TOP}{hint}")
    return root


def tensor_parallel_files(checkout: Path) -> list[str]:
    """Every config under examples/configs whose policy trains with DTensor tensor parallelism (a size above 1),
    its `defaults:` merged in."""
    out = []
    for path in sorted(checkout.glob("examples/configs/**/*.yaml")):
        try:
            tree = nemo_rl.load_tree(str(path))
        except Exception:  # noqa: BLE001 - a file that does not load as a config is not one of them
            continue
        dtensor = (tree.get("policy") or {}).get("dtensor_cfg") or {}
        size = dtensor.get("tensor_parallel_size")
        if isinstance(size, int) and size > 1 and dtensor.get("enabled") is not False:
            out.append(str(path.relative_to(checkout)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nemo-rl", required=True, metavar="DIR", help="a NeMo-RL checkout")
    ap.add_argument("--recipes", action="store_true", help=f"also {RECIPES}, in a table of their own")
    ap.add_argument("--tensor-parallel", action="store_true",
                    help="also every examples/configs/**/*.yaml whose policy.dtensor_cfg.tensor_parallel_size is "
                         "above 1, in a table of their own")
    ap.add_argument("--generate", metavar="DIR", help="write DIR/examples_COMMIT.json for the tests (with "
                                                      "--tensor-parallel DIR/tensor_parallel_COMMIT.json too)")
    args = ap.parse_args()
    checkout = checkout_of(args.nemo_rl)
    # some recipes name files under ${oc.env:HF_HOME}: resolve it as a job's environment would (Hugging Face's default)
    os.environ.setdefault("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    commit = commit_of(checkout)
    if args.generate and commit == "unknown":
        sys.exit(f"--generate needs a git checkout of NeMo-RL (git clone {SOURCE}): its file names the commit")
    top = sorted(str(p.relative_to(checkout)) for p in checkout.glob(TOP))
    print(f"NeMo-RL {SOURCE} at commit {commit} ({checkout})")
    print(f"each file as `posttrain train --config FILE` (an SFT file: `posttrain sft`); the FSDP2 switch: "
          f"{' '.join(SWITCH)} "
          "++policy.optimizer.kwargs.lr=LR (the file's megatron_cfg.optimizer.lr)\n")
    print(f"## {TOP}\n")
    print("\n".join(table(checkout, top)), flush=True)
    if args.recipes:
        recipes = sorted(str(p.relative_to(checkout)) for p in checkout.glob(RECIPES))
        print(f"\n## {RECIPES}\n")
        print("\n".join(table(checkout, recipes)), flush=True)
    if args.tensor_parallel:
        split = tensor_parallel_files(checkout)
        print(f"\n## examples/configs/**/*.yaml with policy.dtensor_cfg.tensor_parallel_size > 1 ({len(split)})\n")
        print("\n".join(table(checkout, split)), flush=True)
    if args.generate:
        Path(args.generate).mkdir(parents=True, exist_ok=True)
        out = generate(checkout, top, commit, args.generate)
        print(f"\nwrote {out} ({out.stat().st_size // 1024} KiB, {len(top)} configs)")
        if args.tensor_parallel:
            out = generate(checkout, split, commit, args.generate, "tensor_parallel")
            print(f"wrote {out} ({out.stat().st_size // 1024} KiB, {len(split)} configs)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
