"""The hf engine's static-shape decoding step (rollout.static_decoding), captured as a CUDA graph on CUDA.

Decoding a token is about a thousand small kernels; eager, a GPU waits for the host to launch them. A CUDA graph
launches a recorded step at once, but only a step whose shapes and addresses never change and that never reads
the device from the host. So everything a step touches lives in buffers allocated once, and what changes from one
token to the next is held on the device:

- the KV cache: per layer one buffer [rows, heads, columns, head_dim] in the compute dtype (bf16 under autocast;
  the eager loop keeps RoPE's float32 keys and casts them at every layer and token), a step writing its token at
  the column `col`, a device counter;
- the attention mask: [rows, 1, 1, columns] booleans (True: attend), a step setting its column: the form that
  transformers passes to SDPA as it is (rollout/masks.py);
- the positions, the last tokens, the step counter that indexes the sampling's uniforms and the outputs;
- the batch: a few fixed sizes (`buckets`): a chunk starts at its own size, and at a stop check its rows that go
  on move to the front and the batch shrinks to the smallest bucket that holds them (the ended rows beyond them
  run on, their tokens masked to padding, as between two checks).

Captured, a step attends over the columns written so far rounded up to a multiple of COLUMNS (unwritten ones
masked: a graph per bucket and window); eager (on the CPU, or with rollout.enforce_eager) it reads only the
columns written so far, and with the mask left out while no running row
is padded, as the eager loop does: the same arithmetic as that loop, so the same tokens. Under autocast the graph
is recorded with autocast's weight cache off (its casts then read the weights where they are, as the trainer
updates them in place); a step's weights hook (in-flight updates) runs between steps, outside the graph.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from posttrain.rollout.kv import CACHE
from posttrain.rollout.sampling import next_tokens

MIN_BUCKET = 8  # the smallest batch a graph is recorded for: fewer rows run in it beside ended ones
# captured: the buffer's columns are rounded up to a multiple of this (one shape's graphs then serve later calls),
# and a step reads the written columns rounded up to one (a graph per bucket and window): attention over all the
# columns would read twice the keys and values that decoding writes, on average
COLUMNS = 128


def buckets(rows: int) -> list[int]:
    """The batch sizes a chunk of `rows` decodes at, largest first: rows, then the powers of two below it down to
    MIN_BUCKET."""
    sizes, b = [], MIN_BUCKET
    while b < rows:
        sizes.append(b)
        b *= 2
    return [rows, *reversed(sizes)]


def bucket_for(still: int, sizes: list[int]) -> int:
    """The smallest of `sizes` that holds `still` rows."""
    return min(b for b in sizes if b >= still)


class Frame:
    """What the layers of a step read: the batch's rows now, the key columns attention reads, the column written."""

    def __init__(self, col: torch.Tensor):
        self.rows, self.window, self.col = 0, 0, col


class StaticLayer(DynamicLayer):
    """One layer's keys/values in fixed buffers; `update` writes the step's token at the frame's column."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, frame: Frame):
        super().__init__()
        self.k, self.v, self.frame = keys, values, frame
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys = self.values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        f = self.frame
        self.k[:f.rows].index_copy_(2, f.col, key_states.to(self.k.dtype))
        self.v[:f.rows].index_copy_(2, f.col, value_states.to(self.v.dtype))
        self.keys, self.values = self.k[:f.rows, :, :f.window], self.v[:f.rows, :, :f.window]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """The keys before the step's token (what transformers' mask builder asks when given no mask: eager)."""
        return self.frame.window - 1


def compute_dtype(model, device: torch.device) -> torch.dtype:
    """The dtype the model's layers compute in: autocast's where it is on, else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


