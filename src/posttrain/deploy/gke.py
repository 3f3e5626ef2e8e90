"""What Google Kubernetes Engine asks of a GPU pod: machine sizes, node labels, Spot VMs,
GPUDirect RDMA and Cloud Storage FUSE. `posttrain deploy kuberay` builds its pods from these.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from posttrain.errors import ConfigError


@dataclass(frozen=True)
class Machine:
    """The GKE machine type with the most GPUs of one accelerator, and what a worker asks of it."""

    type: str
    gpus: int
    # A whole-machine worker's request: about 90% of the vCPUs and memory, leaving room for the
    # kubelet, GKE's system pods and the Cloud Storage FUSE sidecar.
    cpu: int
    memory_gi: int
    tuner: str | None = None  # the gIB NCCL plugin's tuner config; None: no GPUDirect RDMA on GKE
    max_gpus: int = 0  # GPUs on a larger machine of the same GPU (a2-megagpu-16g); 0: `gpus`


# Keyed by the cloud.google.com/gke-accelerator node label; vCPUs and memory from Compute
# Engine's accelerator-optimized machine family pages.
MACHINES = {
    "nvidia-h200-141gb": Machine("a3-ultragpu-8g", 8, 200, 2600, "tuner_config_a3u.txtpb"),  # 224 vCPU, 2952 GB
    "nvidia-b200": Machine("a4-highgpu-8g", 8, 200, 3500, "tuner_config_a4.txtpb"),  # 224 vCPU, 3968 GB
    "nvidia-h100-80gb": Machine("a3-highgpu-8g", 8, 186, 1650),  # 208 vCPU, 1872 GB; GPUDirect-TCPX
    "nvidia-h100-mega-80gb": Machine("a3-megagpu-8g", 8, 186, 1650),  # 208 vCPU, 1872 GB; GPUDirect-TCPXO
    "nvidia-a100-80gb": Machine("a2-ultragpu-8g", 8, 86, 1200),  # 96 vCPU, 1360 GB
    "nvidia-tesla-a100": Machine("a2-highgpu-8g", 8, 86, 600, max_gpus=16),  # 96 vCPU, 680 GB
    "nvidia-l4": Machine("g2-standard-96", 8, 80, 320),  # 96 vCPU, 384 GB
    "nvidia-gb200": Machine("a4x-highgpu-4g", 4, 126, 780),  # 140 vCPU, 884 GB (arm64)
}
DEFAULT_ACCELERATOR = "nvidia-h200-141gb"

# GPUDirect RDMA on A3 Ultra and A4, as GKE's tutorial "Fine-tune and scale reinforcement learning
# with verl on GKE" (page of 2026-04-13) sets it up: eth1 on the network `gvnic-1`, one NIC per GPU
# on `rdma-0`..`rdma-7`, the NVIDIA libraries and the gIB NCCL plugin from the host (put there by
# the nccl-rdma-installer DaemonSet), and the NCCL settings of the plugin's set_nccl_env.sh as
# explicit variables: KubeRay writes the container's `ray start` command, so there is no shell of
# ours to source the script in, and every Ray worker process inherits the container's environment.
RDMA_NICS = 8
RDMA_HOST_PATHS = [("nvidia", "/home/kubernetes/bin/nvidia", "/usr/local/nvidia"),
                   ("gib", "/home/kubernetes/bin/gib", "/usr/local/gib")]
RDMA_ENV = {
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    "NCCL_NET_PLUGIN": "/usr/local/gib/lib64/libnccl-net_internal.so",
    "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_P2P_NET_CHUNKSIZE": "131072",
    "NCCL_NVLS_CHUNKSIZE": "524288",
    "NCCL_IB_ADAPTIVE_ROUTING": "1",
    "NCCL_IB_QPS_PER_CONNECTION": "4",
    "NCCL_IB_TC": "52",
    "NCCL_IB_FIFO_TC": "84",
    "GLOO_SOCKET_IFNAME": "eth0",  # gloo would otherwise pick any of the ten interfaces
}

GCSFUSE_ANNOTATION = {"gke-gcsfuse/volumes": "true"}  # GKE then adds the Cloud Storage FUSE sidecar


def check_accelerator(value: str) -> Machine | None:
    """A known accelerator's machine; None for another plausible GKE value (nvidia-...)."""
    if value not in MACHINES and not re.fullmatch(r"nvidia-[a-z0-9]+(-[a-z0-9]+)*", value):
        raise ConfigError(f"--accelerator {value}: expected a GPU's GKE node label value "
                          f"(cloud.google.com/gke-accelerator), one of {', '.join(MACHINES)}")
    return MACHINES.get(value)


