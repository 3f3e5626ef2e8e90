"""Tensor parallelism for a model that knows nothing of it: each decoder layer's matmuls split over the ranks of a
TP group (Megatron's layout, through torch's DTensor `parallelize_module`), the vocabulary split for the embedding
and the output layer, and the log-probs and entropy computed from each rank's share of the vocabulary.

    tp = apply_tensor_parallel(model, mesh["tp"])   # in place; -> TensorParallel (the group, this rank's columns)
    logits = model(ids).logits                      # [.., V/tp]: this rank's columns of the vocabulary
    log_p, entropy = vocab_parallel_stats(logits, tokens, tp)   # as log_softmax over the whole would give

The plan (PLANS, by the config's model_type): in each decoder layer the attention's q, k and v projections and the
MLP's gate and up projections are split by output features (column-wise: each rank holds its share of the heads
and of the intermediate features, and computes them from the whole input), the attention's output and the MLP's
down projection by input features (row-wise: each rank's partial product, summed over the group). One sum per
attention and one per MLP, forward and backward. The embedding is split by vocabulary rows (each rank looks up
the tokens it holds, the rest summed in), the output layer by vocabulary columns, its logits left split: a
[tokens, vocabulary] tensor is never whole on one rank. The norms, the rotary embedding and the attention itself
run on each rank as before, on its heads. A vocabulary that does not divide by the group's size is split as
torch.chunk splits it (the last rank holds fewer columns).

With sequence parallelism (`sequence_parallel=True`, Megatron's and NeMo-RL's name) the activations between the
matmuls are split too: the embedding's sum and each row-wise layer's are reduce-scattered over the sequence
(dimension 1) instead of all-reduced, the residual stream and the layers' norms run on each rank's share of the
positions, and the attention's and the MLP's input is gathered whole before their column-wise matmuls. The same
bytes move (a reduce-scatter and an all-gather make one all-reduce); each rank holds 1/tp of the activations
outside the matmuls. The final norm gathers its input first and runs whole, as the output layer reads it.

The model code is untouched: Hugging Face's attention reshapes its projections with -1 heads, so a rank's share of
the heads goes through as it is. Models whose layers hold their sizes elsewhere are refused by `check_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# the decoder layer's Linear layers, by the direction they are split
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
# norms over each head's features (Qwen3, Gemma3) that run on a rank's share of the heads: their weight is whole on
# every rank, its gradient summed over the group (the heads are dimension 2 of [batch, tokens, heads, head_dim])
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# model_type -> the families that share Llama's layer layout (Qwen3's and Gemma3's q/k norms act per head: each
# rank on its own heads; Gemma3's scaled embedding and its logits' soft cap act element by element)
PLANS = {"llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "llama", "gemma3_text": "llama"}


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group: the group, its size and rank, and the vocabulary's columns it holds
    ([start, start + width) of `vocab_size`)."""

    group: object
    size: int
    rank: int
    vocab_size: int
    start: int
    width: int


