"""`posttrain deploy slurm`: the rendered sbatch script, its checks, and its Ray start sequence run here
with stand-ins for Slurm (two fake nodes on loopback)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.deploy.slurm import SlurmJob, render_script

from helpers import NO_SHELLCHECK, free_ports, shellcheck
from listeners import non_loopback_listeners

VENV_BIN = Path(sys.executable).parent


def has_line(script: str, start: str) -> bool:
    return any(line.startswith(start) for line in script.splitlines())


def check_shell(script: str, tmp_path: Path) -> None:
    """The script parses (`bash -n`) and shellcheck finds nothing at its default severity."""
    path = tmp_path / "job.sh"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
    linter = shellcheck()
    if linter is None:
        pytest.skip(NO_SHELLCHECK)
    lint = subprocess.run([linter, str(path)], capture_output=True, text=True, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


# --- rendering ----------------------------------------------------------------------------------

def test_default_script(tmp_path, capsys):
    assert main(["deploy", "slurm"]) == 0
    script = capsys.readouterr().out
    check_shell(script, tmp_path)
    assert script.startswith("#!/bin/bash\n")
    for line in ["#SBATCH --job-name=posttrain", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --time=24:00:00",
                 "#SBATCH --output=posttrain-%j.log", "set -euo pipefail",
                 'mapfile -t nodes < <(scontrol show hostnames '
                 '"${SLURM_JOB_NODELIST:?submit this script with sbatch}")',
                 'start_on "$head" ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" \\',
                 '  --dashboard-host=0.0.0.0 --dashboard-port="$DASHBOARD_PORT" --disable-usage-stats \\',
                 '  start_on "$node" ray start --address="$ray_address" --node-ip-address="$node_addr" \\',
                 'wait_for_nodes "${#nodes[@]}"',
                 'on_node "$head" env RAY_ADDRESS="$ray_address" "${command[@]}"',
                 '      on_node "$node" ray stop &', "trap cleanup EXIT"]:
        assert line in script.splitlines(), line
    for start in ["RAY_PORT=6379  #", "DASHBOARD_PORT=8265  #", "WAIT_TIMEOUT=300  #",
                  "ray_resources=(--num-gpus=8)  #", "command=(posttrain train)  #"]:
        assert has_line(script, start), start
    assert "--container" not in script and "docker" not in script
    # #SBATCH lines are read only before the first command
    first_command = script.splitlines().index("set -euo pipefail")
    assert all(i < first_command for i, ln in enumerate(script.splitlines()) if ln.startswith("#SBATCH"))


def test_pyxis_image_with_mounts(tmp_path):
    script = render_script(SlurmJob(container_image="nvcr.io/nvidia/pytorch:25.01-py3",
                                    mounts=("/scratch/data:/data", "/models:/models:ro"),
                                    command=("posttrain", "train", "my config.yaml", "trainer.experiment_name=a b")))
    check_shell(script, tmp_path)
    lines = script.splitlines()
    assert "IMAGE=nvcr.io/nvidia/pytorch:25.01-py3" in lines
    assert has_line(script, 'MOUNTS="$PWD:$PWD,/scratch/data:/data,/models:/models:ro"  #')
    start_on = lines.index("start_on() {")
    assert lines[start_on + 2: start_on + 5] == ['    --container-image="$IMAGE" --container-name="$CONTAINER" \\',
                                                 '    --container-mounts="$MOUNTS" --container-workdir="$PWD" \\',
                                                 '    bash -c "$prelude" bash "${@:2}" &']
    # the later steps join the running container by its name, in the same directory
    on_node = lines.index("on_node() {")
    assert lines[on_node + 2] == '    --container-name="$CONTAINER" --container-workdir="$PWD" \\'
    assert has_line(script, "command=(posttrain train 'my config.yaml' 'trainer.experiment_name=a b')  #")


def test_docker_runtime(tmp_path):
    script = render_script(SlurmJob(container_image="registry.example/posttrain:1", container_runtime="docker",
                                    mounts=("/scratch:/scratch",), gpus_per_node=4))
    check_shell(script, tmp_path)
    lines = script.splitlines()
    start_on = lines.index("start_on() {")
    assert lines[start_on + 2: start_on + 4] == [
        '    docker run --rm --init --name "$CONTAINER" --network host --ipc host --gpus all \\',
        '    -v "$PWD:$PWD" -w "$PWD" -v /scratch:/scratch "$IMAGE" \\']
    assert lines[lines.index("on_node() {") + 2] == '    docker exec "$CONTAINER" \\'
    assert "#SBATCH --gpus-per-node=4" in script and "--container-image" not in script
    no_gpu = render_script(SlurmJob(container_image="img", container_runtime="docker", gpus_per_node=0))
    assert "--gpus all" not in no_gpu and "#SBATCH --gpus-per-node" not in no_gpu


def test_cpu_nodes_with_setup_and_env(tmp_path):
    script = render_script(SlurmJob(gpus_per_node=0, cpus_per_node=16, mem="64G",
                                    setup=("source ~/venv/bin/activate", "module load cuda/12.4"),
                                    env=("NCCL_DEBUG=INFO", "GREETING=it's $HOME", "EMPTY=")))
    check_shell(script, tmp_path)
    lines = script.splitlines()
    assert "#SBATCH --gpus-per-node" not in script
    assert "#SBATCH --cpus-per-task=16" in lines and "#SBATCH --mem=64G" in lines
    assert has_line(script, "ray_resources=(--num-gpus=0 --num-cpus=16)  #")
    body = lines[lines.index("node_env() {") + 1: lines.index("node_env() {") + 6]
    assert body == ["  export NCCL_DEBUG=INFO", '  export GREETING="it\'s \\$HOME"', '  export EMPTY=""',
                    "  source ~/venv/bin/activate", "  module load cuda/12.4"]
    # the values stay literal: bash gives back exactly what was asked
    out = subprocess.run(["bash", "-c", "\n".join(lines[lines.index("node_env() {"):lines.index("node_env() {") + 4])
                          + "\n}\nnode_env; printf '%s|%s' \"$NCCL_DEBUG\" \"$GREETING\""],
                         capture_output=True, text=True, check=False)
    assert out.stdout == "INFO|it's $HOME"


def test_partition_account_qos_time(tmp_path):
    script = render_script(SlurmJob(partition="gpu", account="proj-1", qos="high", time="2-00:00:00",
                                    job_name="grpo-32b", output_log="logs/%x-%j.out", nodes=4))
    check_shell(script, tmp_path)
    for line in ["#SBATCH --partition=gpu", "#SBATCH --account=proj-1", "#SBATCH --qos=high",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --job-name=grpo-32b", "#SBATCH --output=logs/%x-%j.out",
                 "#SBATCH --nodes=4"]:
        assert line in script.splitlines()


def test_output_file(tmp_path, capsys):
    out = tmp_path / "job.sh"
    assert main(["deploy", "slurm", "--nodes", "3", "-o", str(out), "--", "train", "c.yaml", "trainer.nnodes=3"]) == 0
    assert "sbatch" in capsys.readouterr().err
    assert "#SBATCH --nodes=3" in out.read_text() and os.access(out, os.X_OK)
    assert has_line(out.read_text(), "command=(posttrain train c.yaml trainer.nnodes=3)  #")


# --- mistakes are one-line errors that name the flag and the fix ------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--time", "24h"], "--time 24h: not a Slurm time limit; use HH:MM:SS"),
    (["--time", "1:75:00"], "--time 1:75:00"),
    (["--nodes", "0"], "--nodes 0: a job needs at least 1 node"),
    (["--gpus-per-node", "-1"], "--gpus-per-node -1: must be >= 0"),
    (["--mount", "/data:/data"], "--mount /data:/data: mounts are for containers; add --container-image"),
    (["--container-image", "img", "--mount", "data:/data"], "--mount data:/data: expected SRC:DST"),
    (["--container-runtime", "docker"], "--container-runtime docker needs --container-image"),
    (["--env", "NOVALUE"], "--env NOVALUE: expected KEY=VALUE with KEY an environment variable name"),
    (["--env", "1BAD=x"], "--env 1BAD=x: expected KEY=VALUE with KEY an environment variable name"),
    (["--mem", "lots"], "--mem lots: not a Slurm memory size"),
    (["--partition", "gpu a100"], "--partition 'gpu a100': use one word"),
    (["--ray-port", "8265"], "--ray-port and --dashboard-port are both 8265"),
    (["--", "trian", "c.yaml"], "the command after -- (trian c.yaml): argument command: invalid choice: 'trian'"),
    (["--", "posttrain", "deploy", "slurm"], "`posttrain deploy`, which does no work on the cluster"),
    (["--", "submit", "--list"], "`posttrain submit`, which does no work on the cluster"),
    (["--", "train", "c.yaml", "oops"], "the command after -- (train c.yaml oops): unexpected argument 'oops'"),
    (["--setup", "echo 'unclosed"], "the rendered script is not valid bash"),
    (["--", "train", "data.trian_files=/d/x.parquet"], "unknown config key 'data.trian_files'"),
    (["--nodes", "2", "--", "train", "trainer.nnodes=4", "trainer.n_gpus_per_node=8"],
     "trainer.nnodes=4 trainer.n_gpus_per_node=8 needs more than the 2 nodes x 8 GPUs rendered; change --nodes"),
])
def test_wrong_values_are_clear_errors(argv, expected, capsys):
    assert main(["deploy", "slurm", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("posttrain: error: ") and "\n" not in err, err
    assert expected in err


# --- the start sequence, run here: two fake nodes on loopback -----------------------------------

SRUN = r"""#!/bin/bash
# Stands in for srun: runs the step here as fake node -w NODE, in a session of its own
# (so that the fake `ray stop` can end exactly that node's Ray), and logs it.
node=
while (($#)); do
  case $1 in
    -w|--nodelist) node=$2; shift 2 ;;
    --nodelist=*) node=${1#*=}; shift ;;
    -N|-n|-c|--nodes|--ntasks|--cpus-per-task) shift 2 ;;
    --*=*|--overlap|--exact|--whole) shift ;;
    --) shift; break ;;
    -*) echo "fake srun: unexpected option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ -n $node ]] || { echo "fake srun: no -w NODE" >&2; exit 2; }
