"""`posttrain deploy kuberay`'s flags, checked: the Layout a manifest is made of.

Every error names the flag and a value that works; nothing here writes YAML (kuberay.py does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from posttrain.deploy import gke
from posttrain.deploy.command import check_command, parse_env
from posttrain.errors import ConfigError

RAY_VERSION = "2.60.0"  # spec.rayVersion by default: the Ray that docker/Dockerfile.gpu and .cpu pin (a test ties them)
TOKEN_AUTH_RAY = (2, 52, 0)  # the first Ray with token authentication (KubeRay refuses authOptions below it)
# KubeRay v1.7.0 (utils/constant.go) refuses longer names: its longest Service suffix is
# "-serve-svc" (63 - 10 = 53), and a RayJob's cluster is named after it plus 6 characters.
MAX_CLUSTER_NAME, MAX_JOB_NAME = 53, 47

_QUANTITY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")
_MEMORY_UNITS = {"Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E"}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class Storage:
    kind: str  # gcsfuse | pvc
    source: str  # the bucket or the claim


@dataclass
class Layout:
    """Every value the manifest is made of, checked (the flags' defaults are in kuberay.register())."""

    name: str
    namespace: str
    image: str
    image_pull_policy: str | None
    ray_version: str
    workers: int
    gpus: int  # per GPU pod
    accelerator: str
    worker_cpu: int | str
    worker_memory: str
    head_cpu: int | str
    head_memory: str
    head_on_gpu: bool
    spot: bool
    storage: Storage | None
    mount_path: str
    hf_secret: tuple[str, str] | None  # (Secret, key)
    shm_size: str
    service_account: str | None
    env: dict[str, str]
    rdma: bool
    job: bool
    ttl: int
    # the dashboard on the pod network with Ray's token authentication: --dashboard-on-network, and every
    # RayJob (KubeRay's submitter and operator reach the dashboard through the head Service)
    dashboard_on_network: bool
    command: list[str]  # after `posttrain`, with --job


# --- checks: each error names the flag and a value that works ----------------------------------

def need(ok, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_k8s_name(value: str, flag: str, what: str, label: bool = False) -> str:
    pattern, limit = (_DNS_LABEL, 63) if label else (_DNS_SUBDOMAIN, 253)
    need(pattern.fullmatch(value) and len(value) <= limit,
         f"{flag}: '{value}' is not a Kubernetes {what} name: lowercase letters, digits and '-'"
         f"{'' if label else ' or .'}, starting and ending with a letter or digit")
    return value


def check_quantity(value: str, flag: str, memory: bool) -> int | str:
    m = _QUANTITY.fullmatch(value.strip())
    unit = m.group(2) if m else None
    need(m and float(m.group(1)) > 0 and (unit in _MEMORY_UNITS if memory else unit in (None, "m")),
         f"{flag} {value}: expected " + ("a memory quantity with its unit, e.g. 1800Gi" if memory
                                        else "CPU cores, e.g. 200 or 500m"))
    return int(m.group(1)) if unit is None and m.group(1).isdigit() else value.strip()


def parse_storage(value: str) -> Storage | None:
    kind, sep, source = value.partition(":")
    if value == "none":
        return None
    if kind == "gcsfuse" and sep:
        return Storage("gcsfuse", gke.check_bucket(source.removeprefix("gs://").rstrip("/"), f"--storage {value}"))
    if kind == "pvc" and sep:
        return Storage("pvc", check_k8s_name(source, f"--storage {value}", "PersistentVolumeClaim"))
    raise ConfigError(f"--storage {value}: expected gcsfuse:BUCKET, pvc:CLAIM or none")


def parse_secret(value: str) -> tuple[str, str]:
    name, _, key = value.partition(":")
    check_k8s_name(name, f"--hf-token-secret {value}", "Secret")
    need(re.fullmatch(r"[-._a-zA-Z0-9]*", key), f"--hf-token-secret {value}: '{key}' is not a Secret key; "
                                                "use NAME or NAME:KEY, e.g. hf-secret:hf_api_token")
    return name, key or "hf_api_token"


def layout(args) -> Layout:
    """The parsed flags, checked, and completed with the defaults that depend on other flags."""
    machine = gke.check_accelerator(args.accelerator)
    gpus = args.gpus_per_worker or (machine.gpus if machine else 8)
    most = (machine.max_gpus or machine.gpus) if machine else 16
    need(1 <= gpus <= most, f"--gpus-per-worker {gpus}: pass 1 to {most}" +
         (f" (a GKE node has at most {most} {args.accelerator} GPUs)" if machine else ""))
    need(args.workers >= 1, f"--workers {args.workers}: a cluster needs at least 1 GPU worker; pass --workers 1")
    need(args.ttl >= 0, f"--ttl {args.ttl}: seconds to keep a finished job's cluster; pass 0 or more")
    if args.gke_rdma:
        gke.check_rdma(args.accelerator, gpus)
    worker_cpu, worker_memory = worker_size(args, machine, gpus)
    need(not (args.job_command and not args.job), "a command after -- runs as a RayJob: add --job (or render "
                                                  "the cluster alone and `posttrain submit` the command to it)")
    env = parse_env(args.env)
    hf_secret = args.hf_token_secret and parse_secret(args.hf_token_secret)
    need(not (hf_secret and "HF_TOKEN" in env), "--env HF_TOKEN and --hf-token-secret both set HF_TOKEN; keep one")
    kind, limit = ("RayJob", MAX_JOB_NAME) if args.job else ("RayCluster", MAX_CLUSTER_NAME)
    need(len(args.name) <= limit and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", args.name),
         f"--name {args.name}: a {kind} name is at most {limit} characters of a-z, 0-9 and '-', starting with a "
         "letter and ending with a letter or digit (KubeRay appends suffixes to it), e.g. --name grpo-qwen")
    need(args.image.strip() and not any(c.isspace() for c in args.image),
         f"--image {args.image!r}: expected an image reference, e.g. REGION-docker.pkg.dev/PROJECT/REPO/posttrain:gpu")
    ray_version = args.ray_version or RAY_VERSION
    need(re.fullmatch(r"\d+\.\d+\.\d+\S*", ray_version),
         f"--ray-version {ray_version}: expected the image's Ray version, e.g. {RAY_VERSION}")
    on_network = args.dashboard_on_network or args.job
    need(not on_network or tuple(map(int, re.findall(r"\d+", ray_version)[:3])) >= TOKEN_AUTH_RAY,
         f"--ray-version {ray_version}: {'--job' if args.job else '--dashboard-on-network'} turns on Ray's token "
         f"authentication, which needs Ray 2.52.0 or newer; use an image with a newer Ray (docker/Dockerfile.gpu "
         f"installs {RAY_VERSION}) and its --ray-version")
    head = args.head_on_gpu_node
    return Layout(
        name=args.name, namespace=check_k8s_name(args.namespace, f"--namespace {args.namespace}", "namespace", True),
        image=args.image, image_pull_policy=args.image_pull_policy, ray_version=ray_version,
        workers=args.workers, gpus=gpus, accelerator=args.accelerator, worker_cpu=worker_cpu,
        worker_memory=worker_memory, head_on_gpu=head, spot=args.spot,
        head_cpu=check_quantity(args.head_cpu or (str(worker_cpu) if head else "8"), "--head-cpu", memory=False),
        head_memory=check_quantity(args.head_memory or (worker_memory if head else "32Gi"), "--head-memory", True),
        storage=parse_storage(args.storage), mount_path=check_mount_path(args.mount_path), hf_secret=hf_secret or None,
        shm_size=check_quantity(args.shm_size, "--shm-size", memory=True), env=env, rdma=args.gke_rdma,
        service_account=args.service_account and check_k8s_name(
            args.service_account, f"--service-account {args.service_account}", "ServiceAccount"),
        job=args.job, ttl=args.ttl, dashboard_on_network=on_network,
        command=job_command(args.job_command, (args.workers + head, gpus)) if args.job else [])


def job_command(words: list[str], cluster: tuple[int, int]) -> list[str]:
    need(words, "--job runs a posttrain command: put it after --, e.g. "
                "posttrain deploy kuberay --job -- train data.train_files=/data/gsm8k/train.parquet")
    return check_command(words, cluster, "--workers and --gpus-per-worker")


def worker_size(args, machine: gke.Machine | None, gpus: int) -> tuple[int | str, str]:
    """--worker-cpu and --worker-memory, by default the machine's share for `gpus` GPUs."""
    need(machine or (args.worker_cpu and args.worker_memory),
         f"--accelerator {args.accelerator} is not one posttrain knows the machine of; pass --worker-cpu and "
         "--worker-memory (e.g. 90 and 600Gi) to size the workers")
    share = min(gpus, machine.gpus) / machine.gpus if machine else 1
    cpu = args.worker_cpu or str(int(machine.cpu * share))
    memory = args.worker_memory or f"{int(machine.memory_gi * share)}Gi"
    return check_quantity(cpu, "--worker-cpu", False), check_quantity(memory, "--worker-memory", True)


def check_mount_path(path: str) -> str:
    need(path.startswith("/") and path.rstrip("/") not in ("", "/dev/shm", "/tmp", "/usr/local/nvidia",
                                                           "/usr/local/gib"),
         f"--mount-path {path}: expected an absolute path of its own, e.g. /data")
    return path.rstrip("/")
