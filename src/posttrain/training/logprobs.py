"""Per-token log-probabilities (and entropy) of responses under a model, over the micro-batches that
microbatch.py plans (their shared forward is forward.py).

The plan reads none of the batch's tensors back; tests/reference_passes.py keeps the steps it replaced (rows
ordered and micro-batches trimmed by reading them), which the tests check it against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from posttrain.algorithms.losses import entropy_from_logits
from posttrain.rollout.head import sliced_head
from posttrain.training.forward import can_share_prompt, forward_responses, response_logits
from posttrain.training.microbatch import micro_batches


@dataclass(frozen=True)
class PassOptions:
    """How log-prob, value and training passes run (the results do not change)."""

    remove_padding: bool = True
    share_prompt: bool = True
    fused: bool = False  # model.use_fused_kernels: log-probs and entropy chunk by chunk from the hidden states
    entropy_chunking: bool = False  # actor.entropy_from_logits_with_chunking: entropy a chunk of tokens at a time
    entropy_checkpointing: bool = False  # actor.entropy_checkpointing: the entropy recomputed in the backward
    compile: bool = False  # actor.use_torch_compile (ref's for its pass): log-prob and entropy torch.compile'd
    sp: object = None  # training.ulysses.SequenceParallel: this worker's positions of each sequence only
    tp: object = None  # training.tensor_parallel.TensorParallel: the logits are this rank's vocabulary columns


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device `model`'s passes run on: its parameters', except that FSDP2 with
    CPU offload keeps them on the CPU and computes on its mesh's device."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or mesh.device_type == "cpu":
        return p.device
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [N, R, V], tokens [N, R] -> log p(token) [N, R]."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


LOGSUMEXP_ELEMENTS = 1 << 26  # logits per piece of gathered_log_probs' logsumexp (256 MiB in float32)


def gathered_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [N, R, V], tokens [N, R] -> log p(token) [N, R] as logit(token) - logsumexp(logits), the
    logsumexp a piece of positions at a time: no [N, R, V] log-softmax is made (a pass without gradient and
    entropy: the reference's, the old policy's). Equal to `token_log_probs` to float rounding."""
    flat = logits.reshape(-1, logits.shape[-1])
    picked = flat.gather(-1, tokens.reshape(-1, 1)).squeeze(-1)
    rows = max(1, LOGSUMEXP_ELEMENTS // max(1, flat.shape[-1]))
    log_z = torch.cat([torch.logsumexp(piece, dim=-1) for piece in flat.split(rows)]) if flat.shape[0] else \
        picked
    return (picked - log_z).reshape(tokens.shape)


ENTROPY_ROWS = 16  # positions per piece of log_prob_and_entropy's entropy on the CPU: its temporaries stay small
# On a GPU the pieces are sized by memory instead: 16 rows of a 150k vocabulary is a few MiB per kernel, ~1,000
# launches per micro-batch. A piece's two [rows, V] temporaries (p and p log p) stay under this many bytes.
ENTROPY_BYTES_GPU = 1 << 30


def entropy_rows(device: torch.device, vocab: int, itemsize: int = 4) -> int:
    """Positions per piece of log_prob_and_entropy's entropy: ENTROPY_ROWS on the CPU; elsewhere as many as keep
    the piece's two [rows, vocab] temporaries of `itemsize` bytes under ENTROPY_BYTES_GPU (at least 1)."""
    if device.type == "cpu":
        return ENTROPY_ROWS
    return max(1, ENTROPY_BYTES_GPU // (2 * itemsize * max(1, vocab)))


def log_prob_and_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, R, V], tokens [N, R] -> (log p(token) [N, R], entropy [N, R],
    without a gradient), both from one log-softmax: the entropy -sum p log p is
    summed from it a piece of positions at a time (entropy_rows), instead of a
    softmax and a logsumexp of its own over the whole logits (entropy_from_logits;
    equal to float rounding). Logits must be finite, as there."""
    log_p = torch.log_softmax(logits, dim=-1)
    log_prob = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        flat = log_p.detach().reshape(-1, log_p.shape[-1])
        rows = entropy_rows(flat.device, flat.shape[-1], flat.element_size())
        entropy = torch.cat([-(piece.exp() * piece).sum(-1) for piece in flat.split(rows)])
    return log_prob, entropy.reshape(log_prob.shape)


ENTROPY_CHUNK = 2048  # tokens per piece with entropy_chunking


def chunked_entropy(logits: torch.Tensor) -> torch.Tensor:
    """entropy_from_logits over ENTROPY_CHUNK tokens at a time: the softmax's
    temporaries are one piece's, not the whole [N, R, V]. -> [N, R]"""
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.cat([entropy_from_logits(flat[i:i + ENTROPY_CHUNK])
                      for i in range(0, flat.shape[0], ENTROPY_CHUNK)]).reshape(logits.shape[:-1])


@functools.cache
def compiled(fn):
    """`fn` torch.compile'd once per process (shapes vary: dynamic)."""
    return torch.compile(fn, dynamic=True)


def log_probs_and_entropy(model, mb, device, temperature: float, options: PassOptions, with_entropy: bool = True,
                          entropy_grad: bool = False):
    """-> (log_prob [n, R], entropy [n, R] or None) of micro-batch `mb`'s
    responses under `model`; the entropy carries a gradient only with
    `entropy_grad` (an entropy bonus in the loss)."""
    args = (mb.input_ids.to(device), mb.attention_mask.to(device), mb.position_ids.to(device), mb.response_length)
    tokens = mb.responses.to(device)
    if options.sp is not None:  # each worker of the group its share of the positions (training/ulysses.py)
        return _sequence_parallel_stats(model, mb, device, temperature, options, with_entropy, entropy_grad)
    share = options.share_prompt and can_share_prompt(model)
    layout = getattr(mb, "layout", None)  # a planned micro-batch's (microbatch.Micro): nothing read back
    vision = getattr(mb, "vision", None) or None  # a vision-language model's rows' images
    if options.fused:
        out = forward_responses(model, *args, share, targets=tokens, temperature=temperature,
                                layout=layout, vision=vision, tp=options.tp)  # [n, R, 2]
        entropy = out[..., 1] if entropy_grad else out[..., 1].detach()
        return out[..., 0], entropy if with_entropy else None
    logits = response_logits(model, *args, temperature, share, layout=layout, vision=vision)  # [n, R, V]
    return _stats(logits, tokens, options, with_entropy, entropy_grad)


def _stats(logits, tokens, options: PassOptions, with_entropy: bool, entropy_grad: bool):
    """logits [n, T, V], tokens [n, T] -> (log p(token) [n, T], entropy [n, T] or None). With options.tp the
    logits are this rank's columns of the vocabulary (training/tensor_parallel.py)."""
    if options.tp is not None:
        from posttrain.training.tensor_parallel import vocab_parallel_stats

        log_prob, entropy = vocab_parallel_stats(logits, tokens, options.tp)
        keep = with_entropy and entropy_grad and torch.is_grad_enabled()
        return log_prob, (entropy if keep else entropy.detach()) if with_entropy else None
    if with_entropy and not (entropy_grad and torch.is_grad_enabled()) and not options.compile:
        return log_prob_and_entropy(logits, tokens)  # the entropy as a metric: from the same log-softmax
    if not with_entropy and not options.compile and not (torch.is_grad_enabled() and logits.requires_grad):
        return gathered_log_probs(logits, tokens), None
    log_prob = (compiled(token_log_probs) if options.compile else token_log_probs)(logits, tokens)
    if not with_entropy:
        return log_prob, None
    fn = chunked_entropy if options.entropy_chunking else entropy_from_logits
    fn = compiled(fn) if options.compile else fn
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        if options.entropy_checkpointing and torch.is_grad_enabled():  # its [n, R, V] temporaries not kept
            return log_prob, checkpoint(fn, logits, use_reentrant=False)
        return log_prob, fn(logits)


def _sequence_parallel_stats(model, mb, device, temperature, options, with_entropy, entropy_grad):
    """log_probs_and_entropy with the positions split over the sequence-parallel
    group: each worker's logits are its 1/P of the positions; the per-position
    log-probs and entropies are gathered, so every worker returns the whole."""
    from posttrain.training import ulysses

    sp = options.sp
    logits, targets, cols = _sharded_logits(model, mb, device, temperature, sp)
    log_prob, entropy = _stats(logits, targets, options, with_entropy, entropy_grad)
    log_prob = ulysses.gather(log_prob, sp)[:, cols]
    return log_prob, ulysses.gather(entropy, sp)[:, cols] if with_entropy else None


def _sharded_logits(model, mb, device, temperature, sp):
    """This worker's 1/P of the positions of `mb`'s rows: -> (their logits [n, L'/P, V] in float32 over the
    temperature, the tokens they predict [n, L'/P], the slice of the gathered positions that predict the
    response)."""
    from posttrain.training import ulysses

    refuse_images(mb)
    ids = mb.input_ids.to(device)
    prompt_width = ids.shape[1] - mb.response_length
    # position t predicts token t + 1; the last token predicts nothing we score
    logits, _ = ulysses.sharded_forward(model, ids[:, :-1], mb.attention_mask[:, :-1].to(device),
                                        mb.position_ids[:, :-1].to(device), sp)  # [n, L'/P, V]
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = ulysses.shard(ulysses.pad_positions(ids[:, 1:], sp.size), sp)  # [n, L'/P]
    return logits, targets, slice(prompt_width - 1, prompt_width - 1 + mb.response_length)


def refuse_images(mb) -> None:
    """Ulysses splits a sequence's positions over workers; an image's tokens would be split from its pixels."""
    if any(getattr(mb, "vision", None) or ()):
        raise ValueError("Ulysses sequence parallelism does not take images yet: set "
                         "actor.ulysses_sequence_parallel_size=1 for a vision-language model")


def topk_stats(model, mb, device, temperature: float, options: PassOptions, topk_ids: torch.Tensor,
               entropy_grad: bool = False):
    """The training pass of the top-k distillation modes (algorithms/distill.py), all over the whole vocabulary:
    -> (log p(token) [n, R], entropy [n, R] (with a gradient only with `entropy_grad`), log p at `topk_ids`
    [n, R, k], sum of p log p [n, R] with its gradient)."""
    if options.sp is not None:  # each worker of the group its share of the positions (training/ulysses.py)
        return _sequence_parallel_topk(model, mb, device, temperature, options.sp, topk_ids, entropy_grad, options.tp)
    if options.tp is not None:  # this rank's columns of the vocabulary (training/tensor_parallel.py)
        from posttrain.training.tensor_parallel import vocab_parallel_at

        ids = torch.cat([mb.responses.to(device).unsqueeze(-1), topk_ids.to(device).long()], -1)
        at, entropy = vocab_parallel_at(_response_logits(model, mb, device, temperature, options), ids, options.tp)
        return at[..., 0], entropy if entropy_grad else entropy.detach(), at[..., 1:], -entropy
    log_p = _response_log_p(model, mb, device, temperature, options)  # [n, R, V]
    log_prob = log_p.gather(-1, mb.responses.to(device).unsqueeze(-1)).squeeze(-1)
    neg_entropy = (log_p.exp() * log_p).sum(-1)
    entropy = -neg_entropy if entropy_grad else -neg_entropy.detach()
    return log_prob, entropy, log_p.gather(-1, topk_ids.to(device).long()), neg_entropy


def _sequence_parallel_topk(model, mb, device, temperature, sp, topk_ids, entropy_grad, tp=None):
    """topk_stats with the positions split over the sequence-parallel group (and with `tp` the vocabulary over the
    TP group); the per-position values are gathered, so every worker returns the whole."""
    from posttrain.training import ulysses

    logits, targets, cols = _sharded_logits(model, mb, device, temperature, sp)
    every = torch.zeros((len(mb), mb.input_ids.shape[1] - 1, topk_ids.shape[-1]), dtype=torch.long, device=device)
    every[:, cols] = topk_ids.to(device).long()
    every = ulysses.shard(ulysses.pad_positions(every, sp.size), sp)
    if tp is not None:  # this rank's columns (training/tensor_parallel.py)
        from posttrain.training.tensor_parallel import vocab_parallel_at

        at, entropy = vocab_parallel_at(logits, torch.cat([targets.unsqueeze(-1), every], -1), tp)
        log_prob, neg_entropy, topk = at[..., 0], -entropy, at[..., 1:]
    else:
        log_p = torch.log_softmax(logits, dim=-1)
        log_prob = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        neg_entropy, topk = (log_p.exp() * log_p).sum(-1), log_p.gather(-1, every)
    log_prob, neg_entropy = ulysses.gather(log_prob, sp)[:, cols], ulysses.gather(neg_entropy, sp)[:, cols]
    topk = ulysses.gather(topk, sp)[:, cols]
    return log_prob, -neg_entropy if entropy_grad else -neg_entropy.detach(), topk, neg_entropy


def _response_logits(model, mb, device, temperature, options: PassOptions) -> torch.Tensor:
    """The logits [n, R, V] (with TP this rank's columns) that predict `mb`'s response tokens, over the temperature."""
    args = (mb.input_ids.to(device), mb.attention_mask.to(device), mb.position_ids.to(device), mb.response_length)
    return response_logits(model, *args, temperature, options.share_prompt and can_share_prompt(model),
                           layout=getattr(mb, "layout", None), vision=getattr(mb, "vision", None) or None)


def _response_log_p(model, mb, device, temperature, options: PassOptions) -> torch.Tensor:
    """log-softmax [n, R, V] of the logits that predict `mb`'s response tokens (over the temperature)."""
    return torch.log_softmax(_response_logits(model, mb, device, temperature, options), dim=-1)


@torch.no_grad()
def compute_topk_log_probs(model, batch, k: int, micro_batch_size: int, temperature: float = 1.0,
                           options: PassOptions = PassOptions(), max_tokens: int | None = None):
    """The teacher's pass of the top-k distillation modes, in micro-batches, no grad: -> (log p(token) [N, R],
    the log-probs of the k most likely tokens at each response position [N, R, k], most likely first, and their
    ids [N, R, k] (int32)); 0 (and id 0) on the columns a trimmed micro-batch left out. Each micro-batch moves
    once and its results are gathered on the device (N x R x k x 8 bytes there), copied back once at the end:
    the host never waits for a micro-batch."""
    was_training = model.training
    model.eval()
    device = compute_device(model)
    log_probs = torch.zeros(batch.responses.shape, dtype=torch.float32, device=device)
    top_lp = torch.zeros((*batch.responses.shape, k), dtype=torch.float32, device=device)
    top_ids = torch.zeros((*batch.responses.shape, k), dtype=torch.int32, device=device)
    try:
        for _, mb in micro_batches(batch, micro_batch_size, options.remove_padding, max_tokens):
            mb = mb.to(device)
            width = mb.response_length
            if options.tp is not None:  # this rank's columns: the k best of every rank's k
                from posttrain.training.tensor_parallel import vocab_parallel_stats, vocab_parallel_topk

                logits = _response_logits(model, mb, device, temperature, options)
                log_probs[mb.rows, :width] = vocab_parallel_stats(logits, mb.responses, options.tp)[0]
                values, ids = vocab_parallel_topk(logits, k, options.tp)
            else:
                log_p = _response_log_p(model, mb, device, temperature, options)
                log_probs[mb.rows, :width] = log_p.gather(-1, mb.responses.unsqueeze(-1)).squeeze(-1)
                values, ids = log_p.topk(k, dim=-1)
            top_lp[mb.rows, :width], top_ids[mb.rows, :width] = values, ids.to(torch.int32)
    finally:
        model.train(was_training)
    return log_probs.cpu(), top_lp.cpu(), top_ids.cpu()


@torch.no_grad()
def compute_log_probs(model, batch, micro_batch_size: int, temperature: float = 1.0, with_entropy: bool = False,
                      options: PassOptions = PassOptions(), max_tokens: int | None = None):
    """Log-probs of `batch.responses` under `model`, in micro-batches (of
    `micro_batch_size` rows, or of at most `max_tokens` tokens), no grad.

    -> (log_probs [N, R], entropy [N, R] or None); 0 outside the responses'
    columns a trimmed micro-batch left out. The micro-batches are planned on
    the host and their results gathered on the device: the pass reads back
    once, at its end.
    """
    was_training = model.training
    model.eval()
    device = compute_device(model)
    log_probs = torch.zeros(batch.responses.shape, dtype=torch.float32, device=device)
    entropies = torch.zeros(batch.responses.shape, dtype=torch.float32, device=device) if with_entropy else None
    try:
        with sliced_head(model):  # the vocabulary's logits a slice at a time (CPU; rollout/head.py)
            for _, mb in micro_batches(batch, micro_batch_size, options.remove_padding, max_tokens):
                mb = mb.to(device)
                log_prob, entropy = log_probs_and_entropy(model, mb, device, temperature, options, with_entropy)
                width = mb.response_length
                log_probs[mb.rows, :width] = log_prob.float()
                if with_entropy:
                    entropies[mb.rows, :width] = entropy.float()
    finally:
        model.train(was_training)
    return log_probs.cpu(), entropies.cpu() if with_entropy else None
