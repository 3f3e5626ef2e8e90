"""`posttrain deploy slurm`: an sbatch script that starts a Ray cluster on the job's nodes and runs posttrain.

    posttrain deploy slurm --nodes 2 --gpus-per-node 8 --setup 'source ~/venv/bin/activate' \\
        -o job.sh -- train config.yaml trainer.nnodes=2 trainer.n_gpus_per_node=8
    sbatch job.sh

The script starts `ray start --head` on the job's first node and one Ray worker
on each other node (each a background `srun` step, in a container when an
image is given), waits until every node has joined, then runs the posttrain
command on the head with RAY_ADDRESS set, which is how posttrain finds an
existing cluster (posttrain.distributed.cluster). On exit it runs `ray stop`
on every node. `render_script` returns the text; nothing is submitted here.

The dashboard, which takes jobs, listens on the head's loopback unless --dashboard-on-network
puts it on the head's address, and then Ray's token authentication is on for every node
(slurm_bash.py); either way the script says RAY_AUTH_MODE on every node.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, fields

from posttrain.deploy.command import check_command, parse_env, write_output
from posttrain.deploy.slurm_bash import helpers, main_part
from posttrain.errors import ConfigError

RUNTIMES = ("pyxis", "docker")
# Slurm's time limit formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit
TIME_RE = re.compile(r"(\d+)(:[0-5]?\d){0,2}|\d+-\d{1,2}(:[0-5]?\d){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
MEM_RE = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
WORD_RE = re.compile(r"[A-Za-z0-9_.,@+-]+")  # partition, account, qos, job name: one word in an #SBATCH line
PATH_RE = re.compile(r"/[\w./@+=%~-]*")  # a mount's side: absolute, and nothing the shell would expand


@dataclass(frozen=True)
class SlurmJob:
    """What the script asks of Slurm and runs; the defaults are `posttrain deploy slurm`'s."""

    command: tuple[str, ...] = ("train",)  # the posttrain command (a leading "posttrain" is accepted)
    nodes: int = 2
    gpus_per_node: int = 8
    cpus_per_node: int | None = None
    mem: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    job_name: str = "posttrain"
    output_log: str = "posttrain-%j.log"
    container_image: str | None = None
    container_runtime: str | None = None  # None: pyxis when an image is given
    mounts: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    ray_port: int = 6379
    dashboard_port: int = 8265
    dashboard_on_network: bool = False  # on the head's address with token authentication, not its loopback
    wait_timeout: int = 300


# --- checks: every value a user can get wrong is a ConfigError naming the flag

def check_job(job: SlurmJob) -> None:
    if job.nodes < 1:
        raise ConfigError(f"--nodes {job.nodes}: a job needs at least 1 node (the Ray head)")
    if job.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {job.gpus_per_node}: must be >= 0 (0 for CPU nodes)")
    if job.cpus_per_node is not None and job.cpus_per_node < 1:
        raise ConfigError(f"--cpus-per-node {job.cpus_per_node}: must be >= 1, or leave it out to use all CPUs")
    if not TIME_RE.fullmatch(job.time):
        raise ConfigError(f"--time {job.time}: not a Slurm time limit; use HH:MM:SS, D-HH:MM:SS or minutes "
                          "(e.g. --time 24:00:00 or --time 2-00:00:00)")
    if job.mem is not None and not MEM_RE.fullmatch(job.mem):
        raise ConfigError(f"--mem {job.mem}: not a Slurm memory size; use a number with K, M, G or T (e.g. 500G)")
    for flag, value in (("--partition", job.partition), ("--account", job.account), ("--qos", job.qos),
                        ("--job-name", job.job_name)):
        if value is not None and not WORD_RE.fullmatch(value):
            raise ConfigError(f"{flag} {value!r}: use one word of letters, digits and . , _ - @ +")
    if not job.output_log or re.search(r"[\s'\"\\]", job.output_log):
        raise ConfigError(f"--output-log {job.output_log!r}: use a path without spaces or quotes "
                          "(%j is the job id, e.g. logs/posttrain-%j.log)")
    for flag, port in (("--ray-port", job.ray_port), ("--dashboard-port", job.dashboard_port)):
        if not 1 <= port <= 65535:
            raise ConfigError(f"{flag} {port}: a port is 1 to 65535")
    if job.ray_port == job.dashboard_port:
        raise ConfigError(f"--ray-port and --dashboard-port are both {job.ray_port}; give them different ports")
    if job.wait_timeout < 1:
        raise ConfigError(f"--wait-timeout {job.wait_timeout}: give the seconds to wait for the nodes, >= 1")
    check_container(job)
    parse_env(job.env)


