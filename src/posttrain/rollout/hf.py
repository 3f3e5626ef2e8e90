"""Rollout with a Hugging Face transformers model: the reference engine.

It samples from the very module the trainer updates (colocated, no weight
copy), with a KV cache, in chunks of about `micro_batch_size` sequences
(whole groups of a prompt's n samples). Three things save work without
changing what is sampled (each can be switched off for debugging):

- shared_prefill: a chunk's distinct prompts are run once and their
  key/value cache repeated for their n samples;
- remove_padding: a sequence that has ended leaves the decoding batch, and
  chunks are formed of prompts of alike length;
- early_stop: decoding stops once every sequence of a chunk has ended.

The last two are decisions the host takes on the device's numbers: each
reads them back, which on a GPU waits for every queued kernel (decoding a
token is many small kernels, launched faster than a GPU runs them only while
nothing waits). `stop_check_every` = k takes them every k tokens, with one
read; in between, a sequence that has ended goes on in the batch, its tokens
masked to padding as after any ending. The samples are those of k = 1 (with
remove_padding a row's logits then come from batches of other sizes, which on
the CPU can round the last bits of its log-probs differently, as switching
remove_padding itself does). The decoding forward reads nothing back either:
its attention mask goes in the 4-D form that transformers' mask builder takes
as it is (rollout/masks.py), or as None while no running row is padded, where
a 2-D mask is inspected on the host at every token.

On CUDA (rollout.static_decoding) the decoding step runs with fixed shapes
over buffers allocated once, recorded as CUDA graphs (rollout/static.py):
the same samples.

Sampling inverts each step's CDF with a uniform number drawn for that
sequence and step before decoding starts, so a seed fixes the samples
whatever the chunking, the order of the chunks, and whether any of the three
is on: they can be checked against each other exactly.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.head import sliced_head
from posttrain.rollout.kv import CACHE, cache_of, reserve
from posttrain.rollout.masks import takes_sdpa_masks
from posttrain.rollout.sampling import next_tokens
from posttrain.rollout.static import StaticDecoder, compute_dtype
from posttrain.rollout.vision import join_vision, positions, prompt_vision


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
    stop_check_every: the tokens decoded between two checks for ended
    sequences (early_stop, remove_padding); 1: after every token.
    static_decoding: decode with the static-shape step (rollout/static.py),
    recorded as CUDA graphs on CUDA unless `cuda_graphs` is False.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        micro_batch_size: int | None = None,
        seed: int = 0,
        progress: bool = True,
        shared_prefill: bool = True,
        remove_padding: bool = True,
        early_stop: bool = True,
        stop_check_every: int = 1,
        static_decoding: bool = False,
        cuda_graphs: bool = True,
    ):
        if isinstance(stop_check_every, bool) or not isinstance(stop_check_every, int) or stop_check_every < 1:
            raise ValueError(f"stop_check_every must be an integer >= 1, got {stop_check_every!r}")
        self.model = model  # the trainer's module, or a copy kept up to date with load_weights
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.micro_batch_size = micro_batch_size
        self.progress = progress
        self.shared_prefill, self.remove_padding, self.early_stop = shared_prefill, remove_padding, early_stop
        self.stop_check_every = stop_check_every
        if static_decoding and not takes_sdpa_masks(model):
            raise ValueError("rollout.static_decoding needs a transformers model class on SDPA attention whose layers "
                             "all attend to every earlier key (no sliding window); this model is not: set "
                             "rollout.static_decoding=false")
        self.static = StaticDecoder(cuda_graphs) if static_decoding else None
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # in-flight weight updates (asynchronous training): called before every forward, it may load newer
        # weights (and set `weights_version`); each sampled token is then tagged with the version that chose it
        self.weights_hook = None
        self.weights_version = 0

    def update_weights(self, model: torch.nn.Module) -> None:
        # Colocated: the engine samples from the trainer's own module.
        self.model = model

    def release(self) -> None:
        """Free static decoding's buffers and graphs (made anew at the next generation)."""
        if self.static is not None:
            self.static.release()

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
        n = params.n
        expanded = [p for p in prompts for _ in range(n)]  # prompt-major
        prompt_ids, prompt_mask = left_pad(expanded, self.pad_token_id, max(len(p) for p in expanded))
        per_chunk = max(1, (self.micro_batch_size or len(expanded)) // n)  # whole groups of n samples
        order = list(range(len(prompts)))
        if self.remove_padding and per_chunk < len(prompts):  # alike lengths together: less prompt padding
            order.sort(key=lambda i: -len(prompts[i]))
        # [N, max_new_tokens]: sequence i's step-t draw, whichever chunk runs it and when; from params.seed's own
        # stream when it names one (a streamed rollout's piece), else the engine's
        generator = (self.generator if params.seed is None
                     else torch.Generator(device=self.device).manual_seed(params.seed))
        uniforms = None if params.greedy else torch.rand((len(expanded), params.max_new_tokens),
                                                         generator=generator, device=self.device)
        # static decoding's buffers: the largest chunk's rows, the longest prompt and the new tokens
        self._static_rows = min(per_chunk, len(prompts)) * n
        self._static_columns = max(len(p) for p in prompts) + params.max_new_tokens
        was_training = self.model.training
        self.model.eval()
        parts = []  # (rows of the chunk in the output, responses, masks, log-probs, truncated, versions)
        bar = tqdm(total=len(expanded), desc="gen", unit="seq", leave=False, disable=None if self.progress else True)
        try:
            with sliced_head(self.model):  # the vocabulary's logits a slice at a time (CPU; rollout/head.py)
                for start in range(0, len(order), per_chunk):
                    chunk = order[start:start + per_chunk]
                    group = [prompts[i] for i in chunk]
                    ids, mask = left_pad(group, self.pad_token_id, max(len(p) for p in group))
                    rows = (torch.tensor(chunk)[:, None] * n + torch.arange(n)).flatten()  # their prompt-major rows
                    u = uniforms[rows.to(self.device)] if uniforms is not None else None
                    r, m, lp, cut, ver = self._generate_chunk(ids.to(self.device), mask.to(self.device), n, params, u,
                                                              padded=len({len(p) for p in group}) > 1,
                                                              vision=prompt_vision(group))
                    parts.append((rows, r.cpu(), m.cpu(), lp.cpu() if lp is not None else None, cut.cpu(),
                                  ver.cpu() if ver is not None else None))
                    bar.update(len(chunk) * n)
        finally:
            bar.close()
            self.model.train(was_training)
        width = max(r.shape[1] for _, r, _, _, _, _ in parts)
        response_ids = torch.full((len(expanded), width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(expanded), width), dtype=torch.long)
        log_probs = torch.zeros((len(expanded), width)) if params.logprobs else None
        truncated = torch.zeros(len(expanded), dtype=torch.bool)
        versions = torch.full((len(expanded), width), -1, dtype=torch.long) if self.weights_hook else None
        for rows, r, m, lp, cut, ver in parts:
            response_ids[rows, :r.shape[1]] = r
            response_mask[rows, :m.shape[1]] = m
            truncated[rows] = cut
            if log_probs is not None:
                log_probs[rows, :lp.shape[1]] = lp
            if versions is not None:
                versions[rows, :ver.shape[1]] = ver
        return RolloutOutput(prompt_ids, prompt_mask, response_ids, response_mask, log_probs, truncated,
                             weight_versions=versions)

    def _generate_chunk(self, ids: torch.Tensor, mask: torch.Tensor, n: int, params: SamplingParams,
                        uniforms: torch.Tensor | None, padded: bool = True, vision: list | None = None):
        """ids, mask: [p, P] distinct prompts, left-padded (padded: whether any
        row is, as the host knows from the prompts' lengths); uniforms [p*n,
        max_new_tokens] (None: greedy) -> response ids, mask (and log-probs or
        None): [p*n, R], the n samples of a prompt adjacent; truncated [p*n]:
        the rows that never sampled an EOS (with ignore_eos, every row); the weights
        version that chose each token [p*n, R] (None without a weights hook). `vision`: a vision-language
        model's prompts' images (rollout/vision.py), run through the image encoder once per prompt with
        shared_prefill; the model's own positions (3-D for Qwen-VL) for the prompt, text positions after it."""
        rows, device = ids.shape[0] * n, ids.device
        self._new_weights()
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [p, P]; pads get 0, ignored by the mask
        images = {}
        if vision is not None:
            if not self.shared_prefill:
                vision = [v for v in vision for _ in range(n)]
            images = join_vision(vision, device)
        if not self.shared_prefill:
            ids, mask, position_ids = (t.repeat_interleave(n, dim=0) for t in (ids, mask, position_ids))
        if images:
            found = positions(self.model, ids, mask, images)  # [3, p, P]
            position_ids = found if found is not None else position_ids
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                         logits_to_keep=1, **images)
        logits = out.logits[:, -1, :]
        repeats = n if self.shared_prefill else 1  # [p, ...] -> [p*n, ...]: the prompt ran once for its n samples
        if self.static is not None:
            self.static.prepare(self.model, self._static_rows, self._static_columns, params.max_new_tokens,
                                cache_of(out).layers, compute_dtype(self.model, device), device, self.eos_token_ids)
        else:
            cache = reserve(cache_of(out), params.max_new_tokens, repeats)  # decoding writes in place
        if position_ids.dim() == 3:  # after the prompt, text: one position past the prompt's largest, on every axis
            position_ids = position_ids.amax(0)
        if repeats > 1:
            logits, mask, position_ids = (t.repeat_interleave(n, dim=0) for t in (logits, mask, position_ids))
        next_pos = position_ids[:, -1:] + 1  # [rows, 1]
        if self.static is not None:
            return self.static.decode(self, logits, cache_of(out).layers, repeats, mask, next_pos, uniforms, params,
                                      padded)
        # the attention mask of every decoding step, allocated once: a step passes a view of its first `width`
        # columns (the prompt's mask, then ones), as the reserved cache holds the keys (no per-token cat)
        width = mask.shape[1]
        full_mask = torch.ones((rows, width + params.max_new_tokens), dtype=mask.dtype, device=device)
        full_mask[:, :width] = mask
        four_d = takes_sdpa_masks(self.model)
        if four_d:  # [rows, 1, 1, columns]: one query's mask, taken as it is; None while no row running is padded
            full_mask, row_padded = full_mask.bool()[:, None, None], (mask == 0).any(-1)  # as transformers does
        eos = torch.tensor(self.eos_token_ids, device=device)
        tokens = torch.full((rows, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        alive = torch.zeros((rows, params.max_new_tokens), dtype=torch.long, device=device)
        log_probs = torch.zeros((rows, params.max_new_tokens), device=device) if params.logprobs else None
        # only with in-flight updates (a weights hook): otherwise every token's version is the same
        versions = (torch.full((rows, params.max_new_tokens), -1, dtype=torch.long, device=device)
                    if self.weights_hook is not None else None)
        logits_version = self.weights_version  # the weights that computed `logits`
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        running = torch.arange(rows, device=device)  # the rows the model still runs (logits, cache) for
        # whether the host ever looks at `finished` (with ignore_eos no row ends before the limit)
        checks = (self.early_stop or self.remove_padding) and not params.ignore_eos
        length = 0
        for step in range(params.max_new_tokens):
            length = step + 1
            if len(running) == 0:  # early_stop=False and every row has ended: only padding is left to add
                continue
            live = ~finished[running]  # [len(running)]: rows that had not ended before this token
            tok, lp = next_tokens(logits, params, None if uniforms is None else uniforms[running, step],
                                  log_probs is not None)
            tok = torch.where(live, tok, torch.full_like(tok, self.pad_token_id))
            tokens[running, step], alive[running, step] = tok, live.long()
            if versions is not None:  # -1 on padding
                versions[running, step] = torch.where(live, logits_version, -1)
            if log_probs is not None:
                log_probs[running, step] = lp * live
            if not params.ignore_eos:
                finished[running] |= live & torch.isin(tok, eos)
            if step == params.max_new_tokens - 1:
                break
            if checks and (step + 1) % self.stop_check_every == 0:
                # the check's one host read: the rows that go on (rows that left the batch have all ended), the
                # columns holding a live token (where a check after each token would have stopped), and whether
                # a row that goes on is padded
                ended = finished[running]
                reads = [(~ended).sum(), alive[:, :length].any(0).sum()]
                if four_d:
                    reads.append((~ended & row_padded).any().long())
                still, used, *kept_padded = torch.stack(reads).tolist()
                if self.early_stop and still == 0:
                    length = used
                    break
                if self.remove_padding and still < len(running):  # ended rows leave the batch
                    keep = torch.argsort(ended.to(torch.uint8), stable=True)[:still]  # the others, in order
                    running, tok, full_mask, next_pos = running[keep], tok[keep], full_mask[keep], next_pos[keep]
                    cache.batch_select_indices(keep)
                    if four_d:
                        row_padded, padded = row_padded[keep], bool(kept_padded[0])
                    if len(running) == 0:
                        continue
            width += 1
            self._new_weights()  # the sequences in flight go on with them (their KV cache kept as it is)
            logits_version = self.weights_version
            step_mask = None if four_d and not padded else full_mask[..., :width]
            out = self.model(input_ids=tok[:, None], attention_mask=step_mask, position_ids=next_pos,
                             use_cache=True, **{CACHE: cache})
            cache, logits = cache_of(out), out.logits[:, -1, :]
            next_pos = next_pos + 1
        return (tokens[:, :length], alive[:, :length], (log_probs[:, :length] if log_probs is not None else None),
                ~finished, versions[:, :length] if versions is not None else None)

    def _new_weights(self) -> None:
        if self.weights_hook is not None:
            self.weights_hook()
