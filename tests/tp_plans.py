"""Tensor-parallel plans of a user's own (actor.tensor_parallel_plan, NeMo-RL's custom_parallel_plan), in NeMo-RL's
form: module paths with `*` for any layer, the output layer's logits left a DTensor. For tests/tp_ranks.py."""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def qwen_plan():
    """A Qwen2 model's plan, as a function of no arguments."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


# the layers split, the output layer whole: refused (posttrain takes log-probs from each rank's vocabulary columns)
whole_head_plan = {k: v for k, v in qwen_plan().items() if k not in ("lm_head", "model.embed_tokens")}

not_a_plan = ["model.layers.*.mlp.up_proj"]