def check_container(job: SlurmJob) -> None:
    image = job.container_image
    if job.container_runtime is not None and job.container_runtime not in RUNTIMES:
        raise ConfigError(f"--container-runtime {job.container_runtime}: choose one of {', '.join(RUNTIMES)}")
    if image is None:
        if job.container_runtime:
            raise ConfigError(f"--container-runtime {job.container_runtime} needs --container-image IMAGE")
        if job.mounts:
            raise ConfigError(f"--mount {job.mounts[0]}: mounts are for containers; add --container-image IMAGE, "
                              "or drop --mount (without a container the nodes see their own filesystems)")
        return
    if not image or re.search(r"\s", image):
        raise ConfigError(f"--container-image {image!r}: an image name has no spaces "
                          "(e.g. --container-image nvcr.io/nvidia/pytorch:25.01-py3)")
    for mount in job.mounts:
        src, _, rest = mount.partition(":")
        dst, _, flags = rest.partition(":")
        if not (PATH_RE.fullmatch(src) and PATH_RE.fullmatch(dst)) or flags not in ("", "ro", "rw"):
            raise ConfigError(f"--mount {mount}: expected SRC:DST (or SRC:DST:ro), two absolute paths of "
                              "letters, digits and . _ - / (e.g. --mount /scratch/data:/data)")


def check_syntax(script: str) -> None:
    """`bash -n` on the script (when bash is here): a --setup line with a stray quote is
    caught now rather than on the cluster."""
    bash = shutil.which("bash")
    if bash is None:
        return
    result = subprocess.run([bash, "-n"], input=script, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["syntax error"])[0]
        raise ConfigError(f"the rendered script is not valid bash ({why}); check the quoting of --setup lines")


# --- rendering ---------------------------------------------------------------

def render_script(job: SlurmJob) -> str:
    """The sbatch script for `job`, as text. Raises ConfigError for a wrong value."""
    check_job(job)
    command = ["posttrain", *check_command(job.command or ["train"], (job.nodes, job.gpus_per_node),
                                           "--nodes and --gpus-per-node")]
    runtime = job.container_runtime or ("pyxis" if job.container_image else None)
    network = job.dashboard_on_network
    parts = [header(job, command), settings(job, command, runtime), node_env(job), steps(job, runtime),
             helpers(network), main_part(network)]
    return "\n".join(parts)


def header(job: SlurmJob, command: list[str]) -> str:
    sbatch = {"job-name": job.job_name, "nodes": job.nodes, "ntasks-per-node": 1,
              "gpus-per-node": job.gpus_per_node or None, "cpus-per-task": job.cpus_per_node, "mem": job.mem,
              "exclusive": "", "time": job.time, "output": job.output_log,
              "partition": job.partition, "account": job.account, "qos": job.qos}
    lines = ["#!/bin/bash",
             f"# Runs `{shlex.join(command)}` on a Ray cluster of this job's nodes.",
             "# Submit it with `sbatch THIS_FILE`. Rendered by `posttrain deploy slurm`; edit freely.",
             f"# To use every node, the run's config should say trainer.nnodes={job.nodes} "
             + (f"trainer.n_gpus_per_node={job.gpus_per_node}." if job.gpus_per_node else
                "trainer.device=cpu (trainer.n_gpus_per_node: workers per node).")]
    lines += [f"#SBATCH --{key}" + (f"={value}" if value != "" else "")
              for key, value in sbatch.items() if value is not None]
    return "\n".join(lines) + "\n\nset -euo pipefail\n"


AUTH_OFF = ["# Ray's token authentication: off, on every node (the dashboard stays on the head's loopback;",
            "# --dashboard-on-network turns it on). Said here, since `ray start --head` turns it on by itself",
            "# where ~/.ray/auth_token exists, and the other nodes would then be refused.",
            "export RAY_AUTH_MODE=disabled"]