class StaticDecoder:
    """The buffers, and on CUDA the graphs, of an engine's static decoding; kept between generations while the
    model, the shapes and the sampling stay the same (`prepare`).

    graphs: record each bucket's step as a CUDA graph (on CUDA; a test may give `graph_type`, called with the
    step, to stand in for torch.cuda.CUDAGraph)."""

    def __init__(self, graphs: bool, graph_type=None):
        self.graphs, self.graph_type = graphs, graph_type
        self.shape = None  # what the buffers were made for
        self.recorded: dict = {}  # (sampling, bucket, window) -> graph
        self.seen: dict = {}  # (sampling, bucket, window) -> eager steps run (the first is the warm-up)
        self.pool = None
        self.failed = None  # why recording failed, once: the steps then run eagerly

    def captured(self, device: torch.device) -> bool:
        return self.graphs and self.failed is None and (self.graph_type is not None or device.type == "cuda")

    def prepare(self, model, rows: int, columns: int, max_new: int, prefill_layers, dtype, device,
                eos: list[int]) -> None:
        """Buffers for chunks of at most `rows` rows, `columns` key positions and `max_new` tokens, the layers'
        key/value heads as in `prefill_layers`; made anew only when one of these, or the model's weights'
        addresses, changed (the graphs read the weights where they were recorded)."""
        if self.captured(device):
            columns = _round_up(columns)
        heads = tuple((layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[1], layer.values.shape[3])
                      for layer in prefill_layers)
        weights = tuple(p.data_ptr() for p in model.parameters())
        shape = (id(model), weights, rows, columns, max_new, heads, dtype, device, tuple(eos))
        if shape == self.shape:
            return
        self.release()
        zeros = dict(dtype=dtype, device=device)  # unwritten columns are masked: zeros keep 0 * value finite
        self.k = [torch.zeros((rows, kh, columns, kd), **zeros) for kh, kd, _, _ in heads]
        self.v = [torch.zeros((rows, vh, columns, vd), **zeros) for _, _, vh, vd in heads]
        self.mask = torch.zeros((rows, 1, 1, columns), dtype=torch.bool, device=device)
        long = dict(dtype=torch.long, device=device)
        self.pos, self.tok, self.slots = (torch.zeros((rows, 1), **long), torch.zeros(rows, **long),
                                          torch.zeros(rows, **long))
        self.col, self.step, self.version = torch.zeros(1, **long), torch.zeros(1, **long), torch.zeros((), **long)
        self.uniforms = torch.zeros((rows, max_new), device=device)
        self.tokens, self.alive, self.versions = (torch.zeros((rows, max_new), **long) for _ in range(3))
        self.log_probs = torch.zeros((rows, max_new), device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.eos = torch.tensor(eos, **long)  # a graph reads it where it was recorded: kept here
        self.frame = Frame(self.col)
        self.cache = DynamicCache()  # the model's layers write through it into the buffers
        self.cache.layers = [StaticLayer(k, v, self.frame) for k, v in zip(self.k, self.v)]
        self.shape = shape

    def release(self) -> None:
        """Free the buffers and graphs."""
        self.shape, self.recorded, self.seen, self.pool = None, {}, {}, None
        for name in ("k", "v", "mask", "cache", "uniforms", "tokens", "alive", "versions", "log_probs", "eos"):
            self.__dict__.pop(name, None)

    def decode(self, engine, logits, prefill_layers, repeats: int, mask, next_pos, uniforms, params, padded: bool):
        """Decode a chunk whose prefill gave `logits` [rows, V] and `prefill_layers` (keys/values of its distinct
        prompts, each repeated `repeats` times); `mask` [rows, P] its prompts' mask, `next_pos` [rows, 1],
        `uniforms` [rows, max_new] or None (greedy), `padded`: whether any prompt is (the host knows) -> what
        HFRolloutEngine._generate_chunk returns."""
        model, device = engine.model, logits.device
        rows, width = mask.shape
        for k, v, layer in zip(self.k, self.v, prefill_layers):
            for buf, t in ((k, layer.keys), (v, layer.values)):
                buf[:rows, :, :width] = t.repeat_interleave(repeats, dim=0) if repeats > 1 else t
        self.mask[:rows] = False
        self.mask[:rows, 0, 0, :width] = mask.bool()
        row_padded = (mask == 0).any(-1)  # [rows], by row: whose prompt is padded
        self.pos[:rows], self.slots[:rows] = next_pos, torch.arange(rows, device=device)
        self.col.fill_(width)
        self.step.zero_()
        self.tokens[:rows] = engine.pad_token_id
        for t in (self.alive, self.versions, self.log_probs):
            t[:rows] = 0
        self.finished[:rows] = False
        if uniforms is not None:
            self.uniforms[:rows] = uniforms
        track = engine.weights_hook is not None
        captured = self.captured(device)
        sizes = buckets(rows)
        sampling = (params.greedy, params.temperature, params.top_k, params.top_p, params.logprobs, params.ignore_eos,
                    track, engine.pad_token_id)
        step_args = (params, track, engine.pad_token_id)
        self.version.fill_(engine.weights_version)
        self._sample(logits, rows, *step_args)  # step 0, from the prefill's logits
        checks = (engine.early_stop or engine.remove_padding) and not params.ignore_eos
        b, length = rows, 1
        for step in range(1, params.max_new_tokens):
            if checks and step % engine.stop_check_every == 0:
                # the check's one host read, as the eager loop's: the rows that go on, the columns holding a live
                # token, and (eager) whether a row that goes on is padded
                ended = self.finished[self.slots[:b]]
                reads = [(~ended).sum(), self.alive[:rows, :step].any(0).sum()]
                if not captured:
                    reads.append((~ended & row_padded[self.slots[:b]]).any().long())
                still, used, *kept_padded = torch.stack(reads).tolist()
                if still == 0:  # every row has ended: only padding is left
                    length = used if engine.early_stop else params.max_new_tokens
                    break
                smaller = bucket_for(still, sizes) if captured else still
                if engine.remove_padding and smaller < b:
                    self._shrink(b, smaller, ended, width + step)
                    b = smaller
                    if kept_padded:
                        padded = bool(kept_padded[0])
            length = step + 1
            engine._new_weights()  # the sequences in flight go on with them (their keys and values as they are)
            if track:
                self.version.fill_(engine.weights_version)
            self.frame.rows = b
            if captured:
                self.frame.window = min(_round_up(width + step), self.mask.shape[-1])
                self._replay(model, b, sampling, step_args)
            else:
                self.frame.window = width + step
                self._step(model, b, *step_args, masked=padded)
        versions = self.versions[:rows, :length].masked_fill(self.alive[:rows, :length] == 0, -1) if track else None
        return (self.tokens[:rows, :length].clone(), self.alive[:rows, :length].clone(),
                self.log_probs[:rows, :length].clone() if params.logprobs else None, ~self.finished[:rows], versions)

    def _shrink(self, b: int, smaller: int, ended, written: int) -> None:
        """Move the rows that go on to the front (then ended ones, filling a bucket): the batch is `smaller`."""
        keep = torch.argsort(ended.to(torch.uint8), stable=True)[:smaller]
        for buf in (*self.k, *self.v):
            buf[:smaller, :, :written] = buf[:b, :, :written].index_select(0, keep)
        self.mask[:smaller] = self.mask[:b].index_select(0, keep)
        for t in (self.pos, self.tok, self.slots):
            t[:smaller] = t[:b].index_select(0, keep)

    def _step(self, model, b: int, params, track: bool, pad: int, masked: bool = True) -> None:
        """One token for the first b rows: the forward of their last tokens, then their next ones sampled.
        masked=False: no row is padded, and eager attention reads only written columns: no mask (as the eager
        loop, and transformers, then do)."""
        self.mask[:b].index_fill_(3, self.col, True)
        out = model(input_ids=self.tok[:b, None],
                    attention_mask=self.mask[:b, :, :, :self.frame.window] if masked else None,
                    position_ids=self.pos[:b], use_cache=True, **{CACHE: self.cache})
        self.col.add_(1)
        self.pos[:b] += 1
        self._sample(out.logits[:, -1, :], b, params, track, pad)

    def _sample(self, logits, b: int, params, track: bool, pad: int) -> None:
        """The step's tokens of the first b rows from their `logits`, written at the step counter's column of the
        outputs (by row); rows that ended before get padding."""
        slots = self.slots[:b]
        at = (slots, self.step.expand(b))
        live = ~self.finished.index_select(0, slots)
        u = None if params.greedy else self.uniforms.index_select(0, slots).gather(1, at[1][:, None])[:, 0]
        tok, lp = next_tokens(logits, params, u, params.logprobs)
        tok = torch.where(live, tok, pad)
        self.tokens.index_put_(at, tok)
        self.alive.index_put_(at, live.long())
        if lp is not None:
            self.log_probs.index_put_(at, lp * live)
        if track:
            self.versions.index_put_(at, self.version.expand(b))
        if not params.ignore_eos:  # ended before, or an EOS now (an ended row's padding counts as either)
            self.finished.index_put_((slots,), ~live | torch.isin(tok, self.eos))
        self.tok[:b] = tok
        self.step.add_(1)

    def _replay(self, model, b: int, sampling, step_args) -> None:
        """The step as a graph: a bucket and window's first step runs eagerly (the warm-up a recording needs), its
        second is recorded, and every step from then replays the recording."""
        key = (sampling, b, self.frame.window)
        graph = self.recorded.get(key)
        if graph is None and self.failed is None and self.seen.get(key, 0) > 0:
            try:
                graph = self.recorded[key] = self._record(lambda: self._step(model, b, *step_args))
            except Exception as e:  # a step that cannot be recorded still decodes, eagerly
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"rollout.static_decoding: the decoding step could not be recorded as a CUDA graph "
                              f"({self.failed}); decoding goes on eagerly (rollout.enforce_eager=true skips "
                              "recording)", stacklevel=4)
        if graph is not None:
            graph.replay()
            return
        self.seen[key] = self.seen.get(key, 0) + 1
        with _side_stream(self.graph_type is None and self.failed is None), _uncached_autocast(self.k[0].device):
            self._step(model, b, *step_args)

    def _record(self, step):
        """A graph of `step` (recorded, not run); `graph_type(step)` where a test gives one."""
        if self.graph_type is not None:
            return self.graph_type(step)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA work (a checkpoint writer's copies) does not break the recording
        with _uncached_autocast(self.k[0].device), torch.cuda.graph(graph, pool=self.pool,
                                                                    capture_error_mode="thread_local"):
            step()
        return graph


def _round_up(columns: int) -> int:
    return -(-columns // COLUMNS) * COLUMNS


@contextlib.contextmanager
def _side_stream(cuda: bool):
    """Run on a side stream: a graph's warm-up must not run on the stream it is then recorded from."""
    if not cuda:
        yield
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def _uncached_autocast(device: torch.device):
    """The autocast in force, its weight cache off: a cached cast is freed when the outer autocast ends, and a
    recorded graph would read it after."""
    kind = device.type
    return torch.autocast(kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind),
                          cache_enabled=False)