step=$(printf ' %q' "$@")
echo "$node$step" >> "$PTSL_STATE/srun.log"  # one line, one write: steps run in parallel
export FAKE_NODE=$node
exec setsid --wait "$@"
"""

RAY = r"""#!/bin/bash
# Stands in for `ray` on fake node $FAKE_NODE. start: the real one, on loopback, with this
# node's own ports and temp dir (two nodes share this machine). stop: ends only the sessions
# this node's `ray start` steps began, where a real `ray stop` would end every Ray of the user.
groups="$PTSL_STATE/$FAKE_NODE.groups"
case $1 in
  start)
    shift
    echo "$FAKE_NODE start $*" >> "$PTSL_STATE/ray.log"
    args=()
    for arg in "$@"; do
      [[ $arg == --dashboard-host=0.0.0.0 ]] && arg=--dashboard-host=127.0.0.1
      args+=("$arg")
    done
    mapfile -t own < "$PTSL_STATE/$FAKE_NODE.args"
    ps -o pgid= -p $$ | tr -d ' ' >> "$groups"
    [[ " $* " == *" --head "* ]] && exec "$REAL_RAY" start "${args[@]}" "${own[@]}"
    # A worker: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every address on loopback, but then
    # `ray start --address` refuses to add a node. Lift that refusal only, in this process.
    exec "$PTSL_PYTHON" -c "$WORKER_START" start "${args[@]}" "${own[@]}"
    ;;
  stop)
    echo "$FAKE_NODE stop" >> "$PTSL_STATE/ray.log"
    mapfile -t started < <(cat "$groups" 2>/dev/null)
    # like `ray stop`: the Ray processes, not `ray start --block` itself, which exits when they do
    for g in "${started[@]}"; do
      for pid in $(pgrep -g "$g"); do ((pid == g)) || kill -TERM "$pid" 2>/dev/null; done
    done
    for _ in $(seq 150); do
      alive=0
      for g in "${started[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
      ((alive)) || exit 0
      sleep 0.2
    done
    for g in "${started[@]}"; do kill -KILL -- "-$g" 2>/dev/null; done
    ;;
  *) exec "$REAL_RAY" "$@" ;;
