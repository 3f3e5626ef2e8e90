"""Runs inside each vLLM worker process (`worker_extension_cls`): the methods
that `VLLMRolloutEngine.load_weights` calls there through `collective_rpc`.

A weight update is vLLM's layerwise reload: `begin` puts every layer back in
checkpoint form, each bucket is loaded under its Hugging Face names, and a
layer whose weights have all arrived is processed into the kernels' layout
(vLLM's CPU build repacks the linear layers' weights, so loading straight into
the processed parameters fails); `finish` processes what is left.
"""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's worker class (GPU or CPU); `self.model_runner` is vLLM's."""

    def begin_posttrain_weights(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def load_posttrain_weights(self, blob: bytes) -> None:
        """blob: a bucket of weights as safetensors bytes (rollout.vllm.pack_bucket), under their HF names;
        vLLM's model maps them onto its own (fused, tensor-parallel-sharded) parameters."""
        from safetensors.torch import load

        self.model_runner.get_model().load_weights(weights=list(load(blob).items()))

    def finish_posttrain_weights(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
