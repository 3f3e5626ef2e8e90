"""What each rank of tests/test_tensor_parallel.py runs, in processes of its own (gloo, float32, one thread), and
the launcher: spawn(fn, world, *args) -> each rank's result (what fn returned, saved by torch.save)."""

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = Path(__file__).resolve().parent


def _run(rank: int, world: int, workdir: str, fn, args, backend: str) -> None:
    sys.path.insert(0, str(TESTS))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(backend, init_method=f"file://{workdir}/init", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        torch.save(out, f"{workdir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args, backend: str = "gloo") -> list:
    """Run fn(rank, world, *args) in `world` fresh processes joined in one process group (gloo; nccl: one GPU a rank).
    -> their results, by rank; AssertionError naming the ranks that failed."""
    with tempfile.TemporaryDirectory(prefix="tp-ranks-") as workdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_run, args=(r, world, workdir, fn, args, backend)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        assert not failed, f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]})"
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def stats_case(seed: int = 0, vocab: int = 7):
    """Random logits [3, 5, vocab], tokens [3, 5], and the weights of log p and entropy in a loss."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, vocab, generator=g) * 3
    tokens = torch.randint(0, vocab, (3, 5), generator=g)
    return logits, tokens, torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)


def stats_rank(rank: int, world: int, vocab: int):
    """This rank's columns of stats_case's logits through vocab_parallel_stats: -> (log p, entropy, the gradient of
    sum(a log p + b entropy) with respect to its columns, its first column)."""
    from posttrain.training.tensor_parallel import TensorParallel, vocab_parallel_stats, vocab_share

    logits, tokens, a, b = stats_case(vocab=vocab)
    start, width = vocab_share(vocab, world, rank)
    mine = logits[..., start:start + width].clone().requires_grad_(True)
    tp = TensorParallel(dist.group.WORLD, world, rank, vocab, start, width)
    log_p, entropy = vocab_parallel_stats(mine, tokens, tp)
    (a * log_p + b * entropy).sum().backward()
    return log_p.detach(), entropy.detach(), mine.grad, start


# model_type -> its config's extra settings, for a seeded random model of each family with a plan
FAMILIES = {"llama": {}, "qwen3": {"head_dim": 16},
            "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}}


def topk_rank(rank: int, world: int, vocab: int, k: int):
    """This rank's columns of stats_case's logits: -> (vocab_parallel_topk's log-probs and ids; vocab_parallel_at's
    log p at [token, the top-k ids] and entropy; the gradient of sum(a . log p at them + b entropy) with respect to
    this rank's columns; its first column)."""
    from posttrain.training.tensor_parallel import (TensorParallel, vocab_parallel_at, vocab_parallel_topk,
                                                    vocab_share)

    logits, tokens, a, b = stats_case(vocab=vocab)
    start, width = vocab_share(vocab, world, rank)
    mine = logits[..., start:start + width].clone().requires_grad_(True)
    tp = TensorParallel(dist.group.WORLD, world, rank, vocab, start, width)
    values, ids = vocab_parallel_topk(mine.detach(), k, tp)
    at, entropy = vocab_parallel_at(mine, torch.cat([tokens.unsqueeze(-1), ids], -1), tp)
    (a.unsqueeze(-1) * at).sum().backward(retain_graph=True)
    (b * entropy).sum().backward()
    return values, ids, at.detach(), entropy.detach(), mine.grad, start


def tiny_case(family: str = "tiny"):
    """The embedded tiny model ("tiny") or a seeded random model of `family` (FAMILIES: 2 layers, hidden 64, 4 heads,
    2 of keys and values), vocabulary 259 (split 130 + 129 over two ranks), and a batch of 8 rows (4 prompts x 2
    samples) with random advantages."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models import shipped
    from posttrain.models.loader import load_model
    from test_gpu_passes import batch_of

    if family == "tiny":
        model = load_model(shipped.embedded_model())
    else:
        config = AutoConfig.for_model(family, vocab_size=259, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, **FAMILIES[family])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
    batch = batch_of(259, rows=8, n=2)
    batch.advantages = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(3)) * \
        batch.response_mask
    return model, batch


def update_settings(fused: bool = False):
    from posttrain.training.actor import UpdateSettings

    # two mini-batches of 4 rows, micro-batches of 2, an entropy bonus (its gradient through the split vocabulary)
    return UpdateSettings(mini_batch_size=4, micro_batch_size=2, entropy_coeff=0.01, grad_clip=1.0,
                          fused_kernels=fused)


def whole(model) -> dict:
    """The model's state dict, every DTensor gathered whole."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def local_of(t):
    """A DTensor's local shard, or the tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(model) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard)."""
    return sum(local_of(p).nbytes for p in model.parameters())


def update_rank(rank: int, world: int, tp_size: int, cases=(("tiny", {}),), device: str = "cpu") -> list:
    """one_update for each (family, options) of `cases` in turn, in the same processes: -> their results."""
    return [one_update(rank, world, tp_size, family, device, **options) for family, options in cases]


def one_update(rank: int, world: int, tp_size: int, family: str = "tiny", device: str = "cpu", fused: bool = False,
               sequence_parallel: bool = False, plan: str | None = None, ulysses: int = 1):
    """One update (update_policy, SGD) of tiny_case's model split over a (world / tp_size) x tp_size mesh (data
    parallel x TP; FSDP2 over the data-parallel ranks when there are several) on `device` (cuda: this rank's GPU);
    `fused`: log-probs from the hidden states a chunk at a time (training/fused.py); `sequence_parallel`: the
    activations between the matmuls split over the positions too; `plan`: a custom plan's name (tests/tp_plans.py)
    in place of posttrain's; `ulysses`: groups of that many TP groups split each sequence's positions (Ulysses,
    FSDP2 over them too): -> (its metrics, the whole weights after it (on
    the CPU), the bytes of parameters this rank holds, the whole model's)."""
    from torch.distributed.device_mesh import init_device_mesh

    from posttrain.training.actor import loss_units, update_policy
    from posttrain.training.parallelize import decoder_layers, parallelize
    from posttrain.training.tensor_parallel import apply_tensor_parallel
    from posttrain.worker.models import sequence_parallel as sequence_parallel_group

    model, batch = tiny_case(family)
    model = model.to(torch.device(device, torch.cuda.current_device()) if device == "cuda" else device)
    whole_bytes = local_bytes(model)
    fsdp_size, dp_size = world // tp_size, world // tp_size // ulysses
    mesh = init_device_mesh(device, (fsdp_size, tp_size), mesh_dim_names=("dp", "tp"))
    tp = apply_tensor_parallel(model, mesh["tp"], sequence_parallel, plan)
    sp = sequence_parallel_group(ulysses, rank, world, [model], tp_size) if ulysses > 1 else None
    s = update_settings(fused)
    totals = None
    if fsdp_size > 1:
        parallelize(model, mesh["dp"])
    if dp_size > 1:
        dp = mesh["dp"].get_local_rank() // ulysses
        # each data-parallel rank its share of every mini-batch; the whole mini-batch's units beside them
        minis = [list(range(k, k + s.mini_batch_size)) for k in range(0, len(batch), s.mini_batch_size)]
        share = s.mini_batch_size // dp_size
        totals = [loss_units(batch.response_mask[m], s.loss_agg_mode) for m in minis]
        batch = batch.select([i for m in minis for i in m[dp * share:(dp + 1) * share]])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    seen = []  # (positions this rank's first norm ran on, the whole sequence's) per forward
    norm = decoder_layers(model)[0].input_layernorm
    hook = norm.register_forward_hook(lambda m, args, out: seen.append(
        (local_of(out).shape[1], out.shape[1])))
    metrics = update_policy(model, optimizer, batch, s, mini_totals=totals, world_size=fsdp_size, sp=sp, tp=tp)
    hook.remove()
    metrics["norm_positions"] = seen[0]
    return metrics, {k: v.cpu() for k, v in whole(model).items()}, local_bytes(model), whole_bytes


def plan_errors(rank: int, world: int) -> list[str]:
    """What apply_tensor_parallel says of tests/tp_plans.py's bad plans and of a module that is not there."""
    from torch.distributed.device_mesh import init_device_mesh

    from posttrain.errors import ConfigError
    from posttrain.training.tensor_parallel import apply_tensor_parallel

    out = []
    for plan in ("tp_plans.whole_head_plan", "tp_plans.not_a_plan", "tp_plans_missing.plan"):
        model, _ = tiny_case()
        try:
            apply_tensor_parallel(model, init_device_mesh("cpu", (world,)), plan=plan)
            out.append("")
        except (ValueError, ConfigError) as e:
            out.append(str(e))
    return out


def topk_pass_rank(rank: int, world: int, tp_size: int, ulysses: int) -> dict:
    """Distillation's training pass (logprobs.topk_stats) and the log-prob pass with entropy on tiny_case's batch:
    the model split over TP groups of `tp_size` and Ulysses groups of `ulysses` against the whole model in this
    process. -> the largest difference of each output."""
    from torch.distributed.device_mesh import init_device_mesh

    from posttrain.training.logprobs import PassOptions, log_probs_and_entropy, topk_stats
    from posttrain.training.tensor_parallel import apply_tensor_parallel
    from posttrain.worker.models import sequence_parallel as sequence_parallel_group

    whole, batch = tiny_case()
    split, _ = tiny_case()
    tp = apply_tensor_parallel(split, init_device_mesh("cpu", (world // tp_size, tp_size),
                                                       mesh_dim_names=("dp", "tp"))["tp"])
    sp = sequence_parallel_group(ulysses, rank, world, [split], tp_size) if ulysses > 1 else None
    ids = torch.randint(0, 259, (*batch.responses.shape, 4), generator=torch.Generator().manual_seed(5))
    out = {}
    with torch.no_grad():
        want = topk_stats(whole, batch, "cpu", 0.7, PassOptions(), ids)
        got = topk_stats(split, batch, "cpu", 0.7, PassOptions(sp=sp, tp=tp), ids)
        for name, a, b in zip(("log_prob", "entropy", "topk", "neg_entropy"), want, got):
            mask = batch.response_mask if a.dim() == 2 else batch.response_mask[..., None]
            out[name] = float(((a - b) * mask).abs().max())
        want = log_probs_and_entropy(whole, batch, "cpu", 0.7, PassOptions(share_prompt=False))
        got = log_probs_and_entropy(split, batch, "cpu", 0.7, PassOptions(share_prompt=False, sp=sp, tp=tp))
        for name, a, b in zip(("pass_log_prob", "pass_entropy"), want, got):
            out[name] = float(((a - b) * batch.response_mask).abs().max())
    return out


def teacher_group_rank(rank: int, world: int) -> dict:
    """A teacher split at TP=world over workers that each hold rows of their own (the policy unsplit): its top-k
    and log-prob passes through passes.over_teacher_group (every worker's rows gathered, run, each keeping its own:
    3 rows on rank 0, 2 on the others, other widths) against the whole teacher on this rank's rows. -> the largest
    difference of each output, and whether the top-k ids agree."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from posttrain.training.logprobs import PassOptions, compute_log_probs, compute_topk_log_probs
    from posttrain.training.tensor_parallel import apply_tensor_parallel
    from posttrain.worker.passes import over_teacher_group
    from test_gpu_passes import batch_of

    whole, _ = tiny_case()
    split, _ = tiny_case()
    tp = apply_tensor_parallel(split, init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))["tp"])
    batch = batch_of(259, rows=3 if rank == 0 else 2, n=1, prompt_width=7 - rank, response_width=9 - 2 * rank,
                     seed=rank)
    spec = SimpleNamespace(sequence_parallel=1, tensor_parallel=1)
    want = compute_topk_log_probs(whole, batch, 4, 2)
    got = over_teacher_group(spec, batch, tp, 0, lambda rows: compute_topk_log_probs(
        split, rows, 4, 2, options=PassOptions(tp=tp)))
    real = batch.response_mask.bool()
    out = {"log_prob": float((want[0] - got[0])[real].abs().max()),
           "topk": float((want[1] - got[1])[real].abs().max()),
           "ids_equal": bool(torch.equal(want[2][real], got[2][real])), "shape": tuple(got[1].shape)}
    want = compute_log_probs(whole, batch, 2)[0]
    got = over_teacher_group(spec, batch, tp, 0, lambda rows: (
        compute_log_probs(split, rows, 2, options=PassOptions(tp=tp))[0],))[0]
    out["pass_log_prob"] = float((want - got)[real].abs().max())
    return out


def plan_rank(rank: int, world: int) -> list:
    """microbatch.micro_batches on rows of this rank's own (rank 0: 4 prompts x 2 samples; rank 1: 8 prompts of
    one sample, other lengths) with a token budget: -> [(rows, whether it runs the shared-prompt forwards)] per
    micro-batch, and what each would be alone."""
    from posttrain.training.microbatch import micro_batches
    from test_gpu_passes import batch_of

    batch = batch_of(259, rows=8, n=2 if rank == 0 else 1, prompt_width=7, response_width=9, seed=rank)

    def plan():
        return [(m.picked, m.layout is not None and m.layout.prompts is not None and m.response_length > 1)
                for _, m in micro_batches(batch, 4, True, max_tokens=40 if rank == 0 else 24)]

    agreed = plan()
    import posttrain.training.microbatch as mb  # alone: the plan without the other worker

    group, mb._group_device = mb._group_device, lambda: None
    try:
        alone = plan()
    finally:
        mb._group_device = group
    return agreed, alone


def sft_case():
    """The embedded tiny model and a supervised batch as data.sft.collate makes one: 6 right-padded rows of 4 to 11
    tokens (vocabulary 259), labels -100 on each row's prompt (its first 3 tokens) and on the padding."""
    from posttrain.models import shipped
    from posttrain.models.loader import load_model

    g = torch.Generator().manual_seed(5)
    lengths = [11, 4, 9, 7, 10, 6]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = torch.randint(3, 259, (n,), generator=g), 1
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :3] = -100
    return load_model(shipped.embedded_model()), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft_settings():
    from posttrain.training.sft import SFTSettings

    return SFTSettings(micro_batch_size=2, grad_clip=0.5)  # three micro-batches; the clip acts


