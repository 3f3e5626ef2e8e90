"""Tensor parallelism (training/tensor_parallel.py) on the CPU: gloo process groups of 2 to 4 ranks in float32,
each rank a process of its own (tests/tp_ranks.py), against one process."""

import pytest
import torch
from transformers import Qwen2Config

from posttrain.training.tensor_parallel import check_plan, vocab_share

from tp_ranks import (sft_case, sft_rank, sft_settings, spawn, stats_case, stats_rank, tiny_case, topk_rank, update_rank,
                      update_settings)


def test_the_vocabulary_is_shared_as_torch_chunk_shares_it():
    assert [vocab_share(259, 2, r) for r in range(2)] == [(0, 130), (130, 129)]
    assert [vocab_share(7, 3, r) for r in range(3)] == [(0, 3), (3, 3), (6, 1)]
    assert [vocab_share(4, 3, r) for r in range(3)] == [(0, 2), (2, 2), (4, 0)]  # the last rank holds none
    for vocab, size in ((259, 2), (7, 3), (4, 3), (151936, 8)):
        parts = [p for r in range(size) for p in [vocab_share(vocab, size, r)]]
        assert [len(c) for c in torch.arange(vocab).chunk(size)] == [w for _, w in parts if w]


def test_what_does_not_divide_is_named():
    config = Qwen2Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)
    assert check_plan(config, 2) == []
    assert check_plan(config, 4) == ["the model's num_key_value_heads=2 does not divide by the tensor-parallel "
                                     "size 4"]
    assert check_plan(Qwen2Config(num_attention_heads=6, num_key_value_heads=6, intermediate_size=102), 4) == [
        "the model's num_attention_heads=6 does not divide by the tensor-parallel size 4",
        "the model's num_key_value_heads=6 does not divide by the tensor-parallel size 4",
        "the model's intermediate_size=102 does not divide by the tensor-parallel size 4"]
    gpt2 = type("C", (), {"model_type": "gpt2"})()
    assert "model_type 'gpt2' has no tensor-parallel plan" in check_plan(gpt2, 2)[0]


@pytest.mark.parametrize("world, vocab", [(2, 7), (3, 4)])
def test_log_probs_entropy_and_their_gradient_from_a_split_vocabulary(world, vocab):
    """Each rank's columns of the logits (7 over 2 ranks: 4 + 3; 4 over 3: 2 + 2 + 0, a rank with none): log p of
    the tokens, the entropy and the gradient of a loss of both with respect to each rank's columns equal those of
    log_softmax over the whole logits (autograd), on every rank."""
    logits, tokens, a, b = stats_case(vocab=vocab)
    full = logits.clone().requires_grad_(True)
    log_p = torch.log_softmax(full, -1)
    want_lp, want_ent = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    (a * want_lp + b * want_ent).sum().backward()
    for lp, ent, grad, start in spawn(stats_rank, world, vocab):
        torch.testing.assert_close(lp, want_lp.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent, want_ent.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad, full.grad[..., start:start + grad.shape[-1]], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("world, vocab, k", [(2, 7, 3), (3, 4, 3)])
def test_the_top_k_and_log_probs_at_ids_from_a_split_vocabulary(world, vocab, k):
    """Distillation's pieces at TP (training/logprobs.py's top-k passes): the k likeliest tokens and their log-probs
    from every rank's columns (k above a rank's 2 columns, and a rank with none: 4 over 3), log p at the token and
    at those ids, the entropy, and the gradient of a loss of all of them, as over the whole logits."""
    logits, tokens, a, b = stats_case(vocab=vocab)
    full = logits.clone().requires_grad_(True)
    log_p = torch.log_softmax(full, -1)
    want_values, want_ids = log_p.detach().topk(k, dim=-1)
    ids = torch.cat([tokens.unsqueeze(-1), want_ids], -1)
    at = log_p.gather(-1, ids)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((a.unsqueeze(-1) * at).sum() + (b * entropy).sum()).backward()
    for values, got_ids, got_at, got_entropy, grad, start in spawn(topk_rank, world, vocab, k):
        torch.testing.assert_close(values, want_values, atol=1e-6, rtol=1e-6)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_at, at.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_entropy, entropy.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad, full.grad[..., start:start + grad.shape[-1]], atol=1e-6, rtol=1e-6)


def one_process_update(family: str = "tiny", device: str = "cpu"):
    torch.set_num_threads(1)
    from posttrain.training.actor import update_policy

    model, batch = tiny_case(family)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = update_policy(model, optimizer, batch, update_settings())
    return metrics, {k: v.cpu() for k, v in model.state_dict().items()}


