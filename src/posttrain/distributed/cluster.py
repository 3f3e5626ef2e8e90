"""Connecting to Ray: an existing cluster, or a local one started here.

`trainer.ray_address` (else `RAY_ADDRESS`, which `ray job submit` sets for
a job's driver) names a running cluster; with neither, a local cluster is
started for this run and stopped with it, listening on loopback only.
"""

from __future__ import annotations

import os
import sys

from posttrain.errors import ConfigError, PosttrainError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("running on several workers needs Ray: pip install 'posttrain[ray]' "
                          "(or set trainer.n_gpus_per_node=1 trainer.nnodes=1 to train in one process)") from e
    return ray


def host_of(address: str) -> str:
    """'ray://h:10001' / 'http://h:8265' / 'h:6379' -> 'h'."""
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else rest


def connect(address: str | None, num_cpus: int | None = None) -> str:
    """Connect this process (the driver) to Ray. -> a description for the log."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not address or host_of(address) in LOOPBACK:
        # One machine: every Ray address stays on loopback. Ray reads this at import
        # time; without it a "127.0.0.1" address is rewritten to the routable one.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = import_ray()
    if ray.is_initialized():
        return "the Ray cluster this process is connected to"
    if address and address.startswith(("http://", "https://")):
        raise ConfigError(f"trainer.ray_address={address} is a dashboard (Jobs API) address; the driver needs the "
                          "cluster address HEAD:6379 (or run the job with `posttrain submit --address "
                          f"{address} -- train ...`)")
    kwargs = dict(logging_level="WARNING", log_to_driver=True)
    if address:
        if host_of(address) in LOOPBACK:
            kwargs["_node_ip_address"] = "127.0.0.1"  # else Ray looks for a raylet on the routable address
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot connect to the Ray cluster at {address} ({str(e).splitlines()[0]}); check "
                              "that `ray start --head` runs there, or unset RAY_ADDRESS / trainer.ray_address "
                              "to start a local cluster") from e
        return f"Ray cluster at {address}"
    # A private cluster for this run ("local": never attach to another `ray start`
    # cluster of this machine), on loopback, without a dashboard.
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
    except Exception as e:  # Ray raises a bare Exception when its processes do not come up in time
        ray.shutdown()  # what did start is stopped, not left behind
        raise PosttrainError(
            f"could not start a local Ray cluster ({str(e).splitlines()[0]}); this happens when the machine is short "
            "of CPU or memory: retry when it is less busy, or train in one process (trainer.n_gpus_per_node=1)"
        ) from e
    print(f"posttrain: started a local Ray cluster ({num_cpus} CPUs)", file=sys.stderr)
    return "a local Ray cluster"


def describe_resources() -> str:
    ray = import_ray()
    res = ray.available_resources()
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()) if k in ("CPU", "GPU", "memory") or k == "node")