esac
"""

WORKER_START = """import sys, types
import ray._private.ray_constants as constants
import ray.scripts.scripts as scripts
scripts.ray_constants = types.SimpleNamespace(**{**vars(constants), "ENABLE_RAY_CLUSTER": True})
sys.argv[0] = "ray"
sys.exit(scripts.main())
"""

# posttrain's own way into a running cluster (RAY_ADDRESS), then a report of what it found
POSTTRAIN = """#!{python}
import json, os, sys, time
from pathlib import Path
from posttrain.distributed.cluster import connect
where = connect(None)
import ray
alive = sum(node["Alive"] for node in ray.nodes())
state = Path(os.environ["PTSL_STATE"])
(state / "posttrain.json").write_text(json.dumps(dict(
    argv=sys.argv[1:], ray_address=os.environ.get("RAY_ADDRESS"), where=where, alive=alive)))
for _ in range(600):  # the test looks at the sockets while the cluster is up, then says go
    if (state / "go").exists():
        break
    time.sleep(0.1)
ray.shutdown()
sys.exit(7)
"""


def write_stubs(bin_dir: Path, state: Path, ports: dict[str, list[int]]) -> None:
    bin_dir.mkdir()
    stubs = {
        "srun": SRUN, "ray": RAY, "posttrain": POSTTRAIN.format(python=sys.executable),
        "scontrol": '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "node1\\nnode2\\n"\n',
        "hostname": "#!/bin/bash\ncase $1 in --ip-address|-i) echo 127.0.0.1 ;; --all-ip-addresses|-I) echo ;; "
                    "*) echo fakehost ;; esac\n",
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    names = ["dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "node-manager-port", "object-manager-port", "ray-client-server-port"]
    for node, node_ports in ports.items():
        flags = [f"--{name}={port}" for name, port in zip(names, node_ports)]
        flags += [f"--temp-dir={state / node}", "--object-store-memory=100000000", "--num-cpus=1"]
        (state / f"{node}.args").write_text("\n".join(flags) + "\n")


def marked_processes(marker: str) -> set[int]:
    """Processes whose environment carries this test's marker: everything the script started."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.add(int(environ.parent.name))
        except OSError:
            pass
    return found


