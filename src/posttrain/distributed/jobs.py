"""`posttrain submit`: run a posttrain command as a job on a Ray cluster.

The job goes through the head's Jobs API (the dashboard, http://HEAD:8265),
so the submitting machine needs only network access to that port, not to
the cluster's internal ports. The job's exit status becomes ours, so
`posttrain submit ... -- train ...` fits in a script like `posttrain train`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import sys
import threading
import time
from pathlib import Path

from posttrain.errors import ConfigError, PosttrainError
from posttrain.text.redact import redact_mapping, redact_text, secret_values

# `--stop` sends SIGTERM; posttrain then finishes its step and saves a checkpoint.
# Ray's default grace period (3 s) would SIGKILL it mid-step, so the job gets a longer one.
STOP_GRACE_S = "120"


def resolve_address(address: str | None) -> str:
    """--address, else an http(s) $RAY_ADDRESS -> 'http://HOST:PORT'. A bare RAY_ADDRESS
    (HEAD:6379) names the cluster's own port, which the Jobs API does not serve."""
    env = os.environ.get("RAY_ADDRESS", "")
    address = (address or (env if env.startswith(("http://", "https://")) else "")).strip()
    if not address:
        raise ConfigError("no Ray cluster given: pass --address http://HEAD:8265 (the head's dashboard) "
                          "or set RAY_ADDRESS=http://HEAD:8265")
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise ConfigError(f"--address {address}: jobs are submitted to the head's dashboard, http://HEAD:8265")
    return address.rstrip("/")


def build_runtime_env(path: str | None, working_dir: str | None, env: list[str]) -> dict:
    """The job's runtime_env: the --runtime-env file, then --working-dir and --env on top
    (the command line wins, so one file can serve runs that differ in a variable)."""
    runtime_env: dict = {}
    if path:
        import yaml  # reads JSON as well

        try:
            runtime_env = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--runtime-env {path}: cannot read it ({str(e).splitlines()[0]})") from e
        if not isinstance(runtime_env, dict):
            raise ConfigError(f"--runtime-env {path}: expected a mapping (working_dir: ..., env_vars: ...)")
    if working_dir:
        if not Path(working_dir).is_dir():
            raise ConfigError(f"--working-dir {working_dir}: no such directory")
        runtime_env["working_dir"] = str(Path(working_dir).resolve())
    env_vars = {str(k): str(v) for k, v in (runtime_env.get("env_vars") or {}).items()}  # Ray wants strings
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--env {item}: expected KEY=VALUE")
        env_vars[key.strip()] = value
    env_vars.setdefault("RAY_JOB_STOP_WAIT_TIME_S", STOP_GRACE_S)
    runtime_env["env_vars"] = env_vars
    return runtime_env


def describe_runtime_env(runtime_env: dict) -> list[str]:
    """One line per runtime_env field, as submitted but for credentials: the values of
    credential-named env_vars (HF_TOKEN, ...) and URL passwords show as `***`, and so does any
    secret value of this machine's environment or of env_vars that turns up in another field.

    >>> describe_runtime_env({"working_dir": "/w", "env_vars": {"HF_TOKEN": "hf_abc123", "N": "1"}})
    ['working_dir "/w"', 'env_vars {"HF_TOKEN": "***", "N": "1"}']
    """
    shown = redact_mapping(runtime_env, job_secrets(runtime_env))
    return [f"{key} {json.dumps(value, default=str)}" for key, value in shown.items()]


def job_secrets(runtime_env: dict) -> list[str]:
    """The secret values of the job's env_vars and of this machine's environment, longest first."""
    values = set(secret_values(runtime_env.get("env_vars") or {})) | set(secret_values())
    return sorted(values, key=lambda v: (-len(v), v))


def entrypoint(command: list[str]) -> str:
    """`posttrain ARGS...`, quoted for the shell the job runs it in."""
    if command and command[0] == "posttrain":
        command = command[1:]
    if not command:
        raise ConfigError("nothing to run: put the posttrain command after --, "
                          "e.g. posttrain submit --address http://HEAD:8265 -- train config.yaml")
    return shlex.join(["posttrain", *command])


def connect(address: str):
    """A Jobs API client; an unreachable head is an error the user can fix, not a traceback."""
    try:
        import ray.exceptions
        from ray.job_submission import JobSubmissionClient
    except ImportError as e:
        raise ConfigError("submitting jobs needs Ray: pip install 'posttrain[ray]'") from e
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # its INFO lines are noise here
    try:
        return JobSubmissionClient(address)
    except (OSError, RuntimeError, ray.exceptions.RayError) as e:
        if isinstance(e, getattr(ray.exceptions, "AuthenticationError", ())):  # Ray sends its token to a named
            # address only when told to (`ray start` and `ray.init()` pick ~/.ray/auth_token up by themselves)
            raise ConfigError(f"the Ray cluster at {address} requires token authentication: set "
                              "RAY_AUTH_MODE=token (the token comes from $RAY_AUTH_TOKEN, the file "
                              "$RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token)") from e
        if "ray[default]" in str(e):
            raise ConfigError("submitting jobs needs Ray's job client: pip install 'posttrain[ray]'") from e
        why = "" if isinstance(e, ConnectionError) else f" ({str(e).splitlines()[0]})"  # it repeats the address
        raise ConfigError(f"cannot reach the Ray Jobs API at {address}{why}; check the address and the dashboard "
                          "port (8265). The dashboard listens on the head's loopback by default: reach it "
                          "through a tunnel (`ssh -N -L 8265:127.0.0.1:8265 HEAD`, or `kubectl port-forward "
                          "svc/CLUSTER-head-svc 8265`) and pass --address http://127.0.0.1:8265") from e


