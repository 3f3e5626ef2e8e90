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
import urllib.error
import urllib.request
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
                 '  --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" --disable-usage-stats \\',
                 '  start_on "$node" ray start --address="$ray_address" --node-ip-address="$node_addr" \\',
                 'wait_for_nodes "${#nodes[@]}"',
                 'on_node "$head" env RAY_ADDRESS="$ray_address" "${command[@]}"',
                 '      on_node "$node" ray stop &', "trap cleanup EXIT"]:
        assert line in script.splitlines(), line
    for start in ["RAY_PORT=6379  #", "DASHBOARD_PORT=8265  #", "WAIT_TIMEOUT=300  #",
                  "ray_resources=(--num-gpus=8)  #", "command=(posttrain train)  #"]:
        assert has_line(script, start), start
    assert "--container" not in script and "docker" not in script
    # the dashboard, which takes jobs, stays on the head's loopback; token authentication is off on
    # every node (said, since `ray start --head` alone turns it on where ~/.ray/auth_token exists)
    assert "export RAY_AUTH_MODE=disabled" in script.splitlines() and "0.0.0.0" not in script
    assert "TOKEN" not in script.replace("auth_token", "")
    assert 'echo "posttrain:   ssh -N -L 8265:127.0.0.1:$DASHBOARD_PORT $head   (through the login node: ' in script
    assert "posttrain submit --address http://127.0.0.1:8265 --list" in script
    # #SBATCH lines are read only before the first command
    first_command = script.splitlines().index("set -euo pipefail")
    assert all(i < first_command for i, ln in enumerate(script.splitlines()) if ln.startswith("#SBATCH"))


def test_dashboard_on_network_turns_token_authentication_on(tmp_path, capsys):
    assert main(["deploy", "slurm", "--dashboard-on-network"]) == 0
    script = capsys.readouterr().out
    check_shell(script, tmp_path)
    lines = script.splitlines()
    # on the head's address (the one the other nodes use), not every interface
    assert '  --dashboard-host="$head_ip" --dashboard-port="$DASHBOARD_PORT" --disable-usage-stats \\' in lines
    assert "0.0.0.0" not in script and "export RAY_AUTH_MODE=disabled" not in lines
    # token authentication on every node: the mode and a new token in every step's environment,
    # a copy in a file only the user can read, removed on exit
    token = ["export RAY_AUTH_MODE=token",
             'TOKEN_FILE="$PWD/.posttrain-ray-token-${SLURM_JOB_ID:?submit this script with sbatch}"',
             "RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')", "export RAY_AUTH_TOKEN",
             """(umask 077 && printf '%s' "$RAY_AUTH_TOKEN" > "$TOKEN_FILE")""",
             '  rm -f "$TOKEN_FILE"  # the token ends with the cluster']
    assert all(line in lines for line in token), [line for line in token if line not in lines]
    # ... made before Ray starts, and the log says how to reach the dashboard with it
    assert lines.index("export RAY_AUTH_TOKEN") < next(i for i, ln in enumerate(lines) if "ray start --head" in ln)
    reach = lines.index('echo "posttrain:   RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$(printf %q "$TOKEN_FILE")" \\')
    assert lines[reach + 1] == '  "posttrain submit --address http://$head_ip:$DASHBOARD_PORT --list"'
    assert "ssh -N -L" not in script
    # docker passes both to the container by name: their values stay off the command line
    for network, passed in ((False, "-e RAY_AUTH_MODE -v"), (True, "-e RAY_AUTH_MODE -e RAY_AUTH_TOKEN -v")):
        docker = render_script(SlurmJob(container_image="img", container_runtime="docker",
                                        dashboard_on_network=network))
        assert f'    {passed} "$PWD:$PWD" -w "$PWD" "$IMAGE" \\' in docker.splitlines()


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
        '    -e RAY_AUTH_MODE -v "$PWD:$PWD" -w "$PWD" -v /scratch:/scratch "$IMAGE" \\']
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
    mapfile -t own < "$PTSL_STATE/$FAKE_NODE.args"
    ps -o pgid= -p $$ | tr -d ' ' >> "$groups"
    [[ " $* " == *" --head "* ]] && exec "$REAL_RAY" start "$@" "${own[@]}"
    # A worker: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every address on loopback, but then
    # `ray start --address` refuses to add a node. Lift that refusal only, in this process.
    exec "$PTSL_PYTHON" -c "$WORKER_START" start "$@" "${own[@]}"
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
    argv=sys.argv[1:], ray_address=os.environ.get("RAY_ADDRESS"), where=where, alive=alive,
    auth=os.environ.get("RAY_AUTH_MODE"), token=len(os.environ.get("RAY_AUTH_TOKEN", "")))))
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