def check_rdma(accelerator: str, gpus: int) -> None:
    machine = MACHINES.get(accelerator)
    if not machine or not machine.tuner:
        rdma = " and ".join(a for a, m in MACHINES.items() if m.tuner)
        raise ConfigError(f"--gke-rdma with --accelerator {accelerator}: GKE has GPUDirect RDMA on {rdma} only; "
                          "drop --gke-rdma or pick one of them")
    if gpus != machine.gpus:  # a NIC attaches to one pod, and NCCL wants one per GPU: one pod takes them all
        raise ConfigError(f"--gke-rdma --gpus-per-worker {gpus}: an RDMA worker takes a whole {machine.type}; "
                          f"pass --gpus-per-worker {machine.gpus}")


def check_bucket(bucket: str, flag: str) -> str:
    """Cloud Storage's bucket naming rules: 3-63 characters (222 with dots, 63 between them) of a-z,
    0-9, '-', '_' and '.', a letter or digit at each end; not an IP address, no 'goog' prefix, no 'google'."""
    if not (re.fullmatch(r"[a-z0-9][a-z0-9._-]*[a-z0-9]", bucket) and 3 <= len(bucket) <= (222 if "." in bucket else 63)
            and all(1 <= len(p) <= 63 for p in bucket.split(".")) and not re.fullmatch(r"[\d.]+", bucket)
            and not bucket.startswith("goog") and "google" not in bucket):
        raise ConfigError(f"{flag}: '{bucket}' is not a Cloud Storage bucket name: 3-63 characters of a-z, 0-9, "
                          "'-', '_' or '.', a letter or digit at each end (the bucket alone, e.g. gcsfuse:my-bucket)")
    return bucket


def gcsfuse_source(bucket: str) -> dict:
    """A CSI ephemeral volume of the bucket: no PersistentVolume to create first."""
    # implicit-dirs: the folders `gcloud storage cp -r` makes (prefixes, not objects) show as
    # directories. uid/gid: files owned by the image's user (ray, 1000:100, docker/Dockerfile.gpu),
    # who could not write to the mount otherwise; an image that runs as root writes either way.
    return {"csi": {"driver": "gcsfuse.csi.storage.gke.io",
                    "volumeAttributes": {"bucketName": bucket, "mountOptions": "implicit-dirs,uid=1000,gid=100"}}}


def gpu_scheduling(accelerator: str, spot: bool) -> dict:
    """nodeSelector and tolerations that put a pod on a GPU node (a Spot VM with `spot`)."""
    selector = {"cloud.google.com/gke-accelerator": accelerator}
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if spot:
        selector["cloud.google.com/gke-spot"] = "true"
        tolerations.append({"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                            "effect": "NoSchedule"})
    return {"nodeSelector": selector, "tolerations": tolerations}


def rdma_annotations() -> dict:
    """The pod's network interfaces: eth0 as usual, eth1 on gVNIC, eth2.. one per GPU on RDMA."""
    nics = [("eth0", "default"), ("eth1", "gvnic-1")] + [(f"eth{i + 2}", f"rdma-{i}") for i in range(RDMA_NICS)]
    listed = ",\n".join(json.dumps({"interfaceName": i, "network": n}, separators=(",", ":")) for i, n in nics)
    return {"networking.gke.io/default-interface": "eth0", "networking.gke.io/interfaces": f"[\n{listed}\n]\n"}


def rdma_env(accelerator: str) -> dict[str, str]:
    return {**RDMA_ENV, "NCCL_TUNER_CONFIG_PATH": f"/usr/local/gib/configs/{MACHINES[accelerator].tuner}"}