AUTH_ON = ["# Ray's token authentication: on, on every node (--dashboard-on-network); the token is made",
           "# below, and TOKEN_FILE keeps a copy for `posttrain submit` from the login node.",
           "export RAY_AUTH_MODE=token",
           'TOKEN_FILE="$PWD/.posttrain-ray-token-${SLURM_JOB_ID:?submit this script with sbatch}"']


def settings(job: SlurmJob, command: list[str], runtime: str | None) -> str:
    resources = [f"--num-gpus={job.gpus_per_node}"] + ([f"--num-cpus={job.cpus_per_node}"] if job.cpus_per_node else [])
    lines = ["# --- settings " + "-" * 65,
             f"RAY_PORT={job.ray_port}  # the head's port (Ray's GCS): RAY_ADDRESS is HEAD_IP:RAY_PORT",
             f"DASHBOARD_PORT={job.dashboard_port}  # the dashboard and Jobs API (posttrain submit --address)",
             f"WAIT_TIMEOUT={job.wait_timeout}  # seconds to wait for the head, then for every node, to join",
             f"ray_resources=({shlex.join(resources)})  # what each node offers Ray",
             f"command=({shlex.join(command)})  # what runs on the head once every node has joined"]
    lines += AUTH_ON if job.dashboard_on_network else AUTH_OFF
    if runtime:
        mounts = "".join("," + m for m in job.mounts)  # checked: nothing in them to quote
        lines += [f"IMAGE={shlex.quote(job.container_image)}",
                  "# one container per node, named so that later steps on that node run inside it",
                  'CONTAINER="posttrain-${SLURM_JOB_ID}"']
        if runtime == "pyxis":
            lines.append(f'MOUNTS="$PWD:$PWD{mounts}"  # the submit directory (the working directory), then --mount')
    return "\n".join(lines) + "\n"


def node_env(job: SlurmJob) -> str:
    body = [f"export {key}={dquote(value)}" for key, value in parse_env(job.env).items()]
    body += list(job.setup)
    lines = ["# What every step runs first on its node (inside the container, when there is one):",
             "# the --env variables, then the --setup lines.",
             "# It runs in every step through \"$(declare -f node_env)\"; shellcheck cannot follow the",
             "# files that --setup lines source.",
             "# shellcheck disable=SC2329,SC1090,SC1091",
             "node_env() {"] + [f"  {line}" for line in body or [":"]] + ["}"]
    return "\n".join(lines) + "\n"


def dquote(value: str) -> str:
    """A literal value for the shell: bare when safe, else in double quotes (more readable than
    shlex's '"'"' for a value with an apostrophe).

    >>> print(dquote("INFO"), dquote("it's $HOME"))
    INFO "it's \\$HOME"
    """
    if value and re.fullmatch(r"[\w@%+=:,./-]+", value):
        return value
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'


def steps(job: SlurmJob, runtime: str | None) -> str:
    """on_node (a step that is waited for) and start_on (a background Ray step), for the runtime."""
    srun = 'srun --nodes=1 --ntasks=1 --overlap -w "$1"'
    if runtime is None:
        why, run, start = [], [srun], [srun]
    elif runtime == "pyxis":
        why = ["# pyxis: the Ray step creates the node's container from the image; the later steps",
               "# join it by name, so they see Ray's sockets in its /tmp."]
        run = [srun, '--container-name="$CONTAINER" --container-workdir="$PWD"']
        start = [srun, '--container-image="$IMAGE" --container-name="$CONTAINER"',
                 '--container-mounts="$MOUNTS" --container-workdir="$PWD"']
    else:
        why = ["# docker: the Ray step runs the node's container; the later steps `docker exec` into it.",
               "# Host networking: Ray's nodes reach each other's ports; host IPC: shared memory for",
               "# Ray's object store and PyTorch. The submit directory is mounted at the same path."]
        volumes = "".join(f" -v {m}" for m in job.mounts)  # checked: nothing in them to quote
        run = [srun, 'docker exec "$CONTAINER"']
        auth = "-e RAY_AUTH_MODE" + (" -e RAY_AUTH_TOKEN" if job.dashboard_on_network else "")  # their values
        start = [srun, 'docker run --rm --init --name "$CONTAINER" --network host --ipc host'
                 + (" --gpus all" if job.gpus_per_node else ""), f'{auth} -v "$PWD:$PWD" -w "$PWD"{volumes} "$IMAGE"']
    command = 'bash -c "$prelude" bash "${@:2}"'
    lines = ["# --- job steps " + "-" * 64,
             "# Each step runs node_env, then its command. --overlap: steps share the nodes with",
             "# the Ray steps, which hold them for the whole job.",
             'prelude="$(declare -f node_env)', "node_env", 'exec \\"\\$@\\""',
             "ray_steps=()  # the background Ray steps' pids", "ray_nodes=()  # and their nodes", "",
             *why, *([""] if why else []),
             "# Runs a command on node $1 and waits for it.",
             "on_node() {", "  " + " \\\n    ".join([*run, command]), "}", "",
             "# Starts a command on node $1 in the background: the Ray steps.",
             "start_on() {", "  " + " \\\n    ".join([*start, command]) + " &",
             '  ray_steps+=("$!")', '  ray_nodes+=("$1")', "}"]
    return "\n".join(lines) + "\n"