def submit_list(url: str, env: dict) -> subprocess.CompletedProcess:
    """`posttrain submit --address URL --list`, as a user would run it through the tunnel."""
    return subprocess.run([sys.executable, "-m", "posttrain", "submit", "--address", url, "--list"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def dashboard_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"} if token
                                     else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("network", [False, True], ids=["dashboard-on-loopback", "dashboard-on-network"])
def test_script_starts_ray_on_two_nodes_runs_the_command_and_stops_ray(tmp_path, network):
    """The rendered script, run by bash with stand-ins for srun/scontrol/hostname: both nodes join,
    the command runs on the cluster with RAY_ADDRESS and gives the script its exit status, the
    trap stops Ray on each node, and nothing is left running. `posttrain submit` reaches the
    dashboard (as through the tunnel); with --dashboard-on-network only with the job's token.
    Both with a ~/.ray/auth_token of an earlier ray.init, which alone turns a head's token
    authentication on."""
    pytest.importorskip("ray")
    ray_port, dashboard_port, closed_port, *others = free_ports(3 + 7 + 6)
    command = ("train", "my config.yaml", "trainer.experiment_name=a b")
    script = render_script(SlurmJob(nodes=2, gpus_per_node=0, ray_port=ray_port, dashboard_port=dashboard_port,
                                    wait_timeout=120, command=command, dashboard_on_network=network))
    (tmp_path / "job.sh").write_text(script)
    state = Path(tempfile.mkdtemp(prefix="ptsl-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    write_stubs(tmp_path / "bin", state, {"node1": others[:7], "node2": others[7:]})
    token = uuid.uuid4().hex
    marker = f"PTSL_MARKER={token}"  # in the environment of every process the script starts
    # Ray's dashboard asks cloud metadata servers (169.254.169.254) which cloud it runs on unless
    # ~/ray_bootstrap_config.yaml says, and reports "usage stats disabled" to usage-stats.ray.io:
    # a home of its own with that file, and a closed loopback port for the report.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / "ray_bootstrap_config.yaml").write_text("{}\n")
    (home / ".ray" / "auth_token").write_text("an-earlier-ray-init-wrote-this")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(PATH=f"{tmp_path / 'bin'}:{VENV_BIN}:{env['PATH']}", PTSL_STATE=str(state),
               REAL_RAY=str(VENV_BIN / "ray"), PTSL_PYTHON=sys.executable, WORKER_START=WORKER_START,
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="4242",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               PTSL_MARKER=token, HOME=str(home),
               RAY_USAGE_STATS_REPORT_URL=f"http://127.0.0.1:{closed_port}/")
    client = {k: v for k, v in env.items() if k != "PTSL_MARKER"}
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    token_file = tmp_path / ".posttrain-ray-token-4242"
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
        if network:
            secret = token_file.read_text()
            assert len(secret) == 64 and int(secret, 16) and token_file.stat().st_mode & 0o777 == 0o600
            assert dashboard_status(dashboard) == 401 and dashboard_status(dashboard, secret) == 200
            refused = submit_list(dashboard, client)
            assert refused.returncode == 2 and "requires token authentication" in refused.stderr, refused.stderr
            client.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
        else:
            assert not token_file.exists() and dashboard_status(dashboard) == 200
        listed = submit_list(dashboard, client)
        assert listed.returncode == 0, listed.stderr
        (state / "go").touch()
        assert job.wait(timeout=120) == 7, log.read_text()[-6000:]

        ran = json.loads(report.read_text())
        assert ran["alive"] == 2 and ran["argv"] == list(command)
        assert ran["ray_address"] == f"127.0.0.1:{ray_port}" and ran["where"] == f"Ray cluster at {ran['ray_address']}"
        assert (ran["auth"], ran["token"]) == (("token", 64) if network else ("disabled", 0))
        ray_log = (state / "ray.log").read_text().splitlines()
        assert any(ln.startswith(f"node1 start --head --node-ip-address=127.0.0.1 --port={ray_port} "
                                 "--dashboard-host=127.0.0.1") for ln in ray_log), ray_log
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
        text = log.read_text()
        assert "exit status 7" in text
        # the log says how to reach the dashboard; the token itself is on no command line and in no log
        if network:
            assert (f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_file} posttrain submit --address "
                    f"{dashboard} --list") in text
            assert not token_file.exists()  # removed on exit
            assert all(secret not in (state / f).read_text() for f in ("srun.log", "ray.log")) and secret not in text
        else:
            assert f"ssh -N -L 8265:127.0.0.1:{dashboard_port} node1 " in text
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        kill_all(marker)
        shutil.rmtree(state, ignore_errors=True)
