"""`posttrain deploy kuberay`: the manifests it renders pass KubeRay v1.7.0's CRD schemas (made
strict, so that a misspelled field fails) and Kubernetes v1.33's PodTemplateSpec schema, offline;
their content is what the flags say; wrong flag values end in one line naming the flag and the fix."""

import copy
import json
import shlex
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import yaml

from posttrain.cli import build_parser, main
from posttrain.deploy import kuberay

SCHEMAS = Path(__file__).parent / "schemas"
TRAIN = ["train", "data.train_files=/data/gsm8k/train.parquet", "trainer.experiment_name=my run",
         "trainer.nnodes=2", "trainer.n_gpus_per_node=8"]


# --- validators ----------------------------------------------------------------------------------

def strict(schema):
    """An OpenAPI schema of a CRD as the API server reads it, but refusing unknown keys: an object
    schema that lists `properties` gets additionalProperties: false unless it keeps unknown fields."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: strict(s) for name, s in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def load_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 2 MB of YAML


@pytest.fixture(scope="module")
def validators():
    """{kind: validator} for RayCluster and RayJob, and "Pod" for a pod template."""
    found = {}
    for kind, name in (("RayCluster", "ray.io_rayclusters.yaml"), ("RayJob", "ray.io_rayjobs.yaml")):
        crd = load_yaml(SCHEMAS / "kuberay-v1.7.0" / name)
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        found[kind] = jsonschema.Draft7Validator(strict(v1["schema"]["openAPIV3Schema"]))
    pod = json.loads((SCHEMAS / "kubernetes-v1.33" / "podtemplatespec-v1-strict.json").read_text())
    found["Pod"] = jsonschema.Draft202012Validator(pod)
    return found


def problems(validator, obj) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def cluster_spec(obj: dict) -> dict:
    return obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]


def templates(obj: dict) -> list[dict]:
    spec = cluster_spec(obj)
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


def containers(obj: dict) -> list[dict]:
    return [c for t in templates(obj) for c in t["spec"]["containers"]]


def assert_valid(validators, obj: dict) -> None:
    assert problems(validators[obj["kind"]], obj) == []
    for template in templates(obj):
        assert problems(validators["Pod"], template) == []


def render(*flags: str) -> dict:
    """The manifest for `posttrain deploy kuberay FLAGS`, through its YAML text."""
    args = build_parser().parse_args(["deploy", "kuberay", *flags])
    obj = kuberay.manifest(kuberay.layout(args))
    text = kuberay.to_yaml(obj, ["a comment"])
    assert yaml.safe_load(text) == obj
    return yaml.safe_load(text)


COMBINATIONS = [
    [],
    ["--job", "--", *TRAIN],
    ["--spot", "--storage", "gcsfuse:my-bucket", "--service-account", "ksa", "--hf-token-secret", "hf-secret"],
    ["--storage", "pvc:lustre-pvc", "--mount-path", "/mnt/lustre", "--head-on-gpu-node"],
    ["--gke-rdma", "--accelerator", "nvidia-b200", "--workers", "4"],
    ["--env", "A=1", "--env", "B=two", "--gpus-per-worker", "4", "--accelerator", "nvidia-h100-80gb",
     "--worker-cpu", "100", "--worker-memory", "900Gi"],
    ["--job", "--ttl", "0", "--name", "grpo-qwen", "--namespace", "rl", "--image", "us-docker.pkg.dev/p/r/posttrain:1",
     "--image-pull-policy", "Always", "--storage", "gcsfuse:my-bucket", "--gke-rdma", "--head-on-gpu-node",
     "--spot", "--", "posttrain", "eval", "--model", "/data/m", "--data", "/data/test.parquet"],
    ["--accelerator", "nvidia-l4", "--gpus-per-worker", "1", "--workers", "1", "--shm-size", "16Gi"],
    ["--dashboard-on-network", "--namespace", "rl"],
]


# --- the validator bites -------------------------------------------------------------------------

def test_validators_refuse_a_misspelled_field_and_a_wrong_type(validators):
    good = render()
    assert_valid(validators, good)

    misspelled = copy.deepcopy(good)
    group = misspelled["spec"]["workerGroupSpecs"][0]
    group["rayStartParam"] = group.pop("rayStartParams")
    assert any("'rayStartParam' was unexpected" in p for p in problems(validators["RayCluster"], misspelled))

    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "2"
    assert any("replicas" in p and "'integer'" in p for p in problems(validators["RayCluster"], wrong_type))

    pod = copy.deepcopy(templates(good)[1])
    pod["spec"]["containers"][0]["imagee"] = pod["spec"]["containers"][0].pop("image")
    assert any("'imagee' was unexpected" in p for p in problems(validators["Pod"], pod))
    pod = copy.deepcopy(templates(good)[1])
    pod["spec"]["tolerations"][0]["operator"] = ["Exists"]
    assert problems(validators["Pod"], pod)
    # the CRD holds a pod schema of its own; it too refuses unknown pod fields once strict
    job = render("--job", "--", "train")
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["nodeSelectr"] = {}
    assert any("'nodeSelectr' was unexpected" in p for p in problems(validators["RayJob"], job))


@pytest.mark.parametrize("flags", COMBINATIONS, ids=lambda f: " ".join(f)[:60] or "defaults")
def test_rendered_manifests_are_valid(validators, flags):
    assert_valid(validators, render(*flags))


# --- content -------------------------------------------------------------------------------------

def test_defaults_are_a_cpu_head_and_two_8_gpu_h200_workers():
    obj = render()
    assert obj["apiVersion"] == "ray.io/v1" and obj["kind"] == "RayCluster"
    assert obj["metadata"] == {"name": "posttrain", "namespace": "default"}
    spec = obj["spec"]
    assert spec["rayVersion"] == version("ray")
    head = spec["headGroupSpec"]
    assert head["rayStartParams"] == {"dashboard-host": "127.0.0.1", "num-cpus": "0", "num-gpus": "0"}
    head_pod = head["template"]["spec"]
    assert "nodeSelector" not in head_pod and "tolerations" not in head_pod
    [ray_head] = head_pod["containers"]
    assert ray_head["image"] == "posttrain:gpu"
    assert ray_head["resources"] == {"requests": {"cpu": 8, "memory": "32Gi"}, "limits": {"cpu": 8, "memory": "32Gi"}}
    assert [p["containerPort"] for p in ray_head["ports"]] == [6379, 8265, 10001]

    [group] = spec["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == \
        ("gpu-workers", 2, 2, 2)
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    [worker] = pod["containers"]
    assert worker["resources"] == {"requests": {"cpu": 200, "memory": "2600Gi"},
                                   "limits": {"cpu": 200, "memory": "2600Gi", "nvidia.com/gpu": 8}}
    assert pod["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "250Gi"}}]
    assert worker["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]
    assert "env" not in worker and "metadata" not in group["template"]


def test_job_runs_the_command_on_the_same_cluster():
    job = render("--job", "--", *TRAIN)
    assert job["kind"] == "RayJob"
    assert job["spec"]["entrypoint"] == ("posttrain train data.train_files=/data/gsm8k/train.parquet "
                                         "'trainer.experiment_name=my run' trainer.nnodes=2 trainer.n_gpus_per_node=8")
    assert {k: v for k, v in job["spec"].items() if k not in ("entrypoint", "rayClusterSpec")} == {
        "submissionMode": "K8sJobMode", "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 3600}
    # the cluster of --dashboard-on-network: KubeRay's submitter and operator reach the dashboard
    # through the head Service, so it listens on the pod network, with token authentication
    assert job["spec"]["rayClusterSpec"] == render("--dashboard-on-network")["spec"]
    assert job["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    # a leading `posttrain` is the same command
    assert render("--job", "--ttl", "60", "--", "posttrain", *TRAIN)["spec"]["entrypoint"] == job["spec"]["entrypoint"]


def test_the_dashboard_stays_in_the_head_pod_unless_asked(capsys):
    """The dashboard takes jobs: on the head pod's loopback by default (kubectl port-forward reaches
    it); on the pod network only with --dashboard-on-network or --job, and then with Ray's token
    authentication. The head Service is ClusterIP either way; nothing reaches outside the cluster."""
    _, out, _ = run(capsys)
    obj = yaml.safe_load(out)
    head = obj["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1" and head["serviceType"] == "ClusterIP"
    assert "authOptions" not in obj["spec"] and "enableIngress" not in head and "0.0.0.0" not in out
    assert "kubectl port-forward svc/posttrain-head-svc 8265 &" in out
    assert "listens on the head pod's loopback only" in out and "Token:" not in out

    _, out, _ = run(capsys, "--dashboard-on-network", "--namespace", "rl")
    obj = yaml.safe_load(out)
    head = obj["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0" and head["serviceType"] == "ClusterIP"
    assert obj["spec"]["authOptions"] == {"mode": "token"} and "enableIngress" not in head
    assert ("# Token: export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(kubectl get secret -n rl posttrain "
            "-o jsonpath='{.data.auth_token}' | base64 -d)\n") in out
    assert "kubectl port-forward -n rl svc/posttrain-head-svc 8265 &" in out
    assert "http://posttrain-head-svc.rl.svc:8265" in out
    assert kuberay.auth_secret("p" * 3 + "0" + "x" * 49) == "r" + "x" * 49  # KubeRay keeps the last 50 characters

    _, out, _ = run(capsys, "--job", "--", "train")
    spec = yaml.safe_load(out)["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "token"} and spec["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert "with Ray's token authentication" in out and "-o jsonpath='{.status.rayClusterName}'" in out
    for text in (out, run(capsys)[1], run(capsys, "--dashboard-on-network")[1]):
        assert not any(word in text for word in ("LoadBalancer", "NodePort", "Ingress", "enableIngress"))
    assert render("--dashboard-on-network", "--ray-version", "2.52.0")["spec"]["rayVersion"] == "2.52.0"


def test_gcsfuse_spot_service_account_and_hf_token_on_every_pod():
    obj = render("--spot", "--storage", "gcsfuse:my-bucket", "--service-account", "ksa",
                 "--hf-token-secret", "hf-secret")
    for template in templates(obj):
        assert template["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
        assert template["spec"]["serviceAccountName"] == "ksa"
        bucket = {"bucketName": "my-bucket", "mountOptions": "implicit-dirs,uid=1000,gid=100"}
        assert {"name": "data", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": bucket}} in \
            template["spec"]["volumes"]
    for c in containers(obj):
        assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
        assert c["env"] == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-secret",
                                                                                  "key": "hf_api_token"}}}]
    head, worker = (t["spec"] for t in templates(obj))
    assert "nodeSelector" not in head  # the head stays on an on-demand CPU node
    assert worker["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb",
                                      "cloud.google.com/gke-spot": "true"}
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in worker["tolerations"]
    other = render("--hf-token-secret", "tok:key", "--storage", "gcsfuse:gs://my-bucket/")
    [worker] = other["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert worker["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "tok", "key": "key"}
    assert other["spec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"][1]["csi"]["volumeAttributes"][
        "bucketName"] == "my-bucket"


def test_pvc_and_a_head_on_a_gpu_node():
    obj = render("--storage", "pvc:lustre-pvc", "--mount-path", "/mnt/lustre", "--head-on-gpu-node")
    head = obj["spec"]["headGroupSpec"]
    assert head["rayStartParams"] == {"dashboard-host": "127.0.0.1"}  # it takes part in the work
    for template in templates(obj):
        spec = template["spec"]
        assert "metadata" not in template  # no gcsfuse annotation
        assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "lustre-pvc"}} in spec["volumes"]
        assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "250Gi"}} in spec["volumes"]
    for c in containers(obj):
        assert {"name": "data", "mountPath": "/mnt/lustre"} in c["volumeMounts"]
        assert c["resources"]["limits"] == {"cpu": 200, "memory": "2600Gi", "nvidia.com/gpu": 8}


def test_gke_rdma_on_b200_workers():
    obj = render("--gke-rdma", "--accelerator", "nvidia-b200", "--workers", "4")
    head, worker = templates(obj)
    assert "metadata" not in head  # a CPU node has no RDMA NICs
    assert obj["spec"]["workerGroupSpecs"][0]["replicas"] == 4
    notes = worker["metadata"]["annotations"]
    assert notes["networking.gke.io/default-interface"] == "eth0"
    nics = json.loads(notes["networking.gke.io/interfaces"])
    assert nics[:3] == [{"interfaceName": "eth0", "network": "default"},
                        {"interfaceName": "eth1", "network": "gvnic-1"},
                        {"interfaceName": "eth2", "network": "rdma-0"}]
    assert len(nics) == 10 and nics[-1] == {"interfaceName": "eth9", "network": "rdma-7"}
    [c] = worker["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_TUNER_CONFIG_PATH"] == "/usr/local/gib/configs/tuner_config_a4.txtpb"
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64" and env["NCCL_NET_GDR_LEVEL"] == "PIX"
    assert {"name": "gib", "hostPath": {"path": "/home/kubernetes/bin/gib"}} in worker["spec"]["volumes"]
    assert {"name": "gib", "mountPath": "/usr/local/gib", "readOnly": True} in c["volumeMounts"]
    assert c["resources"]["limits"] == {"cpu": 200, "memory": "3500Gi", "nvidia.com/gpu": 8}
    h200 = render("--gke-rdma")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "NCCL_TUNER_CONFIG_PATH", "value": "/usr/local/gib/configs/tuner_config_a3u.txtpb"} in h200


def test_env_gpus_and_worker_size():
    obj = render("--env", "A=1", "--env", "B=two", "--gpus-per-worker", "4", "--accelerator", "nvidia-h100-80gb",
                 "--worker-cpu", "100", "--worker-memory", "900Gi")
    for c in containers(obj):
        assert c["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "two"}]
    [worker] = obj["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"] == {"cpu": 100, "memory": "900Gi", "nvidia.com/gpu": 4}
    assert obj["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    # --env wins over the rendered NCCL settings
    env = render("--gke-rdma", "--env", "NCCL_IB_TC=41")["spec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "NCCL_IB_TC"] == ["41"]


@pytest.mark.parametrize("flags, cpu, memory, gpus", [
    (["--gpus-per-worker", "4"], 100, "1300Gi", 4),  # half an a3-ultragpu-8g
    (["--accelerator", "nvidia-l4", "--gpus-per-worker", "1"], 10, "40Gi", 1),  # fits a g2-standard-12
    (["--accelerator", "nvidia-gb200"], 126, "780Gi", 4),  # a4x-highgpu-4g has 4
    (["--accelerator", "nvidia-tesla-a100", "--gpus-per-worker", "16"], 86, "600Gi", 16),
    (["--accelerator", "nvidia-rtx-pro-6000", "--worker-cpu", "40", "--worker-memory", "300Gi"], 40, "300Gi", 8),
    (["--worker-cpu", "500m", "--worker-memory", "1.5Ti"], "500m", "1.5Ti", 8),
])
def test_worker_size_defaults_follow_the_machine(flags, cpu, memory, gpus):
    [worker] = render(*flags)["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"] == {"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus}


# --- the command line ----------------------------------------------------------------------------

def run(capsys, *flags):
    code = main(["deploy", "kuberay", *flags])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flags, expected", [
    (["--storage", "s3:bucket"], "--storage s3:bucket: expected gcsfuse:BUCKET, pvc:CLAIM or none"),
    (["--storage", "gcsfuse:My_Bucket"], "--storage gcsfuse:My_Bucket: 'My_Bucket' is not a Cloud Storage bucket name"),
    (["--storage", "gcsfuse:google-data"], "e.g. gcsfuse:my-bucket"),
    (["--storage", "gcsfuse:ab"], "3-63 characters"),
    (["--storage", "pvc:Lustre"], "--storage pvc:Lustre: 'Lustre' is not a Kubernetes PersistentVolumeClaim name"),
    (["--name", "Posttrain"], "--name Posttrain: a RayCluster name is at most 53 characters"),
    (["--name", "a" * 54], "at most 53 characters"),
    (["--job", "--name", "a" * 48, "--", "train"], "a RayJob name is at most 47 characters"),
    (["--namespace", "RL"], "--namespace RL: 'RL' is not a Kubernetes namespace name"),
    (["--worker-memory", "900"], "--worker-memory 900: expected a memory quantity with its unit, e.g. 1800Gi"),
    (["--worker-cpu", "lots"], "--worker-cpu lots: expected CPU cores, e.g. 200 or 500m"),
    (["--head-memory", "32GB"], "--head-memory 32GB: expected a memory quantity"),
    (["--shm-size", "0Gi"], "--shm-size 0Gi: expected a memory quantity"),
    (["--env", "NOVALUE"], "--env NOVALUE: expected KEY=VALUE"),
    (["--env", "1A=x"], "--env 1A=x: expected KEY=VALUE with KEY an environment variable name"),
    (["--hf-token-secret", "hf-secret", "--env", "HF_TOKEN=x"], "both set HF_TOKEN"),
    (["--hf-token-secret", "hf secret"], "--hf-token-secret hf secret: 'hf secret' is not a Kubernetes Secret name"),
    (["--gke-rdma", "--accelerator", "nvidia-l4"],
     "--gke-rdma with --accelerator nvidia-l4: GKE has GPUDirect RDMA on nvidia-h200-141gb and nvidia-b200 only"),
    (["--gke-rdma", "--gpus-per-worker", "4"], "pass --gpus-per-worker 8"),
    (["--accelerator", "h200"], "--accelerator h200: expected a GPU's GKE node label value"),
    (["--accelerator", "nvidia-tesla-t4"], "pass --worker-cpu and --worker-memory"),
    (["--gpus-per-worker", "9"], "--gpus-per-worker 9: pass 1 to 8"),
    (["--workers", "0"], "--workers 0: a cluster needs at least 1 GPU worker"),
    (["--ttl", "-1"], "--ttl -1: seconds to keep"),
    (["--mount-path", "data", "--storage", "pvc:x"], "--mount-path data: expected an absolute path"),
    (["--ray-version", "latest"], "--ray-version latest: expected the image's Ray version"),
    (["--dashboard-on-network", "--ray-version", "2.51.9"],
     "--ray-version 2.51.9: --dashboard-on-network turns on Ray's token authentication, which needs Ray 2.52.0"),
    (["--job", "--ray-version", "2.40.0", "--", "train"], "--ray-version 2.40.0: --job turns on Ray's token"),
    (["--", "train"], "a command after -- runs as a RayJob: add --job"),
    (["--job"], "--job runs a posttrain command: put it after --"),
    (["--job", "--", "trian"], "invalid choice: 'trian'"),
    (["--job", "--", "deploy", "kuberay"], "the command after -- is `posttrain deploy`, which does no work on the cluster"),
    (["--job", "--", "submit"], "the command after -- is `posttrain submit`, which does no work on the cluster"),
    (["--job", "--", "eval", "--data", "x.parquet"], "the following arguments are required: --model"),
    (["--job", "--", "train", "--help"], "it would only print help and exit"),
    (["--job", "--", "train", "data.trian_files=/data/x.parquet"], "unknown config key 'data.trian_files'"),
    (["--job", "--", "train", "trainer.nnodes=3", "trainer.n_gpus_per_node=8"],
     "trainer.nnodes=3 trainer.n_gpus_per_node=8 needs more than the 2 nodes x 8 GPUs rendered; change --workers"),
])
def test_wrong_values_are_one_clear_line(capsys, flags, expected):
    code, out, err = run(capsys, *flags)
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("posttrain: error:")]
    assert len(errors) == 1 and expected in errors[0], err


def test_misspelled_key_names_the_nearest(capsys):
    _, _, err = run(capsys, "--job", "--", "train", "data.trian_files=/data/x.parquet")
    assert "did you mean 'data.train_files'?" in err


def test_output_file_and_its_header(capsys, tmp_path):
    path = tmp_path / "job.yaml"
    flags = ["--job", "--spot", "--env", "WANDB_API_KEY=supersecret123", "--env", "X=1", "--", *TRAIN]
    code, out, err = run(capsys, "-o", str(path), *flags)
    assert code == 0 and out == ""
    assert f"wrote RayJob posttrain to {path}" in err
    text = path.read_text()
    obj = yaml.safe_load(text)
    assert obj == render(*flags)
    first = text.splitlines()[0]
    assert first.startswith("# Rendered by posttrain ") and "supersecret123" not in first
    assert "--env 'WANDB_API_KEY=***'" in first  # the value is in the manifest, not in its comment
    assert "posttrain: note: --env WANDB_API_KEY: its value is written into the manifest in plain text" in err
    # the comment's command renders the same manifest
    again = shlex.split(first.split(": ", 1)[1].replace("***", "supersecret123"))
    assert again[:3] == ["posttrain", "deploy", "kuberay"] and render(*again[3:]) == obj


def test_stdout_notes_and_readable_yaml(capsys):
    code, out, err = run(capsys, "--gke-rdma", "--image", "us-docker.pkg.dev/p/r/posttrain:gpu")
    assert code == 0 and "names no registry" not in err
    assert out.startswith("# Rendered by posttrain") and "kubectl port-forward svc/posttrain-head-svc 8265" in out
    assert "networking.gke.io/interfaces: |\n" in out  # one interface a line, as GKE's tutorials write it
    assert yaml.safe_load(out)["kind"] == "RayCluster"

    _, out, err = run(capsys)
    assert "posttrain: note: --image posttrain:gpu names no registry" in err
    _, _, err = run(capsys, "--job", "--", "train", "data.train_files=/data/x.parquet")
    assert "trainer.nnodes=2 trainer.n_gpus_per_node=8 to use the whole cluster" in err


def test_help_lists_the_known_accelerators(capsys):
    with pytest.raises(SystemExit):
        main(["deploy", "kuberay", "--help"])
    out = capsys.readouterr().out
    assert "nvidia-h200-141gb" in out and "nvidia-gb200" in out and "--gke-rdma" in out
