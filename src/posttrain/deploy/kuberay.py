"""`posttrain deploy kuberay`: a KubeRay RayCluster, or with --job a RayJob, that runs posttrain.

    posttrain deploy kuberay -o cluster.yaml                  # a cluster to `posttrain submit` runs to
    posttrain deploy kuberay --job -o job.yaml -- train data.train_files=/data/gsm8k/train.parquet ...

With no flags it renders GKE's two-node H200 layout: a CPU-only head pod and a worker group
of 2 replicas x 8 GPUs. The output is for the user to read, keep and `kubectl apply`:
every choice a flag makes shows in it, and nothing is sent to a cluster from here.
"""

from __future__ import annotations

import functools
import re
import shlex
import sys
from dataclasses import dataclass

import yaml

from posttrain.deploy import gke
from posttrain.deploy.command import check_command, parse_env, write_output
from posttrain.errors import ConfigError

RAY_VERSION = "2.60.0"  # spec.rayVersion by default: the Ray that docker/Dockerfile.gpu and .cpu pin (a test ties them)
DEFAULT_IMAGE = "posttrain:gpu"  # the tag docker/Dockerfile.gpu is built as
# KubeRay v1.7.0 (utils/constant.go) refuses longer names: its longest Service suffix is
# "-serve-svc" (63 - 10 = 53), and a RayJob's cluster is named after it plus 6 characters.
MAX_CLUSTER_NAME, MAX_JOB_NAME = 53, 47
HEAD_PORTS = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
              {"containerPort": 10001, "name": "client"}]
WORKER_GROUP = "gpu-workers"

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
    """Every value the manifest is made of, checked (the flags' defaults are in register())."""

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
        job=args.job, ttl=args.ttl,
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


# --- the manifest ------------------------------------------------------------------------------

def manifest(lay: Layout) -> dict:
    """A RayJob (with --job) or a RayCluster, as a plain dict."""
    meta = {"name": lay.name, "namespace": lay.namespace}
    if not lay.job:
        return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": raycluster_spec(lay)}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": {
        "entrypoint": shlex.join(["posttrain", *lay.command]),
        "submissionMode": "K8sJobMode",  # a Kubernetes Job submits it and follows its logs
        "shutdownAfterJobFinishes": True,  # the GPUs go back when the run ends
        "ttlSecondsAfterFinished": lay.ttl,  # ... after this long, to read the cluster's logs
        "rayClusterSpec": raycluster_spec(lay)}}


def raycluster_spec(lay: Layout) -> dict:
    head_params = {"dashboard-host": "0.0.0.0"}  # reachable through the head Service, not only its loopback
    if not lay.head_on_gpu:
        # The driver and the dashboard live on the head: with no CPUs or GPUs to offer, Ray places
        # no task or actor there, so the CPU node need not be sized for training work.
        head_params.update({"num-cpus": "0", "num-gpus": "0"})
    return {
        "rayVersion": lay.ray_version,
        "headGroupSpec": {"rayStartParams": head_params, "template": pod_template(lay, "head", lay.head_on_gpu)},
        "workerGroupSpecs": [{
            "groupName": WORKER_GROUP, "replicas": lay.workers, "minReplicas": lay.workers,
            "maxReplicas": lay.workers,
            "rayStartParams": {},  # KubeRay passes the container's CPU, memory and GPU limits to `ray start`
            "template": pod_template(lay, "worker", True)}],
    }


def pod_template(lay: Layout, role: str, gpu: bool) -> dict:
    annotations = {**(gke.GCSFUSE_ANNOTATION if lay.storage and lay.storage.kind == "gcsfuse" else {}),
                   **(gke.rdma_annotations() if gpu and lay.rdma else {})}
    spec: dict = {"serviceAccountName": lay.service_account} if lay.service_account else {}
    if gpu:
        spec.update(gke.gpu_scheduling(lay.accelerator, spot=lay.spot and role == "worker"))
    pairs = volumes(lay, gpu)
    spec["containers"] = [container(lay, role, gpu, [mount for _, mount in pairs])]
    spec["volumes"] = [volume for volume, _ in pairs]
    return {"metadata": {"annotations": annotations}, "spec": spec} if annotations else {"spec": spec}


