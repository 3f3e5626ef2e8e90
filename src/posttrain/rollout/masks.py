"""Whether a model takes a 4-D attention mask as it is: the hf engine's decoding steps and the trainer's passes
build their masks once, as transformers would, instead of letting its mask builder inspect a 2-D mask on the
host at every forward (a read that waits for the device)."""

from __future__ import annotations


def takes_sdpa_masks(model) -> bool:
    """Whether transformers builds `model`'s masks with its sdpa_mask and passes a 4-D boolean mask given to the
    model through unchanged, so that a mask built here is exactly the one it would build.

    That holds for transformers' own model classes (their masks come from its masking_utils; remote code may do
    anything) on SDPA or posttrain_sdpa (models/attention.py registers sdpa_mask for it), causal, text only, every
    layer attending to all earlier keys (no sliding window, chunked or bidirectional layers). Any other model
    (eager's additive masks, flash attention's 2-D one) keeps the 2-D mask."""
    config = getattr(model, "config", None)
    if (config is None or not type(config).__module__.startswith("transformers.models.")
            or not getattr(config, "is_causal", True) or getattr(config, "text_config", None) is not None
            or getattr(config, "attention_chunk_size", None) is not None):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    if types is None and getattr(config, "sliding_window", None) is not None:
        return False
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        return ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation] is sdpa_mask
    except (ImportError, KeyError, AttributeError):
        return False
