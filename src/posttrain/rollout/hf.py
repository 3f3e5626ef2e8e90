"""Rollout with a Hugging Face transformers model: the reference engine.

It samples from the very module the trainer updates (colocated, no weight
copy), with a KV cache, in chunks of `micro_batch_size` sequences, and stops
as soon as every sequence in a chunk has ended.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from posttrain.rollout.base import RolloutOutput, SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask out (set to -inf) tokens outside top-k and outside the top-p
    nucleus. logits: [N, V]. The most likely token always survives."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already exceeds top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> next token ids [N]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(seqs: list[list[int]], pad_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [N, length], mask [N, length], real tokens flush right."""
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, length - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s):] = 1
    return ids, mask


class HFRolloutEngine:
    """`RolloutEngine` over a transformers causal LM.

    eos_token_ids: tokens that end a response (the tokenizer's EOS and the
    generation config's, e.g. Qwen's `<|im_end|>` and `<|endoftext|>`).
    micro_batch_size: sequences per forward pass; None = all at once.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        micro_batch_size: int | None = None,
        seed: int = 0,
        progress: bool = True,
    ):
        self.model = model  # the trainer's module, or a copy kept up to date with load_weights
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.micro_batch_size = micro_batch_size
        self.progress = progress
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def update_weights(self, model: torch.nn.Module) -> None:
        # Colocated: the engine samples from the trainer's own module.
        self.model = model

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """Copy (HF name, full tensor) pairs into the engine's own model (when
        it holds a copy, as beside a sharded trainer). Every parameter and
        buffer of the model must be given."""
        own = self.model.state_dict()
        missing = set(own)
        for name, tensor in weights:
            if name not in own:
                raise KeyError(f"weight '{name}' is not a parameter of the rollout model")
            own[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise KeyError(f"weights missing for the rollout model: {sorted(missing)[:5]}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        expanded = [p for p in prompts for _ in range(params.n)]  # prompt-major
        prompt_len = max(len(p) for p in expanded)
        prompt_ids, prompt_mask = left_pad(expanded, self.pad_token_id, prompt_len)
        chunk = self.micro_batch_size or len(expanded)
        was_training = self.model.training
        self.model.eval()
        responses, masks, log_probs = [], [], []
        bar = tqdm(total=len(expanded), desc="gen", unit="seq", leave=False, disable=None if self.progress else True)
        try:
            for start in range(0, len(expanded), chunk):
                ids = prompt_ids[start:start + chunk].to(self.device)
                mask = prompt_mask[start:start + chunk].to(self.device)
                r, m, lp = self._generate_chunk(ids, mask, params)
                responses.append(r.cpu())
                masks.append(m.cpu())
                log_probs.append(lp.cpu() if lp is not None else None)
                bar.update(ids.shape[0])
        finally:
            bar.close()
            self.model.train(was_training)
        width = max(r.shape[1] for r in responses)
        response_ids = torch.cat([_right_pad(r, width, self.pad_token_id) for r in responses])
        response_mask = torch.cat([_right_pad(m, width, 0) for m in masks])
        lp = torch.cat([_right_pad(x, width, 0.0) for x in log_probs]) if params.logprobs else None
        return RolloutOutput(prompt_ids, prompt_mask, response_ids, response_mask, lp)

    def _generate_chunk(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams):
        """ids, mask: [n, P] left-padded -> response ids, mask: [n, R]."""
        n = ids.shape[0]
        eos = torch.tensor(self.eos_token_ids, device=ids.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, P]; pads get 0, ignored by the mask
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = position_ids[:, -1:] + 1  # [n, 1]
        finished = torch.zeros(n, dtype=torch.bool, device=ids.device)
        tokens, alive, log_probs = [], [], []
        for step in range(params.max_new_tokens):
            tok = sample_next(logits, params, self.generator)
            tok = torch.where(finished, torch.full_like(tok, self.pad_token_id), tok)
            if params.logprobs:
                scaled = logits.float() / (params.temperature if not params.greedy else 1.0)
                log_probs.append(torch.log_softmax(scaled, -1).gather(-1, tok[:, None]).squeeze(-1) * ~finished)
            alive.append(~finished)
            tokens.append(tok)
            if not params.ignore_eos:
                finished = finished | torch.isin(tok, eos)
            if bool(finished.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=mask.device)], dim=1)
            out = self.model(
                input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                past_key_values=cache, use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1, :]
            next_pos = next_pos + 1
        response = torch.stack(tokens, dim=1)  # [n, R]
        response_mask = torch.stack(alive, dim=1).long()  # [n, R]
        return response, response_mask, (torch.stack(log_probs, dim=1) if params.logprobs else None)


def _right_pad(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)
