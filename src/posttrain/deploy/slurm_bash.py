"""The bash of `posttrain deploy slurm`'s script after its settings and steps: the helpers
(a node's address, waiting for the nodes, stopping Ray on exit) and the main part (Ray on
every node, then the command).

Where the Ray dashboard listens, which takes jobs and so runs code: by default on the head's
loopback only, and the log says how to reach it through an SSH tunnel; with
`--dashboard-on-network` (`network=True`) on the head's address (the one Ray announces, not
every interface), with Ray's token authentication on every node, and the log says where the
token is and how to submit with it.
"""

from __future__ import annotations

HELPERS = r'''# --- helpers ------------------------------------------------------------------
# The IPv4 address Ray announces for node $1: the first its host name resolves to that
# is not loopback (some systems map the host name to 127.0.1.1), else the first of its
# interfaces', else loopback (enough for a one-node job).
node_ip() {
  local ip
  ip=$(srun --nodes=1 --ntasks=1 --overlap -w "$1" \
      bash -c "hostname --ip-address; hostname --all-ip-addresses || true" \
    | tr ' ' '\n' | awk '
        /^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$/ { if (any == "") any = $0; if (ip == "" && !/^127\./) ip = $0 }
        END { print (ip != "" ? ip : any) }')
  if [[ -z $ip ]]; then
    echo "posttrain: error: no IPv4 address found for node $1 (hostname --ip-address)" >&2
    return 1
  fi
  echo "$ip"
}

# Run on the head (where Ray is installed): waits until argv[2] nodes are alive. It first
# waits for the head's port to open, since ray.init would retry a closed one for minutes.
wait_py=$(cat <<'EOF'
import socket, sys, time
address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
host, port = address.rsplit(":", 1)
deadline = time.monotonic() + timeout
while True:
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"posttrain: error: the Ray head {address} did not open its port within {timeout:g} s")
        time.sleep(2)
import ray
# this runs on the head, so the driver's own address is the head's
ray.init(address=address, _node_ip_address=host, logging_level="ERROR", log_to_driver=False)
while True:
    alive = sum(node["Alive"] for node in ray.nodes())
    if alive >= want:
        print(f"posttrain: {alive} of {want} Ray nodes up")
        break
    if time.monotonic() > deadline:
        sys.exit(f"posttrain: error: {alive} of {want} Ray nodes joined within {timeout:g} s; "
                 "the ray start output above says why")
    time.sleep(2)
EOF
)

# Waits until $1 Ray nodes have joined; stops at once if a Ray step has ended.
wait_for_nodes() {
  on_node "$head" python3 -c "$wait_py" "$ray_address" "$1" "$WAIT_TIMEOUT" &
  local waiter=$! i
  while kill -0 "$waiter" 2>/dev/null; do
    for i in "${!ray_steps[@]}"; do
      if ! kill -0 "${ray_steps[i]}" 2>/dev/null; then
        kill "$waiter" 2>/dev/null || true
        echo "posttrain: error: Ray on ${ray_nodes[i]} exited; its output is above" >&2
        return 1
      fi
    done
    sleep 2
  done
  wait "$waiter"
}
'''

CLEANUP = r'''
# On exit, also after an error or a signal: ray stop on every node that started Ray,
# then end the background Ray steps. The exit status stays the script's.
cleanup() {
  local status=$? node stops=()
  set +eu
  echo "posttrain: exit status $status" >&2
  if ((${#ray_nodes[@]})); then
    echo "posttrain: stopping Ray on ${ray_nodes[*]}" >&2
    for node in "${ray_nodes[@]}"; do
      on_node "$node" ray stop &
      stops+=("$!")
    done
    wait "${stops[@]}"
    kill "${ray_steps[@]}" 2>/dev/null
    wait "${ray_steps[@]}" 2>/dev/null
  fi
'''
FORGET_TOKEN = '''  rm -f "$TOKEN_FILE"  # the token ends with the cluster
'''
TRAPS = r'''}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
'''