def test_the_tensor_parallel_path_at_tp_1_equals_one_process():
    """The same plans on a mesh of one (a 1 x 1 data-parallel x TP mesh, gloo): every layer a DTensor, the log-probs
    through the vocabulary-parallel path; the update is the plain one's. tests/test_gpu.py runs it on a GPU."""
    want, weights = one_process_update()
    (metrics, got, held, whole_bytes), = spawn(update_rank, 1, 1)
    assert metrics["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    assert held == whole_bytes
    for name, value in weights.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["tiny", "llama", "qwen3", "gemma3_text"])
def test_an_update_at_tp_2_equals_one_process(family):
    """The tiny model (Qwen2, tied output layer) and random Llama, Qwen3 (q/k norms) and Gemma3 (q/k norms, a scaled
    embedding, tied) models, vocabulary 259 (split unevenly), in 2 ranks at TP=2: two mini-batches of SGD with an
    entropy bonus give the one-process loss, gradient norm and weights; each rank holds about half the weights
    (the norms whole on both)."""
    want, weights = one_process_update(family)
    ranks = spawn(update_rank, 2, 2, family)
    for metrics, got, held, whole_bytes in ranks:
        for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert set(got) == set(weights)
        for name, value in weights.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
        assert 0.5 <= held / whole_bytes <= 0.52, held / whole_bytes
    print(f"TP=2: each rank holds {ranks[0][2] / 2**20:.2f} of the model's {ranks[0][3] / 2**20:.2f} MiB")


def test_an_sft_update_and_its_validation_loss_at_tp_2_equal_one_process():
    """posttrain sft's update (training/sft.py) of the tiny model at TP=2 in 2 ranks: -log p of the labels from each
    rank's vocabulary columns (prompt and padding labels -100), three micro-batches, the gradient clipped over
    the split and whole parameters: the loss, gradient norm and weights after SGD, and the validation loss after
    it, are one process's."""
    from posttrain.training.sft import nll_of, sft_update

    torch.set_num_threads(1)
    model, batch = sft_case()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    want = sft_update(model, optimizer, batch, sft_settings())
    want_nll = nll_of(model, batch, sft_settings())
    assert want["train/grad_norm"] > sft_settings().grad_clip  # the clip acts
    for metrics, nll, got in spawn(sft_rank, 2, 2):
        for key in ("train/loss", "train/grad_norm", "train/learned_tokens", "train/nonfinite_updates"):
            assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert nll[1] == want_nll[1] and nll[0] == pytest.approx(want_nll[0], rel=1e-5)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_data_parallel_2_by_tp_2_in_four_ranks_equals_one_process():
    """A 2 x 2 mesh: FSDP2 over the data-parallel pair, TP=2 within each; each data-parallel rank its half of every
    mini-batch. The weights after the update and the gradient norm are one process's; the metrics averaged over
    the data-parallel ranks are too; each rank holds about a quarter of the weights."""
    want, weights = one_process_update()
    ranks = spawn(update_rank, 4, 2)
    for key in ("actor/loss", "actor/pg_loss", "actor/entropy"):
        mean = sum(m[key] for m, *_ in ranks) / 4
        assert mean == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for metrics, got, held, whole_bytes in ranks:
        assert metrics["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
        for name, value in weights.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
        assert 0.25 <= held / whole_bytes <= 0.27, held / whole_bytes


@pytest.mark.parametrize("extra, message", [
    (["trainer.n_gpus_per_node=3"], r"actor.tensor_parallel_size=2 must divide the 3 workers"),
    (["actor.ulysses_sequence_parallel_size=2"], r"with actor.ulysses_sequence_parallel_size > 1: not supported "
                                                 r"together yet"),
    (["model.lora_rank=4"], r"with LoRA \(model.lora_rank\): not supported together yet"),
    (["model.use_fused_kernels=true"], r"with model.use_fused_kernels=true: not supported together yet"),
])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_what_does_not_combine_with_tensor_parallelism_is_refused_in_one_line(extra, message, command):
    """posttrain train's and posttrain sft's configs load at TP=2 and refuse the same things in one line."""
    from posttrain.config import load_config
    from posttrain.errors import ConfigError

    base = ["actor.tensor_parallel_size=2", "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
            "actor.ppo_micro_batch_size=2"]
    if command == "train":
        base += ["rollout.n=2", "actor.ppo_mini_batch_size=4"]
    assert load_config(None, base, command=command).actor.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(None, [*base, *extra], command=command)
    assert "\n" not in str(refused.value)
