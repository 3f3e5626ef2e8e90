"""How a batch is cut into the micro-batches that the log-prob, value and training passes run, planned from
the batch's CPU tensors before anything moves to the device.

`row_stats` reads what the plan needs of every row in one host read (lengths, groups, where each row's
padding is, which rows hold the same prompt); `micro_batches` orders and cuts the rows, trims the columns
that are padding in every row of a micro-batch and works out its shared prompts and whether its positions
hold padding, all in Python. A `Micro` moves to the device once (`Micro.to`: from pinned memory,
non-blocking, on CUDA), and the passes read nothing back to learn its shape.

`remove_padding` (model.use_remove_padding, on by default; off for debugging): rows are ordered by
length before they are cut into micro-batches, and a micro-batch drops the columns that are padding in
every row (left of the longest prompt, right of the longest response), so no forward runs on them.
Its results do not change, nor do `share_prompt`'s (forward.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FULL_WIDTH = ("input_ids", "attention_mask", "position_ids")  # [N, P+R]; the other 2-D fields are [N, R, ...]
NONE = 1 << 40  # a row without such a position (above any token id)


@dataclass(frozen=True)
class SharedPrompts:
    """The distinct prompts of a micro-batch's rows: `inverse` [n] row -> distinct prompt, `first` [U] a row
    of each; `blocks`: the rows are U runs of one size, in order (forward.py repeats the prompts' cache);
    `first_rows`: `first` on the host (a vision model's pass picks those rows' images without a read back)."""

    inverse: torch.Tensor
    first: torch.Tensor
    blocks: bool
    first_rows: tuple = ()

    @property
    def count(self) -> int:
        return self.first.shape[0]


@dataclass(frozen=True)
class Layout:
    """What the plan knows of a micro-batch: its distinct prompts when some repeat (None: none repeat);
    whether the plain forward's positions ([:, :-1]) hold padding, whether the distinct prompts' do, and
    whether all its positions do (the last one too: the critic's forward runs them all)."""

    prompts: SharedPrompts | None
    padded: bool
    padded_prompts: bool
    padded_all: bool = True


class Micro:
    """One planned micro-batch: `data` (the batch's rows `rows`, its kept columns), its `layout`, `picked`
    (`rows` as a list), `counts` (its response mask's valid tokens and rows with one: what statistics over
    them need without a read, algorithms/picks.py); its fields read through (mb.input_ids, len(mb), ...)."""

    __slots__ = ("data", "rows", "layout", "picked", "counts")

    def __init__(self, data, rows: torch.Tensor, layout: Layout | None, picked: list[int],
                 counts: tuple[int, int] | None = None):
        self.data, self.rows, self.layout, self.picked, self.counts = data, rows, layout, picked, counts

    def __getattr__(self, name):
        return getattr(self.data, name)

    def __len__(self) -> int:
        return len(self.data)

    def to(self, device) -> Micro:
        """Every tensor on `device`, each moved once: from pinned memory and non-blocking when it is CUDA
        (the host queues the copies and goes on), a plain `.to` otherwise (nothing moves on the CPU)."""
        device = torch.device(device)
        pin = device.type == "cuda" and torch.cuda.is_available()

        def move(t):
            if not isinstance(t, torch.Tensor) or t.device == device:
                return t
            return (t.pin_memory() if pin and t.device.type == "cpu" else t).to(device, non_blocking=pin)

        data = dataclasses.replace(self.data, **{f.name: move(getattr(self.data, f.name))
                                                 for f in dataclasses.fields(self.data)
                                                 if isinstance(getattr(self.data, f.name), torch.Tensor)})
        layout, prompts = self.layout, self.layout.prompts if self.layout is not None else None
        if prompts is not None:
            layout = dataclasses.replace(layout, prompts=SharedPrompts(move(prompts.inverse), move(prompts.first),
                                                                       prompts.blocks, prompts.first_rows))
        return Micro(data, move(self.rows), layout, self.picked, self.counts)


@dataclass(frozen=True)
class Rows:
    """What the plan needs of each row of a batch, as Python lists (`row_stats`)."""

    prompt_len: list[int]  # real prompt tokens
    tokens: list[float]  # response_mask's sum: the loss's tokens
    real: list[int]  # real tokens, prompt and response
    group: list[int]
    first: list[int]  # the first real prompt column (P: none)
    end: list[int]  # one past the last response column that is real or in the mask (0: none)
    prompt_run: list[int]  # real prompt positions at the prompt's end, without a gap
    response_run: list[int]  # real response positions from its start, without a gap
    key: list[int] | None  # rows of one key hold the same prompt columns (ids and mask); a key's order is theirs
    valid: list[int]  # response_mask's nonzero entries

    def counts(self, rows) -> tuple[int, int]:
        """The valid tokens of rows `rows` and how many of them have one."""
        return sum(self.valid[i] for i in rows), sum(1 for i in rows if self.valid[i] > 0)

    def units(self, rows, loss_agg_mode: str) -> float:
        """`actor.loss_units` of rows `rows`: their valid tokens (token-mean), else their rows with one."""
        if loss_agg_mode == "token-mean":
            return float(sum(self.tokens[i] for i in rows))
        return float(sum(1 for i in rows if self.tokens[i] > 0))


def row_stats(batch) -> Rows:
    """`Rows` of `batch`, computed on its tensors (on the CPU, where the driver's batch lives) and read at
    once: one host read, and one `unique` for the prompts' keys."""
    width = batch.prompt_width
    real = batch.attention_mask != 0
    prompt, response = real[:, :width], real[:, width:]
    ids = batch.input_ids[:, :width]
    alive = (batch.response_mask != 0) | response
    r = batch.response_length
    columns = [
        prompt.sum(-1), batch.response_mask.sum(-1), real.sum(-1), batch.group,
        torch.where(prompt.any(-1), prompt.int().argmax(-1), width),
        torch.where(alive.any(-1), r - alive.flip(-1).int().argmax(-1), 0),
        prompt.flip(-1).int().cumprod(-1).sum(-1), response.int().cumprod(-1).sum(-1),
        torch.where(prompt, NONE, ids).amin(-1), torch.where(prompt, -NONE, ids).amax(-1),  # padding's ids
        (batch.response_mask != 0).sum(-1),
    ]
    # rows of equal prompt columns, ranked as torch.unique orders them (lexicographically); with images, equal
    # tokens are not an equal prompt (the same question about another image): only a group's rows share one
    columns_of_key = [ids, batch.attention_mask[:, :width].to(ids.dtype)]
    if any(getattr(batch, "vision", None) or ()):
        columns_of_key.append(batch.group[:, None].to(ids.dtype))
    _, key = torch.unique(torch.cat(columns_of_key, 1), dim=0, return_inverse=True)
    table = torch.stack([c.double() for c in [*columns, key]], 1).tolist() if len(batch) else []
    cols = list(zip(*table)) if table else [()] * (len(columns) + 1)
    ints = [[int(v) for v in c] for c in cols]
    low, high = ints[8], ints[9]
    # every padding position holds one id: then rows equal on a micro-batch's kept columns are equal whole
    canonical = max(high, default=-NONE) <= min(low, default=NONE)
    return Rows(ints[0], list(cols[1]), ints[2], ints[3], ints[4], ints[5], ints[6], ints[7],
                ints[11] if canonical else None, ints[10])


def spans(tokens: list[int], size: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Consecutive runs [start, end) of rows: `size` rows each, or with a token
    budget (`max_tokens`, verl's use_dynamic_bsz) as many rows as hold at most
    that many real tokens together (`tokens[i]` for row i); a row longer than
    the budget runs alone."""
    if max_tokens is None:
        return [(s, min(s + size, len(tokens))) for s in range(0, len(tokens), size)]
    out, start, used = [], 0, 0
    for i, t in enumerate(tokens):
        if i > start and used + t > max_tokens:
            out.append((start, i))
            start, used = i, 0
        used += t
    if start < len(tokens):
        out.append((start, len(tokens)))
    return out


def memory_token_budget(free_bytes: int, vocab: int, hidden: int, intermediate: int, layers: int, kv_width: int,
                        compute_bytes: int, fraction: float = 0.5) -> int:
    """The tokens (prompt and response, as `spans` counts them) a no-gradient log-prob micro-batch may hold in
    `free_bytes` of device memory:

        per_token = (4 + c) V + c (4 H + 3 I) + 2 c L K,   budget = max(1, floor(fraction x free_bytes / per_token))

    c = compute_bytes (2 for bf16), V the vocabulary, H the hidden size, I the MLP's, L the layers, K the
    key/value width (key/value heads x head size). The terms: the logits in the compute dtype and their float32
    copy, which the log-probs read whole; one layer's activations (no gradient: a layer's are freed as the next
    runs): the residual stream, its norm, the attention's input and output, the MLP's gate, up and product; a
    shared prompt's key/value cache over every layer. Every token is counted as a response token (only those
    get logits: an overestimate); `fraction` leaves room for what is not counted (attention workspaces, the
    4-D mask, the allocator's fragmentation).

    Example: Qwen2.5-7B in bf16 (V 152064, H 3584, I 18944, L 28, K 512): 1,112,064 bytes a token; 60 GiB
    free, half of it used -> 28,966 tokens.
    """
    c = compute_bytes
    per_token = (4 + c) * vocab + c * (4 * hidden + 3 * intermediate) + 2 * c * layers * kv_width
    return max(1, int(fraction * free_bytes) // per_token)


def micro_batches(batch, size: int, remove_padding: bool, max_tokens: int | None = None, rows: Rows | None = None,
                  subset: range | None = None) -> list[tuple[torch.Tensor, Micro]]:
    """-> [(row indices into batch, micro-batch)]: consecutive chunks of `size`
    rows (or of at most `max_tokens` real tokens, prompt + response), with
    remove_padding chunks of length-ordered rows, trimmed. `rows`: the batch's
    `row_stats` (read here when not given); `subset`: the batch's rows to cut
    (a mini-batch's; all by default)."""
    stats = rows if rows is not None else row_stats(batch)
    picked = list(subset if subset is not None else range(len(batch)))
    if remove_padding:  # alike lengths side by side, samples of one prompt together
        picked.sort(key=lambda i: (-stats.prompt_len[i], stats.group[i], -stats.tokens[i], i))
    tokens = [stats.real[i] for i in picked]
    cuts = as_many_as_the_others(spans(tokens, size, max_tokens), tokens)
    return agree_on_forwards([_micro(batch, picked[a:b], stats, remove_padding) for a, b in cuts])


def _group_device():
    """Where a collective of the default process group runs (None: there is none, or it is this process alone)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def as_many_as_the_others(cuts: list[tuple[int, int]], tokens: list[int]) -> list[tuple[int, int]]:
    """With several workers in a process group (FSDP2: every forward and backward of a sharded model gathers or
    reduces with the others), every worker must cut its rows into as many micro-batches as the one with the most
    (a token budget, use_dynamic_bsz, cuts rows of other lengths into other counts): the others split their
    micro-batch of most tokens in two, by rows, until they have as many (verl's dynamic batching does so too).
    The loss weights do not change: they are per row. Alone the cuts stay as they are."""
    device = _group_device()
    if device is None:
        return cuts
    import torch.distributed as dist

    most = torch.tensor([len(cuts)], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    cuts = list(cuts)
    while len(cuts) < int(most):
        splittable = [c for c in cuts if c[1] - c[0] > 1]
        if not splittable:
            raise RuntimeError(f"this worker's {sum(b - a for a, b in cuts)} rows cannot make the {int(most)} "
                               "micro-batches another worker's make: give the workers equal shares of rows")
        a, b = max(splittable, key=lambda c: sum(tokens[c[0]:c[1]]))
        k = cuts.index((a, b))
        cuts[k:k + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return cuts


def agree_on_forwards(micros: list[tuple[torch.Tensor, Micro]]) -> list[tuple[torch.Tensor, Micro]]:
    """With several workers in a process group (FSDP2: every forward of a sharded model gathers its layers with
    the others), the k-th micro-batch of every worker must run the same number of forwards. A micro-batch whose
    rows share prompts runs two (the distinct prompts, then the responses over their cache: forward.py), one
    whose rows do not runs one; workers with rows of their own can differ, and would wait on each other for
    ever. So the workers agree (one all-reduce of a flag per micro-batch): where one of them runs a single
    forward, all do. Alone (no process group) the plan stays as it is."""
    device = _group_device()
    if device is None or not micros:
        return micros
    import torch.distributed as dist

    two = [m.layout is not None and m.layout.prompts is not None and m.response_length > 1 for _, m in micros]
    agreed = torch.tensor(two, dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    out = []
    for (index, m), mine, both in zip(micros, two, agreed.tolist()):
        if m.layout is None or (mine and not both):  # one plain forward (a plan without a layout: found on the
            layout = m.layout or Layout(None, True, True, True)  # device otherwise; here none, padding assumed)
            m = Micro(m.data, m.rows, dataclasses.replace(layout, prompts=None), m.picked, m.counts)
        out.append((index, m))
    return out


def _micro(batch, idx: list[int], stats: Rows, remove_padding: bool) -> tuple[torch.Tensor, Micro]:
    width, length = batch.prompt_width, batch.response_length
    left, keep = 0, length
    if remove_padding:  # a pass needs the last prompt position (it predicts the first token)
        left = min(min(stats.first[i] for i in idx), width - 1)
        keep = max(1, max(stats.end[i] for i in idx))
    index = torch.tensor(idx, dtype=torch.long)
    cut = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            value = value[index]
            if value.dim() >= 2 and (left, keep) != (0, length):  # [N, R, k]: the teacher's top-k, cut as [N, R]
                value = value[:, left:width + keep] if f.name in FULL_WIDTH else value[:, :keep]
            cut[f.name] = value
        elif isinstance(value, list):
            cut[f.name] = [value[i] for i in idx] if value else []
    data = dataclasses.replace(batch, **cut)
    if stats.key is None:  # padding of several ids: the passes find the shared prompts themselves
        return index, Micro(data, index, None, idx, stats.counts(idx))
    prompt_width = width - left
    padded_prompts = any(stats.prompt_run[i] < prompt_width for i in idx)
    padded = padded_prompts or any(stats.response_run[i] < keep - 1 for i in idx)
    padded_all = padded_prompts or any(stats.response_run[i] < keep for i in idx)
    layout = Layout(_shared([stats.key[i] for i in idx]), padded, padded_prompts, padded_all)
    return index, Micro(data, index, layout, idx, stats.counts(idx))


def _shared(keys: list[int]) -> SharedPrompts | None:
    """The distinct prompts of rows of prompt keys `keys`, as forward.py found them with unique_consecutive
    (runs of one size: in order) or else unique (sorted); None when none repeats."""
    starts = [i for i in range(len(keys)) if i == 0 or keys[i] != keys[i - 1]]
    sizes = [b - a for a, b in zip(starts, starts[1:] + [len(keys)])]
    blocks = all(s == sizes[0] for s in sizes)
    if blocks:
        inverse = [j for j, s in enumerate(sizes) for _ in range(s)]
        count = len(sizes)
    else:
        distinct = sorted(set(keys))
        rank = {k: j for j, k in enumerate(distinct)}
        inverse = [rank[k] for k in keys]
        count = len(distinct)
    if count == len(keys):
        return None
    first = [0] * count
    for row, j in enumerate(inverse):  # the last row of each, as a scatter of the row numbers leaves it
        first[j] = row
    return SharedPrompts(torch.tensor(inverse, dtype=torch.long), torch.tensor(first, dtype=torch.long), blocks,
                         tuple(first))
