"""Two levers of the passes on a GPU, checked on the CPU against the paths they replace, bit for bit.

ref.cast_weights: the reference's nn.Linear weights stored in autocast's lower dtype at load (models/cast.py)
instead of cast from float32 at every forward. CPU autocast to bf16 runs `linear` in bf16 as a GPU's does, so
the reference's log-probs are compared under it, with the lever on and off, on the shipped tiny model (its
output layer tied to its embedding).

The entropy metric's pieces (training/logprobs.entropy_rows): 16 positions on the CPU, sized by memory on a GPU.
Each row's sum is its own, so any piece size gives the same bits (pieces of two rows or more: torch splits a
single output's reduction over threads, in another order, on the CPU and on a GPU alike).
"""

import warnings

import pytest
import torch

from posttrain.config.load import load_config
from posttrain.driver.batch import RolloutBatch
from posttrain.driver.settings import worker_spec
from posttrain.errors import ConfigError
from posttrain.models.cast import cast_linear_weights
from posttrain.runtime.syncs import HostSyncs
from posttrain.training import logprobs
from posttrain.training.logprobs import PassOptions, compute_log_probs, entropy_rows, log_prob_and_entropy
from posttrain.worker import models
from posttrain.worker.verbs import Worker

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def batch_of(vocab: int, rows: int = 12, n: int = 3, prompt_width: int = 7, response_width: int = 9, seed: int = 0):
    """n samples per prompt, left-padded prompts, right-padded responses of random lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros((rows, prompt_width + response_width), dtype=torch.long)
    mask, response_mask = torch.zeros_like(ids), torch.zeros((rows, response_width), dtype=torch.long)
    for p in range(rows // n):
        length = int(torch.randint(2, prompt_width + 1, (1,), generator=g))
        prompt = torch.randint(1, vocab, (length,), generator=g)
        for i in range(p * n, p * n + n):
            ids[i, prompt_width - length:prompt_width], mask[i, prompt_width - length:prompt_width] = prompt, 1
            r = int(torch.randint(1, response_width + 1, (1,), generator=g))
            ids[i, prompt_width:prompt_width + r] = torch.randint(1, vocab, (r,), generator=g)
            mask[i, prompt_width:prompt_width + r], response_mask[i, :r] = 1, 1
    return RolloutBatch(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        responses=ids[:, prompt_width:].clone(), response_mask=response_mask,
                        group=torch.arange(rows) // n, data_source=["d"] * rows)


def spec_of(model_dir, *more: str):
    """A CPU worker's spec whose policy computes in bf16 under autocast and whose loss needs the reference."""
    cfg = load_config(None, [f"model.path={model_dir}", "actor.mixed_precision.param_dtype=bfloat16",
                             "actor.use_kl_loss=true", *more])
    return worker_spec(cfg, str(model_dir), None, "cpu", 10)


def worker_of(spec) -> Worker:
    w = Worker(spec)
    w.setup()
    return w


class WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the dtype casts whose input is one of `params` (autocast's casts of the weights)."""

    def __init__(self, params):
        super().__init__()
        self.ptrs, self.count = {p.data_ptr() for p in params}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_cast_reference_gives_the_same_log_probs_bit_for_bit_without_casting_weights(trained_tiny_model_dir):
    on, off = spec_of(trained_tiny_model_dir), spec_of(trained_tiny_model_dir, "ref.cast_weights=false")
    assert on.ref.cast_weights is None and off.ref.cast_weights is False
    w_on, w_off = worker_of(on), worker_of(off)
    cast, plain = w_on.ref, w_off.ref
    inner = cast.model
    # the Linear weights (q/k/v with their biases) in bf16; the embedding and the norms float32, as autocast
    # computes them; the tied output layer a bf16 copy of its own, the embedding left float32
    assert inner.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert inner.layers[0].self_attn.q_proj.bias.dtype == torch.bfloat16
    assert inner.embed_tokens.weight.dtype == torch.float32 and inner.norm.weight.dtype == torch.float32
    assert cast.lm_head.weight.dtype == torch.bfloat16 and cast.lm_head.weight is not inner.embed_tokens.weight
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # off: the model as loaded
    assert torch.equal(cast.lm_head.weight, plain.lm_head.weight.to(torch.bfloat16))
    assert all(not p.requires_grad for p in cast.parameters())
    batch = batch_of(cast.config.vocab_size)
    with WeightCasts(cast.parameters()) as casts_on, HostSyncs() as syncs_on:
        lp_on = w_on.compute_log_probs(batch, "ref")
    with WeightCasts(plain.parameters()) as casts_off, HostSyncs() as syncs_off:
        lp_off = w_off.compute_log_probs(batch, "ref")
    assert torch.equal(lp_on, lp_off)
    assert lp_on.abs().sum() > 0 and lp_on.dtype == torch.float32
    assert casts_on.count == 0 and casts_off.count > 0  # off: every Linear weight and bias cast at every forward
    assert syncs_on.count == syncs_off.count  # the lever adds no host read


@pytest.mark.parametrize("options", [PassOptions(share_prompt=False, remove_padding=False), PassOptions(fused=True)])
def test_the_cast_copy_matches_under_other_passes_and_without_room_for_the_tied_copy(trained_tiny_model_dir,
                                                                                     options):
    """The plain pass (no shared prompt, no trimming) and the fused head (model.use_fused_kernels) give the
    same bits too; with no room for the tied output layer's copy it stays the embedding's, cast by autocast."""
    from posttrain.models import load_model

    plain = load_model(trained_tiny_model_dir).requires_grad_(False).eval()
    batch = batch_of(plain.config.vocab_size, seed=1)
    with torch.autocast(**BF16):
        want = compute_log_probs(plain, batch, 5, temperature=0.7, options=options, with_entropy=True)
    for room, copied in ((None, 1), (0, 0)):
        cast = load_model(trained_tiny_model_dir).requires_grad_(False).eval()
        counts = cast_linear_weights(cast, torch.bfloat16, room)
        linears = 4 * 7  # per layer q, k, v, o, gate, up, down; q/k/v biases
        assert counts["cast"] == linears + 4 * 3 and counts["copied"] == copied and counts["skipped"] == 1 - copied
        assert (cast.lm_head.weight is cast.model.embed_tokens.weight) == (copied == 0)
        with torch.autocast(**BF16):
            got = compute_log_probs(cast, batch, 5, temperature=0.7, options=options, with_entropy=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cast_weights_bytes_and_shared_linears():
    """Bytes by hand: a float32 [4, 3] weight and [4] bias cast to bf16 save (12 + 4) x 2 bytes; a tied copy of a
    [5, 4] embedding adds 20 x 2. A weight two Linears share stays one tensor; a trained one is left alone."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4, bias=False)
    b.weight = a.weight  # shared by two Linears
    emb, head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleList([a, b, emb, head]).requires_grad_(False)
    out = cast_linear_weights(model, torch.bfloat16)
    assert out == {"cast": 2, "copied": 1, "skipped": 0, "bytes": -(12 + 4) * 2 + 20 * 2}
    assert a.weight is b.weight and a.weight.dtype == torch.bfloat16 and emb.weight.dtype == torch.float32
    trained = torch.nn.Linear(3, 4)
    assert cast_linear_weights(trained, torch.bfloat16)["cast"] == 0 and trained.weight.dtype == torch.float32


def test_where_the_cast_applies(trained_tiny_model_dir):
    """Only a reference of its own, in one process, under autocast to a dtype below its weights'."""
    d = trained_tiny_model_dir
    assert models.ref_cast_dtype(spec_of(d), sharded=False)[0] == torch.bfloat16
    assert models.ref_cast_dtype(spec_of(d, "ref.cast_weights=true"), sharded=False)[0] == torch.bfloat16
    assert "false" in models.ref_cast_dtype(spec_of(d, "ref.cast_weights=false"), sharded=False)[1]
    assert "FSDP2" in models.ref_cast_dtype(spec_of(d), sharded=True)[1]
    assert "LoRA" in models.ref_cast_dtype(spec_of(d, "model.lora_rank=4"), sharded=False)[1]
    no_autocast = spec_of(d, "actor.mixed_precision.param_dtype=float32")
    assert models.ref_cast_dtype(no_autocast, sharded=False)[0] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.cast_ref(no_autocast, None, sharded=False) is None  # null: silently off
    asked = spec_of(d, "actor.mixed_precision.param_dtype=float32", "ref.cast_weights=true")
    with pytest.warns(UserWarning, match="ref.cast_weights=true does not apply: the reference runs without autocast"):
        assert models.cast_ref(asked, None, sharded=False) is None
    verl = load_config(None, [f"model.path={d}", "actor_rollout_ref.ref.cast_weights=false"])
    assert worker_spec(verl, str(d), None, "cpu", 10).ref.cast_weights is False
    with pytest.raises(ConfigError, match="'ref.cast_weights' expects Optional\\[bool\\], got 'maybe'"):
        load_config(None, [f"model.path={d}", "ref.cast_weights=maybe"])


def test_entropy_pieces_are_16_positions_on_the_cpu_and_sized_by_memory_on_a_gpu(monkeypatch):
    assert entropy_rows(torch.device("cpu"), 151936) == 16
    # 1 GiB over two float32 [rows, 151936] temporaries: 2**30 // (2 * 4 * 151936) = 883 rows
    assert entropy_rows(torch.device("cuda", 0), 151936) == 883
    assert entropy_rows(torch.device("cuda"), 151936, itemsize=2) == 1766
    assert entropy_rows(torch.device("cuda"), 1 << 40) == 1  # at least one row
    monkeypatch.setattr(logprobs, "ENTROPY_BYTES_GPU", 8 * 1000 * 3)
    assert entropy_rows(torch.device("cuda"), 1000) == 3


@pytest.mark.parametrize("vocab", [40, 151936])
def test_entropy_is_the_same_bits_for_any_piece_size(monkeypatch, vocab):
    """Pieces of 2, 3, 16 (the CPU's), 34 (all) positions and the GPU's sizing forced here give the same bits,
    with no host read."""
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 17, vocab, generator=g) * 4, torch.randint(0, vocab, (2, 17), generator=g)
    want = log_prob_and_entropy(logits, tokens)
    for rows in (2, 3, 34):
        monkeypatch.setattr(logprobs, "ENTROPY_ROWS", rows)
        with HostSyncs() as syncs:
            got = log_prob_and_entropy(logits, tokens)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and syncs.count == 0, rows
    monkeypatch.setattr(logprobs, "ENTROPY_BYTES_GPU", 2 * 4 * vocab * 5)  # a GPU's rule, 5 rows a piece
    monkeypatch.setattr(logprobs, "entropy_rows", lambda device, v, size: entropy_rows(torch.device("cuda"), v, size))
    assert torch.equal(log_prob_and_entropy(logits, tokens)[1], want[1])