def job_info(client, address: str, job_id: str):
    """get_job_info, with an unknown id said plainly (Ray answers a 404 as a RuntimeError)."""
    try:
        return client.get_job_info(job_id)
    except RuntimeError as e:
        if "404" in str(e) or "does not exist" in str(e):
            raise PosttrainError(f"no job '{job_id}' on {address}; `posttrain submit --list` lists them") from e
        raise


def describe(job_id: str, info) -> str:
    """'job ID STATUS (message)', the message cut to its first line: a failed job's message
    repeats the log tail, which was just shown."""
    message = (info.message or "").strip().splitlines()
    message = message[0].partition(", last available logs")[0].rstrip(":") if message else ""
    return f"job {job_id} {info.status}" + (f" ({redact_text(message)})" if message else "")


def exit_status(info) -> int:
    """The job's outcome as our exit status: 0, the driver's exit code, or 130 when stopped."""
    status = str(info.status)
    if status == "SUCCEEDED":
        return 0
    if status == "STOPPED":
        return 130
    code = info.driver_exit_code
    return 128 - code if code and code < 0 else (code or 1)  # killed by signal N -> 128+N, as a shell says


def wait_until_done(client, address: str, job_id: str, timeout: float | None = None):
    """Poll until the job is terminal (the log stream can close a moment before the status turns)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        info = job_info(client, address, job_id)
        if info.status.is_terminal() or (deadline is not None and time.monotonic() > deadline):
            return info
        time.sleep(0.5)


def follow(client, address: str, job_id: str) -> int:
    """Stream the job's logs until it ends; Ctrl-C stops following, not the job."""
    async def pump():
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(redact_text(chunk))  # best effort: a secret cut across two chunks passes
            sys.stdout.flush()

    broken: list[BaseException] = []

    def stream():
        try:
            asyncio.run(pump())
        except Exception as e:  # the stream broke (a websocket or network error); the job may still run
            broken.append(e)

    # The stream runs in a daemon thread so that Ctrl-C, which the main thread
    # receives, returns at once instead of waiting for the websocket to close.
    reader = threading.Thread(target=stream, name="posttrain-job-logs", daemon=True)
    try:
        reader.start()
        while reader.is_alive():
            reader.join(0.2)
        if broken:
            print(f"posttrain: lost the log stream ({broken[0]!r}); waiting for the job to end", file=sys.stderr)
        info = wait_until_done(client, address, job_id)
    except KeyboardInterrupt:
        again = shlex.join(["posttrain", "submit", "--address", address])
        print(redact_text(f"\nposttrain: stopped following job {job_id}; it keeps running on the cluster\n"
                          f"posttrain:   follow it again: {again} --logs {job_id} --follow\n"
                          f"posttrain:   stop it:         {again} --stop {job_id}"), file=sys.stderr)
        return 130
    print(f"posttrain: {describe(job_id, info)}", file=sys.stderr)
    return exit_status(info)


def submit(address: str, command: list[str], runtime_env: dict, wait: bool = True) -> int:
    """Submit `posttrain COMMAND` and, unless told not to wait, follow it to its end."""
    line = entrypoint(command)
    client = connect(address)
    # what the job gets, for the record: the real values go to the cluster, the log shows `***`
    secrets, shown_address = job_secrets(runtime_env), redact_text(address)
    print(f"posttrain: submitting `{redact_text(line, secrets)}` to {shown_address}", file=sys.stderr)
    for field in describe_runtime_env(runtime_env):
        print(f"posttrain:   runtime_env {field}", file=sys.stderr)
    try:
        job_id = client.submit_job(entrypoint=line, runtime_env=runtime_env)
    except (RuntimeError, ValueError, TypeError) as e:  # refused by the server or by runtime_env checks
        why = redact_text(str(e).splitlines()[0] if str(e) else type(e).__name__, secrets)  # it may quote env_vars
        raise ConfigError(f"the cluster at {shown_address} refused the job: {why}") from e
    print(f"posttrain: submitted job {job_id} to {shown_address}", file=sys.stderr)
    if not wait:
        print(job_id)  # on stdout alone, for ID=$(posttrain submit --no-wait ...)
        return 0
    return follow(client, address, job_id)


def show_status(address: str, job_id: str) -> int:
    """The line a finished `submit` prints, for a job followed elsewhere or not at all."""
    print(describe(job_id, job_info(connect(address), address, job_id)))
    return 0


def show_logs(address: str, job_id: str, follow_logs: bool = False) -> int:
    """The logs so far; with follow, stream to the end and exit with the job's status."""
    client = connect(address)
    job_info(client, address, job_id)  # an unknown id fails here, not inside the websocket
    if follow_logs:
        return follow(client, address, job_id)
    sys.stdout.write(redact_text(client.get_job_logs(job_id)))
    return 0


def stop(address: str, job_id: str) -> int:
    """Ask the job to stop and wait until it has (posttrain checkpoints on SIGTERM first)."""
    client = connect(address)
    info = job_info(client, address, job_id)
    if not info.status.is_terminal():
        client.stop_job(job_id)
        info = wait_until_done(client, address, job_id, timeout=float(STOP_GRACE_S) + 30)
        if not info.status.is_terminal():
            raise PosttrainError(f"job {job_id} did not stop within {STOP_GRACE_S} s; see its logs")
    print(describe(job_id, info))
    return 0


def list_jobs(address: str) -> int:
    """Every job the cluster knows, oldest first: id, status, entrypoint."""
    jobs = sorted(connect(address).list_jobs(), key=lambda j: j.start_time or 0)
    for j in jobs:
        print(redact_text(f"{j.submission_id or j.job_id}  {j.status}  {j.entrypoint}"))
    return 0