# --- the command line --------------------------------------------------------

def register(subparsers) -> None:
    """Add `slurm` to `posttrain deploy`'s sub-commands."""
    p = subparsers.add_parser(
        "slurm", help="an sbatch script: a Ray cluster over the job's nodes, then a posttrain command",
        description="posttrain deploy slurm [flags] [-- train CONFIG.yaml key=value ...]. Writes an sbatch "
                    "script that starts Ray on every node of the job, waits for them, runs the command "
                    "(default: train) on the head and stops Ray at the end. Submit it with sbatch.")
    p.add_argument("command", nargs="*", metavar="-- COMMAND", help="the posttrain command to run (default: train)")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the job; the first is the Ray head (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8; 0 for CPU nodes)")
    p.add_argument("--cpus-per-node", type=int, help="CPUs per node (#SBATCH --cpus-per-task; default: all)")
    p.add_argument("--mem", help="memory per node, e.g. 500G (default: the partition's)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--qos", help="Slurm quality of service")
    p.add_argument("--time", default="24:00:00", help="time limit, e.g. 24:00:00 or 2-00:00:00 (default 24:00:00)")
    p.add_argument("--job-name", default="posttrain", help="Slurm job name (default posttrain)")
    p.add_argument("--output-log", default="posttrain-%j.log", help="the job's log file (default posttrain-%%j.log)")
    p.add_argument("--container-image", metavar="IMAGE", help="run Ray and the command in this image")
    p.add_argument("--container-runtime", choices=RUNTIMES,
                   help="pyxis (srun --container-image; the default with an image) or docker (docker run per node)")
    p.add_argument("--mount", action="append", default=[], metavar="SRC:DST", dest="mounts",
                   help="a container bind mount (repeatable; the submit directory is always mounted)")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run on every node before Ray, e.g. 'source ~/venv/bin/activate' (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for every node, taken literally (repeatable; for a value that uses "
                        "variables: --setup 'export KEY=\"$SCRATCH/...\"')")
    p.add_argument("--ray-port", type=int, default=6379, help="the head's Ray port (default 6379)")
    p.add_argument("--dashboard-port", type=int, default=8265, help="the Ray dashboard's port (default 8265)")
    p.add_argument("--dashboard-on-network", action="store_true",
                   help="put the Ray dashboard, which takes jobs, on the head's address with Ray's token "
                        "authentication on every node (default: the head's loopback only; reach it through ssh -L)")
    p.add_argument("--wait-timeout", type=int, default=300,
                   help="seconds to wait for the head, then for all nodes, to join (default 300)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the script here (default: stdout)")
    p.set_defaults(func=cmd_slurm)


def cmd_slurm(args) -> int:
    given = {f.name: getattr(args, f.name) for f in fields(SlurmJob)}
    job = SlurmJob(**{name: tuple(v) if isinstance(v, list) else v for name, v in given.items()})
    script = render_script(job)
    check_syntax(script)
    write_output(script, args.output, f"wrote {args.output}; submit it with: sbatch {args.output}", executable=True)
    return 0
