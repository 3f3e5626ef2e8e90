"""The worker: the verbs of one device, what it is built from, its rollout engine."""