def container(lay: Layout, role: str, gpu: bool, mounts: list[dict]) -> dict:
    cpu, memory = (lay.worker_cpu, lay.worker_memory) if role == "worker" else (lay.head_cpu, lay.head_memory)
    c: dict = {"name": f"ray-{role}", "image": lay.image}
    if lay.image_pull_policy:
        c["imagePullPolicy"] = lay.image_pull_policy
    if role == "head":
        c["ports"] = HEAD_PORTS  # KubeRay's head Service exposes these
    env = container_env(lay, gpu)
    if env:
        c["env"] = env
    # requests == limits: the scheduler reserves all the container may use; nothing is overcommitted
    c["resources"] = {"requests": {"cpu": cpu, "memory": memory},
                      "limits": {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": lay.gpus} if gpu else {})}}
    c["volumeMounts"] = mounts
    return c


def container_env(lay: Layout, gpu: bool) -> list[dict]:
    env = {k: {"name": k, "value": v} for k, v in (gke.rdma_env(lay.accelerator) if gpu and lay.rdma else {}).items()}
    if lay.hf_secret:
        name, key = lay.hf_secret
        env["HF_TOKEN"] = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
    env.update({k: {"name": k, "value": v} for k, v in lay.env.items()})  # --env wins over the above
    return list(env.values())


def volumes(lay: Layout, gpu: bool) -> list[tuple[dict, dict]]:
    """(volume, its mount in the ray container) pairs."""
    # Ray's object store (30% of memory, at most 200 GB) and NCCL's and vLLM's intra-node buffers
    # live in /dev/shm, 64 MB in a container by default. What is written there counts as memory.
    # On the CPU head, where the object store is small, the memory limit is bound enough.
    shm = {"medium": "Memory", "sizeLimit": lay.shm_size if gpu else lay.head_memory}
    pairs = [({"name": "shm", "emptyDir": shm}, {"name": "shm", "mountPath": "/dev/shm"})]
    if lay.storage:
        source = gke.gcsfuse_source(lay.storage.source) if lay.storage.kind == "gcsfuse" else \
            {"persistentVolumeClaim": {"claimName": lay.storage.source}}
        pairs.append(({"name": "data", **source}, {"name": "data", "mountPath": lay.mount_path}))
    if gpu and lay.rdma:
        pairs += [({"name": name, "hostPath": {"path": host}}, {"name": name, "mountPath": path, "readOnly": True})
                  for name, host, path in gke.RDMA_HOST_PATHS]
    return pairs


# --- output ------------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the interfaces annotation) as readable `|` blocks, and no `&id001`
    anchors where one object is used twice."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def to_yaml(obj: dict, header: list[str] = ()) -> str:
    body = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    return "".join(f"# {line}\n" for line in header) + body


def header(lay: Layout, command: str) -> list[str]:
    from posttrain import __version__

    lines = [f"Rendered by posttrain {__version__}: {command}"]
    ns = f" -n {lay.namespace}" if lay.namespace != "default" else ""
    if lay.job:
        return lines + [f"Run: kubectl apply -f FILE; kubectl logs{ns} -f job/{lay.name}  (the job's output)"]
    return lines + ["Start: kubectl apply -f FILE", f"Use:   kubectl port-forward{ns} svc/{lay.name}-head-svc 8265 &",
                    "       posttrain submit --address http://127.0.0.1:8265 -- train CONFIG.yaml key=value ..."]


def command_line(args, parser, env: dict[str, str]) -> str:
    """The flags given (those that differ from their defaults), as the command that renders this again;
    the values of `env` (the parsed --env) that are credentials show as ***."""
    from posttrain.text.redact import redact_text, secret_values

    words = ["posttrain", "deploy", "kuberay"]
    for action in parser._actions:  # argparse has no public list of a parser's options
        flag = next((s for s in action.option_strings if s.startswith("--")), None)
        value = getattr(args, action.dest, None)
        if flag in (None, "--help", "--output") or value is None or value is False or value in ([], action.default):
            continue
        if value is True:
            words.append(flag)
        else:  # --env A=1 --env B=2 for a list
            words += [w for v in (value if isinstance(value, list) else [value]) for w in (flag, str(v))]
    if args.job_command:
        words += ["--", *args.job_command]
    secrets = secret_values(env)  # the manifest holds them; its comment need not
    return shlex.join(redact_text(word, secrets) for word in words)


def notes(lay: Layout) -> list[str]:
    from posttrain.text.redact import is_secret_name

    found = []
    first = lay.image.split("/")[0]
    if "/" not in lay.image or not ("." in first or ":" in first or first == "localhost"):
        found.append(f"--image {lay.image} names no registry: the cluster's nodes must be able to pull it; push it "
                     "to one (e.g. REGION-docker.pkg.dev/PROJECT/REPO/posttrain:gpu) and pass --image")
    found += [f"--env {k}: its value is written into the manifest in plain text; keep credentials in a "
              "Kubernetes Secret (--hf-token-secret for HF_TOKEN)" for k in lay.env if is_secret_name(k)]
    if lay.job and lay.command[0] == "train" and not any(a.endswith((".yaml", ".yml")) or
                                                         a.startswith(("trainer.nnodes=", "trainer.n_gpus_per_node="))
                                                         for a in lay.command[1:]):
        nodes = lay.workers + lay.head_on_gpu
        found.append(f"-- train sets no trainer.nnodes or trainer.n_gpus_per_node, so it trains on 1 GPU; add "
                     f"trainer.nnodes={nodes} trainer.n_gpus_per_node={lay.gpus} to use the whole cluster")
    return found


def cmd_kuberay(args, parser) -> int:
    lay = layout(args)
    text = to_yaml(manifest(lay), header(lay, command_line(args, parser, lay.env)))
    for note in notes(lay):
        print(f"posttrain: note: {note}", file=sys.stderr)
    write_output(text, args.output, f"wrote {'RayJob' if lay.job else 'RayCluster'} {lay.name} to {args.output}")
    return 0


def register(subparsers) -> None:
    """Add `kuberay` to `posttrain deploy`'s sub-commands."""
    p = subparsers.add_parser(
        "kuberay", help="a KubeRay RayCluster (or with --job a RayJob) manifest for GKE GPU nodes",
        description="Render a KubeRay ray.io/v1 RayCluster, or with --job a RayJob that runs the posttrain "
                    "command after --, as YAML. Defaults: a CPU head and 2 workers x 8 H200 GPUs on GKE.")
    arg = p.add_argument
    arg("job_command", nargs="*", metavar="-- COMMAND",
        help="with --job: the posttrain command the job runs, e.g. -- train CONFIG.yaml key=value")
    arg("--job", action="store_true", help="a RayJob: a cluster that runs the command and shuts down")
    arg("--ttl", type=int, default=3600, metavar="SECONDS",
        help="with --job: how long a finished job's cluster is kept (default 3600)")
    arg("--name", default="posttrain", help="the RayCluster or RayJob name (default posttrain)")
    arg("--namespace", default="default", help="Kubernetes namespace (default default)")
    arg("--image", default=DEFAULT_IMAGE, help=f"the posttrain image, from a registry the nodes can pull from "
                                               f"(default {DEFAULT_IMAGE}, docker/Dockerfile.gpu's tag)")
    arg("--image-pull-policy", choices=["Always", "IfNotPresent", "Never"])
    arg("--ray-version", metavar="X.Y.Z", help=f"spec.rayVersion: the image's Ray (default {RAY_VERSION}, "
                                               "the Ray docker/Dockerfile.gpu installs)")
    arg("--workers", type=int, default=2, metavar="N", help="GPU worker pods, one per node (default 2)")
    arg("--gpus-per-worker", type=int, metavar="N", help="GPUs per worker pod (default: the machine's, 8; "
                                                         "4 for nvidia-gb200)")
    arg("--accelerator", default=gke.DEFAULT_ACCELERATOR, metavar="LABEL",
        help=f"the GPU, as GKE's node label cloud.google.com/gke-accelerator names it (default "
             f"{gke.DEFAULT_ACCELERATOR}); known: {', '.join(gke.MACHINES)}")
    arg("--worker-cpu", metavar="CORES", help="CPU per worker (default: ~90%% of the machine's, by GPU share: "
                                              "200 for 8 H200)")
    arg("--worker-memory", metavar="QUANTITY", help="memory per worker (default: ~90%% of the machine's, by GPU "
                                                    "share: 2600Gi for 8 H200)")
    arg("--head-cpu", metavar="CORES", help="head CPU (default 8, for a node of more than 8 vCPUs; the worker's "
                                            "with --head-on-gpu-node)")
    arg("--head-memory", metavar="QUANTITY", help="head memory (default 32Gi; the worker's with --head-on-gpu-node)")
    arg("--head-on-gpu-node", action="store_true",
        help="run the head on a GPU node that also works (default: a CPU node that only coordinates)")
    arg("--spot", action="store_true", help="workers on GKE Spot VMs (the head stays on-demand)")
    arg("--storage", default="none", metavar="gcsfuse:BUCKET|pvc:CLAIM|none",
        help="shared storage on every pod at --mount-path: a Cloud Storage bucket through GKE's FUSE CSI driver, "
             "or a PersistentVolumeClaim (Lustre, Filestore, NFS) (default none)")
    arg("--mount-path", default="/data", metavar="PATH", help="where --storage is mounted (default /data)")
    arg("--service-account", metavar="NAME", help="the pods' Kubernetes ServiceAccount (for gcsfuse: one that "
                                                  "Workload Identity lets use the bucket)")
    arg("--hf-token-secret", metavar="NAME[:KEY]",
        help="HF_TOKEN from this Secret (KEY default hf_api_token, as in kubectl create secret generic hf-secret "
             "--from-literal=hf_api_token=$HF_TOKEN)")
    arg("--env", action="append", default=[], metavar="KEY=VALUE",
        help="an environment variable on every Ray container (repeatable)")
    arg("--shm-size", default="250Gi", metavar="QUANTITY",
        help="/dev/shm of GPU pods, where Ray's object store and NCCL keep buffers (default 250Gi)")
    arg("--gke-rdma", action="store_true",
        help="GPUDirect RDMA on A3 Ultra (H200) and A4 (B200): GKE's multi-network annotations (networks "
             "gvnic-1, rdma-0..rdma-7), the gIB NCCL plugin and its NCCL settings")
    arg("-o", "--output", metavar="FILE", help="write the YAML here (default: stdout)")
    p.set_defaults(func=functools.partial(cmd_kuberay, parser=p))