def vocab_share(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """(first column, columns) of `rank`'s share of a vocabulary split over `size` ranks as torch.chunk splits it
    (DTensor's Shard): ceil(V / size) each, the last ranks fewer (or none)."""
    chunk = -(-vocab_size // size)
    start = min(rank * chunk, vocab_size)
    return start, min(chunk, vocab_size - start)


def check_plan(config, size: int, custom: bool = False) -> list[str]:
    """What stops `config`'s model from being split over `size` ranks (`custom`: by a plan of the user's, for any
    family): -> the problems, one line each ([]: none)."""
    if getattr(config, "vision_config", None) is not None and not custom:
        return ["a vision-language model is not split yet; set the tensor-parallel size to 1"]
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(config, "model_type", None)
    if kind not in PLANS and not custom:
        return [f"model_type {kind!r} has no tensor-parallel plan (posttrain has plans for "
                f"{', '.join(sorted(PLANS))}); set the tensor-parallel size to 1"]
    out = []
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, key, None)
        if value is not None and value % size:
            out.append(f"the model's {key}={value} does not divide by the tensor-parallel size {size}")
    return out


def layer_plan(model: torch.nn.Module, sequence_parallel: bool = False) -> dict:
    """{module path: its ParallelStyle} for `model` (a causal LM laid out as Llama); `sequence_parallel`: the
    activations between the matmuls split over the sequence too (the module's docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    from posttrain.training.parallelize import decoder_layers

    layers = decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    # with sequence parallelism a row-wise sum is reduce-scattered over the positions, kept a DTensor for the norms
    split = dict(output_layouts=Shard(1), use_local_output=False) if sequence_parallel else {}
    gather = dict(desired_input_layouts=(Replicate(),), use_local_output=True)  # whole positions, a plain tensor
    plan = {}
    for i, layer in enumerate(layers):
        plan.update({f"{prefix}.{i}.{name}": ColwiseParallel() for name in COLWISE})
        plan.update({f"{prefix}.{i}.{name}": RowwiseParallel(**split) for name in ROWWISE})
        names = dict(layer.named_modules())
        plan.update({f"{prefix}.{i}.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for name in HEAD_NORMS if name in names})
        if sequence_parallel:  # the layer's own norms on each rank's positions; attention and MLP read them whole
            plan.update({f"{prefix}.{i}.{name}": SequenceParallel() for name, _ in layer.named_children()
                         if "norm" in name})
            plan[f"{prefix}.{i}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True)
            plan[f"{prefix}.{i}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), **gather)
    if sequence_parallel:  # the final norm gathers the positions and runs whole: the output layer reads them all
        base = prefix.rsplit(".", 1)[0] if "." in prefix else ""
        final = f"{base}.norm" if base else "norm"
        if final not in dict(model.named_modules()):
            raise ValueError(f"sequence parallelism needs the final norm at {final!r}, which "
                             f"{type(model).__name__} does not have; set sequence parallelism off")
        plan[final] = PrepareModuleInput(input_layouts=(Shard(1),), **gather)
    embed = next(name for name, module in model.named_modules() if module is model.get_input_embeddings())
    # vocabulary rows: each rank looks up its tokens, the rest summed in (scattered over the positions with SP)
    plan[embed] = RowwiseParallel(input_layouts=Replicate(), **split)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:  # a causal LM's output layer (a value model's one-number head stays whole)
        name = next(name for name, module in model.named_modules() if module is head)
        plan[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)  # logits stay split
    return plan


def custom_plan(spec: str, model: torch.nn.Module) -> dict:
    """The plan `spec` names ("package.module.NAME" or "file.py:NAME", NeMo-RL's custom_parallel_plan): a dict
    {module path (`*` for any one name): ParallelStyle}, or a function returning one (called with the model when
    it takes an argument). ValueError (ConfigError) naming what is wrong."""
    import inspect

    from torch.distributed.tensor.parallel import ParallelStyle

    from posttrain.tools.functions import import_function

    plan = import_function(spec, "the tensor-parallel plan", want_any=True)
    if callable(plan) and not isinstance(plan, dict):
        plan = plan(model) if inspect.signature(plan).parameters else plan()
    if not isinstance(plan, dict) or not plan or not all(isinstance(k, str) and isinstance(v, ParallelStyle)
                                                         for k, v in plan.items()):
        raise ValueError(f"the tensor-parallel plan '{spec}' is not a dict {{module path: ParallelStyle}} (nor a "
                         "function returning one); give one as NeMo-RL's examples/custom_parallel does")
    return plan


def _vocabulary_split(head: torch.nn.Module, spec: str) -> None:
    """A custom plan's output layer must split the vocabulary (its weight Shard(0)); its logits are handed on as
    this rank's columns (a DTensor output made local)."""
    from torch.distributed.tensor import DTensor, Shard

    weight = head.weight
    if not (isinstance(weight, DTensor) and weight.placements == (Shard(0),)):
        raise ValueError(f"the tensor-parallel plan '{spec}' leaves the output layer's vocabulary whole; posttrain "
                         "takes log-probs from each rank's columns: split it (ColwiseParallel(output_layouts="
                         "Shard(-1)) for the output layer)")
    head.register_forward_hook(lambda module, args, out: out.to_local() if isinstance(out, DTensor) else out)


def apply_tensor_parallel(model: torch.nn.Module, mesh, sequence_parallel: bool = False,
                          plan: str | None = None) -> TensorParallel:
    """Split `model`'s layers over `mesh` (a 1-D DeviceMesh: the TP group) in place, its tied output layer tied
    again (a value model's head, one number a position, stays whole on every rank); `sequence_parallel`: the
    activations between the matmuls split over the positions too; `plan`: a custom plan's name (custom_plan) in
    place of posttrain's. -> this rank's TensorParallel. Raises ValueError naming what does not divide
    (check_plan) or what is wrong with the plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    problems = check_plan(model.config, mesh.size(), custom=plan is not None)
    if problems:
        raise ValueError("; ".join(problems))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    parallelize_module(model, mesh, layer_plan(model, sequence_parallel) if plan is None else
                       custom_plan(plan, model))
    if plan is not None and head is not None:
        _vocabulary_split(head, plan)
    if tied:  # each style made its own Parameter of the one weight: one again, or the two would train apart
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    vocab = model.get_input_embeddings().weight.shape[0]
    rank = mesh.get_local_rank()
    start, width = vocab_share(vocab, mesh.size(), rank)
    return TensorParallel(mesh.get_group(), mesh.size(), rank, vocab, start, width)


def group_max(logits: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The largest logit at each position over the whole vocabulary (every rank's columns) [..]: the shift that
    keeps the exponentials of a split log-softmax finite (a rank with no columns adds -inf)."""
    top = logits.max(dim=-1).values if tp.width else logits.new_full(logits.shape[:-1], -torch.inf)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
    return top


class _VocabParallelStats(torch.autograd.Function):
    """log p at some token ids and the entropy, from each rank's columns of the logits; the gradient of both with
    respect to this rank's columns in closed form (no collective in the backward: the loss is the same on every
    rank of the group, and the output layer's backward sums the ranks' shares of the hidden states' gradient)."""

    @staticmethod
    def forward(ctx, logits, ids, tp: TensorParallel):
        top = group_max(logits, tp)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        local = ids - tp.start  # [.., m]
        mine = (local >= 0) & (local < tp.width)
        index = local.clamp(0, max(tp.width - 1, 0))
        picked = shifted.gather(-1, index) if tp.width else torch.zeros(ids.shape, dtype=logits.dtype,
                                                                        device=logits.device)
        # sum e^s, sum e^s s, and s at each id where this rank holds it: summed over the group
        sums = torch.cat([exp.sum(-1, keepdim=True), (exp * shifted).sum(-1, keepdim=True),
                          torch.where(mine, picked, 0.0)], -1)
        dist.all_reduce(sums, group=tp.group)
        z, weighted, picked = sums[..., 0], sums[..., 1], sums[..., 2:]
        log_z = z.log()
        entropy = log_z - weighted / z  # -sum p log p with p = e^s / z
        ctx.save_for_backward(shifted, log_z, entropy, index, mine)
        return picked - log_z.unsqueeze(-1), entropy

    @staticmethod
    def backward(ctx, grad_log_p, grad_entropy):
        shifted, log_z, entropy, index, mine = ctx.saved_tensors
        log_p = shifted - log_z.unsqueeze(-1)
        p = log_p.exp()
        # d log p(t) / dx_j = [j == t] - p_j;  d H / dx_j = -p_j (log p_j + H)
        grad = -p * grad_log_p.sum(-1, keepdim=True)
        if p.shape[-1]:
            grad = grad.scatter_add(-1, index, grad_log_p * mine.to(p.dtype))
        grad = grad - p * (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None


def vocab_parallel_at(logits: torch.Tensor, ids: torch.Tensor, tp: TensorParallel):
    """logits [.., V/tp] (this rank's columns, float32), ids [.., m] (of the whole vocabulary) -> (log p at each id
    [.., m], entropy [..]), as log_softmax over the whole vocabulary gives them, on every rank of the group, with
    their gradient."""
    return _VocabParallelStats.apply(logits, ids, tp)


def vocab_parallel_stats(logits: torch.Tensor, tokens: torch.Tensor, tp: TensorParallel):
    """logits [.., V/tp] (this rank's columns, float32), tokens [..] (ids of the whole vocabulary) -> (log p(token),
    entropy), each [..], as log_softmax over the whole vocabulary gives them, on every rank of the group."""
    log_p, entropy = _VocabParallelStats.apply(logits, tokens.unsqueeze(-1), tp)
    return log_p.squeeze(-1), entropy


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, tp: TensorParallel):
    """The k likeliest tokens from each rank's columns of the logits [.., V/tp]: -> (their log-probs [.., k], most
    likely first, their ids [.., k] in the whole vocabulary), the same on every rank (each rank's own k gathered,
    then the k best of them)."""
    top = group_max(logits, tp)
    z = (logits - top.unsqueeze(-1)).exp().sum(-1)
    dist.all_reduce(z, group=tp.group)
    log_p = logits - (top + z.log()).unsqueeze(-1)
    mine = min(k, tp.width)
    values = log_p.new_full((*log_p.shape[:-1], k), -torch.inf)
    ids = torch.zeros((*log_p.shape[:-1], k), dtype=torch.long, device=log_p.device)
    if mine:
        values[..., :mine], local = log_p.topk(mine, dim=-1)
        ids[..., :mine] = local + tp.start
    gathered_values = [torch.empty_like(values) for _ in range(tp.size)]
    gathered_ids = [torch.empty_like(ids) for _ in range(tp.size)]
    dist.all_gather(gathered_values, values.contiguous(), group=tp.group)
    dist.all_gather(gathered_ids, ids.contiguous(), group=tp.group)
    best, where = torch.cat(gathered_values, -1).topk(k, dim=-1)
    return best, torch.cat(gathered_ids, -1).gather(-1, where)


def clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over parameters that live on different meshes (a TP-split layer's DTensors
    beside the norms' plain tensors, which every rank of the group holds whole and alike): each mesh's norm taken
    whole, then combined. -> the total norm (a tensor). Parameters all of one kind go to torch's function."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for group in groups.values():
            for p in group:
                p.grad.mul_(coef)
    return total


__all__ = ["PLANS", "TensorParallel", "apply_tensor_parallel", "check_plan", "clip_grad_norm", "custom_plan",
           "layer_plan",
           "vocab_parallel_at", "vocab_parallel_stats", "vocab_parallel_topk", "vocab_share"]
