"""The forward pass that the log-prob, value and training passes share: the model's outputs at the
positions that predict each response token, and only there.

`share_prompt` (model.share_prompt, on by default; off for debugging): the n samples of a prompt share
their prompt tokens, so a micro-batch runs each distinct prompt once, gathers its key/value cache for
each of its samples and runs only the response tokens on top. With gradients, the gather's backward
sums what the samples send back into the prompt, so the gradient is that of the full pass.

A planned micro-batch (`layout`, microbatch.py) says which rows share a prompt and whether its positions
hold padding: then nothing is read back from the device to learn it, and the attention mask that
transformers would build after reading the mask (`fast_all`) is built here without the read.
"""

from __future__ import annotations

import contextlib

import torch

from posttrain.rollout.kv import CACHE, cache_of
from posttrain.rollout.masks import takes_sdpa_masks
from posttrain.rollout.vision import join_vision, positions
from posttrain.training.fused import stats_head


def forward_responses(model, input_ids, attention_mask, position_ids, response_length: int,
                      share_prompt: bool = False, targets: torch.Tensor | None = None,
                      temperature: float = 1.0, layout=None, vision: list | None = None, tp=None) -> torch.Tensor:
    """The model's output (`.logits`: vocabulary logits, or a value head's
    outputs) at the positions that predict each response token. -> [N, R, C]

    Only those positions are projected (`logits_to_keep`), which matters for
    150k-token vocabularies. With share_prompt, each distinct prompt of the
    rows is run once and its key/value cache shared by its rows. With
    `targets` [N, R] (model.use_fused_kernels) the output layer is stood in
    for (training/fused.py): -> [N, R, 2], log p(target) / temperature's
    distribution and its entropy, the logits never whole. `layout`: the
    micro-batch's plan (microbatch.Layout), or None (found here). `vision`: a vision-language model's rows'
    image tensors (rollout/vision.py; {} for a row without), or None: then its positions are the model's own
    (3-D for Qwen-VL) and each distinct prompt's images run once through the image encoder. `tp`: with `targets`,
    the model's TP group (its output layer gives this rank's vocabulary columns: training/tensor_parallel.py).
    """
    rows_vision = vision if vision and any(vision) else None
    if rows_vision is not None:  # [3, N, P+R] for a model with 3-D positions
        found = positions(model, input_ids, attention_mask, join_vision(rows_vision, input_ids.device))
        position_ids = found if found is not None else position_ids
    if share_prompt:
        out = _shared_prompt_forward(model, input_ids, attention_mask, position_ids, response_length, targets,
                                     temperature, layout, rows_vision, tp)
        if out is not None:
            return out
    # the last token predicts nothing we score, and no earlier position attends to it: it is left out
    mask = attention_mask[:, :-1]
    if layout is not None:
        mask = planned_mask(model, mask, layout.padded, cached=False)
    images = join_vision(rows_vision, input_ids.device) if rows_vision is not None else {}
    with _head(model, targets, temperature, tp=tp):
        out = model(input_ids=input_ids[:, :-1], attention_mask=mask, position_ids=position_ids[..., :-1],
                    use_cache=False, logits_to_keep=response_length, **images)
    return out.logits[:, -response_length:, :]  # position t predicts token t+1


def _head(model, targets, temperature, rows=None, tp=None):
    return contextlib.nullcontext() if targets is None else stats_head(model, targets, temperature, rows, tp)


