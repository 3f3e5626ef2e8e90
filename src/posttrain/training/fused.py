"""Log-probs and entropy straight from the last hidden states (verl's
`model.use_fused_kernels`): the LM head is applied a chunk of tokens at a
time, so a pass never holds the [N, R, V] logits (N rows, R response tokens,
V vocabulary: 2 GiB in float32 for 8 x 4096 tokens of a 150k vocabulary).
With gradients each chunk is checkpointed: its logits are recomputed in the
backward pass instead of kept, so the backward holds one chunk's too.

    with stats_head(model, targets, temperature=1.0):   # targets [N, R]
        out = model(input_ids=..., logits_to_keep=R).logits   # [N, R, 2]
    log_prob, entropy = out[..., 0], out[..., 1]

The results equal those from the full logits (`logprobs.token_log_probs`,
`losses.entropy_from_logits`) to float rounding; the model's own forward
runs unchanged, only its output layer is stood in for during the pass.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from posttrain.errors import ConfigError

CHUNK_ELEMENTS = 1 << 26  # logits per chunk (256 MiB in float32): 440 tokens of a 152k vocabulary


def chunk_stats(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, tp=None):
    """hidden [T, H], targets [T] -> (log p(target) [T], entropy [T]) of
    softmax(head(hidden) / temperature), in float32. With `tp` (training/tensor_parallel.py) the head gives this
    rank's columns of the vocabulary, and both come from every rank's."""
    logits = head(hidden).float()  # [T, V] ([T, V/tp] with tp)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if tp is not None:
        from posttrain.training.tensor_parallel import vocab_parallel_stats

        return vocab_parallel_stats(logits, targets, tp)
    log_z = torch.logsumexp(logits, dim=-1)  # [T]
    log_prob = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # as losses.entropy_from_logits
    return log_prob, entropy


class StatsHead(torch.nn.Module):
    """Stands in for a causal LM's output layer during one pass: instead of
    logits [B, T, V] it returns [N, T, 2], the log-prob of `targets` [N, T]
    and the entropy at each position. `rows` [N] (optional) picks the row of
    the hidden states each target row reads (a prompt's KV run once for its
    samples: forward._shared_prompt_forward). `tp`: the head is split over a TP group (training/tensor_parallel.py),
    each rank's chunk of logits its columns of the vocabulary."""

    def __init__(self, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                 rows: torch.Tensor | None = None, chunk_elements: int | None = None, tp=None):
        super().__init__()
        self.head, self.targets, self.temperature, self.rows, self.tp = head, targets, temperature, rows, tp
        vocab = tp.width if tp is not None else getattr(head, "out_features", None) or head.weight.shape[0]
        self.chunk = max(1, (chunk_elements or CHUNK_ELEMENTS) // vocab)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [N, T, 2]
        if self.rows is not None:
            hidden = hidden[self.rows]
        n, t, _ = hidden.shape
        flat, targets = hidden.reshape(n * t, -1), self.targets.reshape(n * t)
        pieces = []
        for start in range(0, n * t, self.chunk):
            h, y = flat[start:start + self.chunk], targets[start:start + self.chunk]
            if torch.is_grad_enabled() and h.requires_grad:  # keep the chunk's input, not its logits
                pieces.append(torch.stack(checkpoint(chunk_stats, self.head, h, y, self.temperature,
                                                     self.tp, use_reentrant=False), -1))
            else:
                pieces.append(torch.stack(chunk_stats(self.head, h, y, self.temperature, self.tp), -1))
        return torch.cat(pieces).reshape(n, t, 2)


def check_fusable(model) -> None:
    """ConfigError when the model changes its logits after the output layer
    (soft-capping, a logit scale), which a stand-in head would skip."""
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ConfigError(f"model.use_fused_kernels=true: {type(model).__name__} scales its logits after the "
                             f"output layer ({name}); set model.use_fused_kernels=false for this model")
    if model.get_output_embeddings() is None:
        raise ConfigError(f"model.use_fused_kernels=true: {type(model).__name__} has no output layer to stand in "
                         "for; set model.use_fused_kernels=false")


@contextlib.contextmanager
def stats_head(model, targets: torch.Tensor, temperature: float = 1.0, rows: torch.Tensor | None = None, tp=None):
    """Within the block, `model(...).logits` is StatsHead's [N, T, 2] (`tp`: the model's TP group, or None)."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(StatsHead(head, targets, temperature, rows, tp=tp))
    try:
        yield
    finally:
        model.set_output_embeddings(head)
