"""Runs inside each vLLM worker process (`worker_extension_cls`): the method
that `VLLMRolloutEngine.load_weights` calls there through `collective_rpc`."""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's GPU worker class; `self.model_runner` is vLLM's."""

    def load_posttrain_weights(self, weights: list) -> None:
        """weights: [(HF name, CPU tensor)]; vLLM's model maps the names onto its
        own (fused, tensor-parallel-sharded) parameters and copies to the GPU."""
        self.model_runner.model.load_weights(weights=weights)
