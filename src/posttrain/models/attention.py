"""SDPA, with small attentions on the CPU computed as two grouped matmuls.

An RL step on the CPU runs many small attentions: one query token against a
few hundred keys per decoding step, a group's responses against their shared
prompt in the log-prob and training passes. There torch's fused CPU kernel
for scaled_dot_product_attention costs two to three times what
`softmax(q k^T) v` costs as plain matmuls (fused kernel 1.5 ms forward,
6.2 ms forward+backward, vs 0.7 and 2.3 ms, for 64 sequences x 4 heads x 15
queries x 60 keys on 2 cores), and with a padding mask transformers repeats
each key/value head for its query heads first.

`posttrain_sdpa` is a transformers attention implementation that computes
exactly SDPA's attention (same mask semantics, as transformers builds them
for "sdpa"), as matmuls with the query heads of a key/value head grouped
(no repeated keys) when the call is on the CPU and its score matrix is small;
every other call (GPU, long sequences, dropout, biases) goes to transformers'
own SDPA function unchanged.
"""

from __future__ import annotations

import torch

NAME = "posttrain_sdpa"
# Above this many attention scores per call (batch x heads x queries x keys; 4M floats = 16 MB), the
# fused kernel's memory-saving tiling matters more than its overhead.
MAX_SCORES = 1 << 22


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """query [B, H, Lq, D], key/value [B, KVH, Lk, D], attention_mask bool
    [B or 1, 1, Lq, Lk] (True: attend) or additive float, or None -> (output
    [B, Lq, H, D], None), as transformers' `sdpa_attention_forward`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, lq, d = query.shape
    kvh, lk = key.shape[1], key.shape[2]
    if (query.device.type != "cpu" or b * h * lq * lk > MAX_SCORES or (dropout > 0 and module.training)
            or h % kvh or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = h // kvh  # query heads per key/value head, adjacent as repeat_kv lays them out
    scale = d ** -0.5 if scaling is None else scaling
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    allowed = attention_mask
    if allowed is None and causal and lq > 1:
        # SDPA's is_causal aligns the queries to the first keys; transformers drops the mask only where the
        # keys beyond the queries are empty cache slots, and crops them too
        key, value, lk = key[:, :, :lq], value[:, :, :lq], lq
        allowed = torch.ones(lq, lq, dtype=torch.bool, device=query.device).tril()[None, None]
    # [B, KVH, G*Lq, Lk]: a key/value head's G query heads in one matmul
    scores = torch.matmul(query.reshape(b, kvh, groups * lq, d) * scale, key.transpose(-1, -2))
    scores = scores.view(b, kvh, groups, lq, lk)
    if allowed is not None:
        allowed = allowed[:, :, None]  # [B|1, 1, 1, Lq, Lk]: the same for every head
        # a finite floor, not -inf: a row with no key to attend (a padding query) stays finite, and unused
        scores = (scores.masked_fill(~allowed, torch.finfo(scores.dtype).min) if allowed.dtype == torch.bool
                  else scores + allowed)
    # half-precision scores are normalised in float32, as the fused kernels do
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    out = torch.matmul(probs.view(b, kvh, groups * lq, lk), value)  # [B, KVH, G*Lq, D]
    return out.view(b, h, lq, d).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `posttrain_sdpa` known to transformers (attention and mask builders); -> its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, grouped_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def use_grouped_attention(model) -> bool:
    """Switch a model that runs SDPA to `posttrain_sdpa`; -> whether it switched.
    Models on another implementation (eager, flash, remote code without
    attention backends) keep theirs."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(register())
    except (ValueError, ImportError):  # a model class that takes no registered attention functions
        return False
    return True