def sft_rank(rank: int, world: int, tp_size: int, cases=({},)) -> list:
    """For each options of `cases` (fused: the fused path; ulysses: groups of that many TP groups split the
    positions, FSDP2 over them): one sft_update (SGD) of sft_case's model split over TP groups of `tp_size`
    (every rank the whole batch), then nll_of of the batch: -> [(the update's metrics, the validation (sum,
    tokens), the whole weights after it)]."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    from posttrain.training.parallelize import parallelize
    from posttrain.training.sft import nll_of, sft_update
    from posttrain.training.tensor_parallel import apply_tensor_parallel
    from posttrain.worker.models import sequence_parallel as sequence_parallel_group

    out = []
    for options in cases:
        model, batch = sft_case()
        ulysses, settings = options.get("ulysses", 1), replace(sft_settings(), fused=options.get("fused", False))
        mesh = init_device_mesh("cpu", (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        tp = apply_tensor_parallel(model, mesh["tp"])
        sp = sequence_parallel_group(ulysses, rank, world, [model], tp_size) if ulysses > 1 else None
        if world // tp_size > 1:
            parallelize(model, mesh["dp"])
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        metrics = sft_update(model, optimizer, batch, settings, world_size=world // tp_size, sp=sp, tp=tp)
        out.append((metrics, nll_of(model, batch, settings, sp=sp, tp=tp), whole(model)))
    return out