NODES = r'''# --- the nodes: the first one is the Ray head ---------------------------------
mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?submit this script with sbatch}")
if ((${#nodes[@]} == 0)); then
  echo "posttrain: error: scontrol found no nodes in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" >&2
  exit 1
fi
head=${nodes[0]}
head_ip=$(node_ip "$head")
ray_address="$head_ip:$RAY_PORT"
echo "posttrain: ${#nodes[@]} node(s): ${nodes[*]}; the Ray head is $head ($ray_address)"
'''

TOKEN = r'''
# --- Ray's token authentication: a new token for this job -----------------------
# Every step has it in its environment (never on a command line); TOKEN_FILE holds a copy
# for `posttrain submit` and the browser, readable by you alone, removed when the job ends.
RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
export RAY_AUTH_TOKEN
rm -f "$TOKEN_FILE"
(umask 077 && printf '%s' "$RAY_AUTH_TOKEN" > "$TOKEN_FILE")
'''

LOOPBACK = r'''# The dashboard (port DASHBOARD_PORT) takes jobs, which run code: it listens on the head's
# loopback only. The log says how to reach it through an SSH tunnel; `posttrain deploy slurm
# --dashboard-on-network` renders a script that puts it on the head's address, with Ray's
# token authentication.'''

NETWORK = r'''# The dashboard (port DASHBOARD_PORT) takes jobs, which run code: it listens on the head's
# address, the one the other nodes use, for the login node (--dashboard-on-network); Ray's
# token authentication guards it and the job's other Ray ports.'''

RAY = r'''start_on "$head" ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" \
  --dashboard-host={host} --dashboard-port="$DASHBOARD_PORT" --disable-usage-stats \
  "${{ray_resources[@]}}" --block
wait_for_nodes 1
for node in "${{nodes[@]:1}}"; do
  node_addr=$(node_ip "$node")
  start_on "$node" ray start --address="$ray_address" --node-ip-address="$node_addr" \
    "${{ray_resources[@]}}" --block
done
wait_for_nodes "${{#nodes[@]}}"
'''

REACH_LOOPBACK = r'''# how to reach the dashboard
echo "posttrain: the Ray dashboard listens on $head's loopback only, port $DASHBOARD_PORT. From your machine:"
echo "posttrain:   ssh -N -L 8265:127.0.0.1:$DASHBOARD_PORT $head   (through the login node: add -J LOGIN_NODE)"
echo "posttrain:   then http://127.0.0.1:8265, or posttrain submit --address http://127.0.0.1:8265 --list"
'''

REACH_NETWORK = r'''# how to reach the dashboard
echo "posttrain: the Ray dashboard listens on http://$head_ip:$DASHBOARD_PORT, with Ray's token authentication;"
echo "posttrain:   the token is in $TOKEN_FILE (yours alone; removed when the job ends)."
echo "posttrain:   From the login node (a browser asks for the token):"
echo "posttrain:   RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$(printf %q "$TOKEN_FILE")" \
  "posttrain submit --address http://$head_ip:$DASHBOARD_PORT --list"
'''

COMMAND = r'''
# --- the posttrain command, on the head ---------------------------------------
# RAY_ADDRESS makes posttrain join this cluster instead of starting one of its own.
# The script's exit status is the command's (set -e ends the script when it fails).
on_node "$head" env RAY_ADDRESS="$ray_address" "${command[@]}"
'''


def helpers(network: bool) -> str:
    """node_ip, wait_for_nodes and cleanup (which also removes the token file with `network`)."""
    return HELPERS + CLEANUP + (FORGET_TOKEN if network else "") + TRAPS


def main_part(network: bool) -> str:
    """The nodes, (with `network`) the token, Ray on every node, how to reach the dashboard, the command."""
    ray = ["\n# --- Ray: the head, then a worker on each other node --------------------------",
           NETWORK if network else LOOPBACK, RAY.format(host='"$head_ip"' if network else "127.0.0.1")]
    return "".join([NODES, TOKEN if network else "", "\n".join(ray), REACH_NETWORK if network else REACH_LOOPBACK,
                    COMMAND])