def kill_all(marker: str) -> None:
    for pid in marked_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_script_starts_ray_on_two_nodes_runs_the_command_and_stops_ray(tmp_path):
    """The rendered script, run by bash with stand-ins for srun/scontrol/hostname: both nodes join,
    the command runs on the cluster with RAY_ADDRESS and gives the script its exit status, the
    trap stops Ray on each node, and nothing is left running."""
    pytest.importorskip("ray")
    ray_port, dashboard_port, closed_port, *others = free_ports(3 + 7 + 6)
    command = ("train", "my config.yaml", "trainer.experiment_name=a b")
    script = render_script(SlurmJob(nodes=2, gpus_per_node=0, ray_port=ray_port, dashboard_port=dashboard_port,
                                    wait_timeout=120, command=command))
    (tmp_path / "job.sh").write_text(script)
    state = Path(tempfile.mkdtemp(prefix="ptsl-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    write_stubs(tmp_path / "bin", state, {"node1": others[:7], "node2": others[7:]})
    token = uuid.uuid4().hex
    marker = f"PTSL_MARKER={token}"  # in the environment of every process the script starts
    # Ray's dashboard asks cloud metadata servers (169.254.169.254) which cloud it runs on unless
    # ~/ray_bootstrap_config.yaml says, and reports "usage stats disabled" to usage-stats.ray.io:
    # a home of its own with that file, and a closed loopback port for the report.
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "ray_bootstrap_config.yaml").write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PATH=f"{tmp_path / 'bin'}:{VENV_BIN}:{env['PATH']}", PTSL_STATE=str(state),
               REAL_RAY=str(VENV_BIN / "ray"), PTSL_PYTHON=sys.executable, WORKER_START=WORKER_START,
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="4242",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               PTSL_MARKER=token, HOME=str(tmp_path / "home"),
               RAY_USAGE_STATS_REPORT_URL=f"http://127.0.0.1:{closed_port}/")
    log, job = tmp_path / "job.log", None
    try:
        with open(log, "w") as out:
            job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        report = state / "posttrain.json"
        deadline = time.monotonic() + 180
        while not report.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert report.exists(), f"the command did not run\n{log.read_text()[-6000:]}"
        # the cluster is up and the command holds it open: everything listens on loopback only
        assert non_loopback_listeners(marked_processes(marker)) == []
        (state / "go").touch()
        assert job.wait(timeout=120) == 7, log.read_text()[-6000:]

        ran = json.loads(report.read_text())
        assert ran["alive"] == 2 and ran["argv"] == list(command)
        assert ran["ray_address"] == f"127.0.0.1:{ray_port}" and ran["where"] == f"Ray cluster at {ran['ray_address']}"
        ray_log = (state / "ray.log").read_text().splitlines()
        assert any(ln.startswith(f"node1 start --head --node-ip-address=127.0.0.1 --port={ray_port} "
                                 "--dashboard-host=0.0.0.0") for ln in ray_log), ray_log
        assert any(ln.startswith(f"node2 start --address=127.0.0.1:{ray_port} --node-ip-address=127.0.0.1")
                   for ln in ray_log), ray_log
        assert {"node1 stop", "node2 stop"} <= set(ray_log)  # the trap asked each node, in a step on that node
        steps = (state / "srun.log").read_text().splitlines()
        stops = sorted(ln.split()[0] for ln in steps if ln.endswith(" ray stop"))
        assert stops == ["node1", "node2"], steps
        # ... and Ray is gone: no process that the script started is left
        deadline = time.monotonic() + 20
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marked_processes(marker) == set(), log.read_text()[-3000:]
        assert "exit status 7" in log.read_text()
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        kill_all(marker)
        shutil.rmtree(state, ignore_errors=True)
