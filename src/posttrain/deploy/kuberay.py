"""`posttrain deploy kuberay`: a KubeRay RayCluster, or with --job a RayJob, that runs posttrain.

    posttrain deploy kuberay -o cluster.yaml                  # a cluster to `posttrain submit` runs to
    posttrain deploy kuberay --job -o job.yaml -- train data.train_files=/data/gsm8k/train.parquet ...

With no flags it renders GKE's two-node H200 layout: a CPU-only head pod and a worker group
of 2 replicas x 8 GPUs. The output is for the user to read, keep and `kubectl apply`:
every choice a flag makes shows in it, and nothing is sent to a cluster from here.

The dashboard, which takes jobs, listens on the head pod's loopback, where `kubectl
port-forward` reaches it; with --dashboard-on-network, and in every RayJob (whose submitter
and operator reach it through the head Service), on the pod network with Ray's token
authentication (KubeRay's authOptions: it makes the token's Secret and gives it to every pod).
The head Service is ClusterIP, inside the cluster only; no Ingress or load balancer is rendered.
"""

from __future__ import annotations

import functools
import shlex
import sys

import yaml

from posttrain.deploy import gke
from posttrain.deploy.command import write_output
from posttrain.deploy.kuberay_layout import RAY_VERSION, Layout, layout

DEFAULT_IMAGE = "posttrain:gpu"  # the tag docker/Dockerfile.gpu is built as
HEAD_PORTS = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
              {"containerPort": 10001, "name": "client"}]
WORKER_GROUP = "gpu-workers"


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
    # KubeRay's own default is 0.0.0.0; the pod's loopback is enough for kubectl port-forward
    head_params = {"dashboard-host": "0.0.0.0" if lay.dashboard_on_network else "127.0.0.1"}
    if not lay.head_on_gpu:
        # The driver and the dashboard live on the head: with no CPUs or GPUs to offer, Ray places
        # no task or actor there, so the CPU node need not be sized for training work.
        head_params.update({"num-cpus": "0", "num-gpus": "0"})
    auth = {"authOptions": {"mode": "token"}} if lay.dashboard_on_network else {}
    return {
        "rayVersion": lay.ray_version, **auth,
        "headGroupSpec": {"serviceType": "ClusterIP",  # the head Service: inside the cluster only
                          "rayStartParams": head_params, "template": pod_template(lay, "head", lay.head_on_gpu)},
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
        return lines + [f"Run: kubectl apply -f FILE; kubectl logs{ns} -f job/{lay.name}  (the job's output)",
                        "The dashboard (it takes jobs) listens on the head pod's network for KubeRay's submitter, "
                        "with Ray's token authentication;",
                        f"its token is in the Secret named after the cluster: kubectl get rayjob{ns} {lay.name} "
                        "-o jsonpath='{.status.rayClusterName}'"]
    use = [f"Use:   kubectl port-forward{ns} svc/{lay.name}-head-svc 8265 &",
           "       posttrain submit --address http://127.0.0.1:8265 -- train CONFIG.yaml key=value ..."]
    if not lay.dashboard_on_network:
        return lines + ["Start: kubectl apply -f FILE", *use,
                        "The dashboard (it takes jobs) listens on the head pod's loopback only, where the port-forward "
                        "reaches it; --dashboard-on-network",
                        "puts it on the pod network (the head Service, inside the cluster) with Ray's token "
                        "authentication."]
    secret = auth_secret(lay.name)
    return lines + ["Start: kubectl apply -f FILE",
                    f"Token: export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(kubectl get secret{ns} {secret} "
                    "-o jsonpath='{.data.auth_token}' | base64 -d)", *use,
                    f"The dashboard (it takes jobs) listens on the pod network, for pods of the cluster at "
                    f"http://{lay.name}-head-svc.{lay.namespace}.svc:8265,",
                    f"with Ray's token authentication (KubeRay keeps the token in the Secret {secret}; a browser "
                    "asks for it)."]


def auth_secret(cluster: str) -> str:
    """The Secret KubeRay keeps a RayCluster's token in: named after the cluster as KubeRay v1.7's
    utils.CheckName shortens it (to its last 50 characters; a leading digit becomes r)."""
    name = cluster[-50:]
    return "r" + name[1:] if not name[0].isalpha() else name


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
    arg("--job", action="store_true", help="a RayJob: a cluster that runs the command and shuts down (its "
                                           "dashboard is on the pod network, with token authentication)")
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
    arg("--dashboard-on-network", action="store_true",
        help="put the Ray dashboard, which takes jobs, on the pod network (the head Service, inside the cluster) "
             "with Ray's token authentication (default: the head pod's loopback; reach it with kubectl port-forward)")
    arg("-o", "--output", metavar="FILE", help="write the YAML here (default: stdout)")
    p.set_defaults(func=functools.partial(cmd_kuberay, parser=p))
