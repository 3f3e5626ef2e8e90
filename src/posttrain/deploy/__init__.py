"""`posttrain deploy TARGET`: render what runs posttrain on a cluster.

    posttrain deploy kuberay [flags] [--job -- train ...]   # a RayCluster (or RayJob) manifest, YAML
    posttrain deploy slurm [flags] [-- train ...]           # an sbatch script that starts Ray and trains

Both write to stdout, or to `--output FILE`. Nothing is applied or submitted:
the output is for the user to read, keep and run (`kubectl apply -f`, `sbatch`).
"""

from __future__ import annotations


def register(subparsers) -> None:
    """Add `kuberay` and `slurm` to `posttrain deploy`'s sub-commands."""
    from posttrain.deploy import kuberay, slurm

    kuberay.register(subparsers)
    slurm.register(subparsers)
