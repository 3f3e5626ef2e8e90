"""Per-token log-probabilities (and entropy) of responses under a model."""

from __future__ import annotations

import torch

from posttrain.algorithms.losses import entropy_from_logits


def response_logits(model, input_ids, attention_mask, position_ids, response_length: int, temperature: float):
    """Logits that predict each response token. -> [N, R, V] (float32).

    Only the last R+1 positions are projected to the vocabulary
    (`logits_to_keep`), which matters for 150k-token vocabularies. Logits are
    divided by the sampling temperature so the log-probs are those of the
    distribution the rollout sampled from.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=response_length + 1,
    )
    logits = out.logits[:, -response_length - 1:-1, :].float()  # position t predicts token t+1
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [N, R, V], tokens [N, R] -> log p(token) [N, R]."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def compute_log_probs(model, batch, micro_batch_size: int, temperature: float = 1.0, with_entropy: bool = False):
    """Log-probs of `batch.responses` under `model`, in micro-batches, no grad.

    -> (log_probs [N, R], entropy [N, R] or None)
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    log_probs, entropies = [], []
    try:
        for mb in batch.split(micro_batch_size):
            logits = response_logits(
                model, mb.input_ids.to(device), mb.attention_mask.to(device), mb.position_ids.to(device),
                mb.response_length, temperature,
            )
            log_probs.append(token_log_probs(logits, mb.responses.to(device)).cpu())
            if with_entropy:
                entropies.append(entropy_from_logits(logits).cpu())
    finally:
        model.train(was_training)
    return torch.cat(log_probs), (torch.cat(entropies) if with_entropy else None)
