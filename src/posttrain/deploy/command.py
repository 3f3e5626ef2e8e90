"""What `posttrain deploy kuberay` and `posttrain deploy slurm` share: the checks of the
posttrain command a cluster will run (after `--`) and of `--env KEY=VALUE` items, and
writing what they render.

A command is checked with posttrain's own parser and config loader, so that a typo
fails when the manifest or script is rendered, not after the cluster has started or
the job has waited in the queue.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

from posttrain.arguments import split_train_args, work_parser
from posttrain.errors import ConfigError

NOT_ON_CLUSTER = ("deploy", "submit")  # they start work elsewhere, they do none
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
EXAMPLE = "e.g. -- train CONFIG.yaml key=value"


def check_command(words: list[str] | tuple[str, ...], cluster: tuple[int, int] | None = None,
                  resize: str = "") -> list[str]:
    """The words after `--` (a leading `posttrain` allowed) -> the posttrain arguments.

    cluster: (nodes, GPUs per node) the command will find; a `train` command asking
    for more (trainer.nnodes x trainer.n_gpus_per_node) is an error that names `resize`,
    the flags that change the cluster."""
    words = list(words)
    if words[:1] == ["posttrain"]:
        words = words[1:]
    if not words:
        raise ConfigError(f"no command after --: give the posttrain command to run, {EXAMPLE}")
    # the sub-command is the first word that is not an option (posttrain's own options take no value)
    sub = next((w for w in words if not w.startswith("-")), None)
    if sub in NOT_ON_CLUSTER:
        raise ConfigError(f"the command after -- is `posttrain {sub}`, which does no work on the cluster; give "
                          f"the command that does, {EXAMPLE}")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            parsed = work_parser().parse_args(words)
    except SystemExit as e:
        lines = [line for line in said.getvalue().splitlines() if "error:" in line]
        why = lines[-1].split("error:", 1)[1].strip() if lines else (
            "not a posttrain command" if e.code else "it would only print help and exit")
        raise ConfigError(f"the command after -- ({shlex.join(words)}): {why}; give a posttrain command, "
                          f"{EXAMPLE}") from None
    if sub == "train":
        _check_train(parsed.args, words, cluster, resize)
    return words


def _check_train(args: list[str], words: list[str], cluster, resize: str) -> None:
    """Unknown config keys, and a trainer.nnodes x n_gpus_per_node the cluster cannot hold."""
    from posttrain.config import canonicalize, parse_override
    from posttrain.config.dialects import nemo_rl

    try:  # NeMo-RL's keys are checked against its file where the job runs; posttrain's and verl's here
        overrides = [a for a in split_train_args(args)[1] if not a.startswith("~")]
        nemo = dict(parse_override(a) for a in overrides if nemo_rl.is_key(a.split("=", 1)[0]))
        flat = canonicalize(dict(parse_override(a) for a in overrides if a.split("=", 1)[0].lstrip("+") not in nemo),
                            "after --")
    except ConfigError as e:
        raise ConfigError(f"the command after -- ({shlex.join(words)}): {e}") from None
    nodes = flat.get("trainer.nnodes", nemo.get("cluster.num_nodes", 1))
    gpus = flat.get("trainer.n_gpus_per_node", nemo.get("cluster.gpus_per_node", 1))
    if cluster is None or not cluster[1] or not (isinstance(nodes, int) and isinstance(gpus, int)):
        return  # a config file may set them; CPU workers are not counted in GPUs
    if nodes > cluster[0] or gpus > cluster[1]:
        raise ConfigError(f"-- train trainer.nnodes={nodes} trainer.n_gpus_per_node={gpus} needs more than the "
                          f"{cluster[0]} nodes x {cluster[1]} GPUs rendered; change {resize}, or the command")


def parse_env(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`--env KEY=VALUE` items -> {KEY: VALUE}, the last of a key winning."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.fullmatch(key):
            raise ConfigError(f"--env {item}: expected KEY=VALUE with KEY an environment variable name (letters, "
                              "digits and _, not starting with a digit), e.g. --env NCCL_DEBUG=INFO")
        env[key] = value
    return env


def write_output(text: str, path: str | None, wrote: str, executable: bool = False) -> None:
    """`text` to stdout, or to `path` (--output) and then `wrote` to stderr."""
    if not path:
        sys.stdout.write(text)
        return
    try:
        Path(path).write_text(text)
        if executable:
            Path(path).chmod(0o755)
    except OSError as e:
        raise ConfigError(f"--output {path}: cannot write it ({e.strerror}); choose a writable path") from e
    print(f"posttrain: {wrote}", file=sys.stderr)
