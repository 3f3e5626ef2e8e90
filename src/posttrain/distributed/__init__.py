"""Running on a Ray cluster: the cluster connection, worker groups, job submission."""