def _shared_prompt_forward(model, input_ids, attention_mask, position_ids, response_length: int, targets=None,
                           temperature: float = 1.0, layout=None, vision: list | None = None, tp=None):
    """`forward_responses` with each distinct prompt run once; None when no
    two rows share a prompt (the plain pass is as cheap). `vision`: the rows'
    images (the distinct prompts' run through the image encoder once)."""
    prompt_width = input_ids.shape[1] - response_length
    rows = input_ids.shape[0]
    if layout is not None:  # planned on the host
        if layout.prompts is None or response_length == 0:
            return None
        inverse, first, blocks, count = layout.prompts.inverse, layout.prompts.first, layout.prompts.blocks, \
            layout.prompts.count
        first_rows = layout.prompts.first_rows
    elif vision is not None:  # equal tokens are not an equal prompt with images: only a plan knows the groups
        return None
    else:
        found = _distinct_prompts(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
        if found is None or response_length == 0:
            return None
        inverse, first, blocks, count = found
        first_rows = None
    images = join_vision([vision[i] for i in first_rows], input_ids.device) if vision is not None else {}
    fused = targets is not None
    head_mask = attention_mask[first, :prompt_width]
    if layout is not None:
        head_mask = planned_mask(model, head_mask, layout.padded_prompts, cached=True)
    with _head(model, targets[:, :1] if fused else None, temperature, rows=inverse, tp=tp):
        head = model(input_ids=input_ids[first, :prompt_width], attention_mask=head_mask,
                     position_ids=position_ids[..., first, :prompt_width], use_cache=True, logits_to_keep=1, **images)
    cache = cache_of(head)  # [U, ...] -> [N, ...]; the backward sums the rows' gradients per prompt
    if blocks:
        cache.batch_repeat_interleave(rows // count)
    else:
        cache.batch_select_indices(inverse)
    # [N, 1, C]: the last prompt position predicts response token 0 (the fused head took each row's already)
    first_token = head.logits[:, -1:, :] if fused else head.logits[inverse, -1:, :]
    if response_length == 1:
        return first_token
    # response position t predicts token t+1; the last response token predicts nothing we score: left out
    with _head(model, targets[:, 1:] if fused else None, temperature, tp=tp):
        tail = model(input_ids=input_ids[:, prompt_width:-1], attention_mask=attention_mask[:, :-1],
                     position_ids=position_ids[..., prompt_width:-1], use_cache=True, **{CACHE: cache},
                     logits_to_keep=response_length - 1)
    return torch.cat([first_token, tail.logits], dim=1)


def _distinct_prompts(ids, mask):
    """-> (inverse [N]: row -> distinct prompt, a row of each [U], blocks, U) of prompts ids [N, P] with
    their mask, found on the device (reading back); None when none repeats. Groups of adjacent rows, all of
    one size (how rollouts and the micro-batch plan lay them out), are blocks, repeated in the cache with a cheap
    backward; else rows are gathered."""
    prompt = torch.cat([ids, mask], dim=1)  # [N, 2P]
    unique, inverse, counts = torch.unique_consecutive(prompt, dim=0, return_inverse=True, return_counts=True)
    blocks = bool((counts == counts[0]).all())
    if not blocks:
        unique, inverse = torch.unique(prompt, dim=0, return_inverse=True)
    if unique.shape[0] == prompt.shape[0]:
        return None
    # one row of each distinct prompt (which one does not matter: they hold the same tokens and positions)
    first = torch.zeros(unique.shape[0], dtype=torch.long, device=ids.device)
    first.scatter_(0, inverse, torch.arange(prompt.shape[0], device=ids.device))
    return inverse, first, blocks, unique.shape[0]


def planned_mask(model, mask, padded: bool, cached: bool):
    """The attention mask to give `model` for 2-D `mask` [B, L] (queries and keys alike, none cached before)
    when the plan knows whether it holds padding (`padded`): what transformers would build from it, without
    its read of the mask. Padded: the 4-D mask of its sdpa_mask; else None where the model makes a cache
    (`cached`: transformers then checks no packed sequences). Any other model, or a transformers without
    these: `mask` unchanged."""
    if not takes_sdpa_masks(model):
        return mask
    if not padded:
        return None if cached else mask
    from transformers.masking_utils import sdpa_mask

    try:
        built = sdpa_mask(batch_size=mask.shape[0], q_length=mask.shape[1], kv_length=mask.shape[1],
                          attention_mask=mask.bool(), allow_is_causal_skip=False, device=mask.device)
    except TypeError:  # another transformers' signature
        return mask
    return built if isinstance(built, torch.Tensor) and built.dim() == 4 else mask


def response_logits(model, input_ids, attention_mask, position_ids, response_length: int, temperature: float,
                    share_prompt: bool = False, layout=None, vision: list | None = None):
    """Logits that predict each response token. -> [N, R, V] (float32), divided
    by the sampling temperature so the log-probs are those of the distribution
    the rollout sampled from."""
    logits = forward_responses(model, input_ids, attention_mask, position_ids, response_length, share_prompt,
                               layout=layout, vision=vision).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


def can_share_prompt(model) -> bool:
    """Whether a pass may carry a key/value cache through `model`: not with
    activation checkpointing, whose recomputation would append to it twice."""
    if getattr(model, "_posttrain_ac", False):  # parallelize(activation_checkpointing=True)
        return False
    if hasattr(model, "get_base_model"):  # peft (LoRA): the wrapped model says
        model = model.get_base_model()
    hf = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers < 5 names it so
    return not getattr(model, hf, False)
