"""Tensor parallelism (training/tensor_parallel.py) on the CPU: gloo process groups of 2 to 4 ranks in float32,
each rank a process of its own (tests/tp_ranks.py), against one process."""

import pytest
import torch
from transformers import Qwen2Config

from posttrain.training.tensor_parallel import check_plan, vocab_share

from tp_ranks import (plan_errors, plan_rank, sft_case, sft_rank, sft_settings, spawn, stats_case, stats_rank,
                      teacher_group_rank, tiny_case, topk_pass_rank, topk_rank, update_rank, update_settings)


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
    [(metrics, got, held, whole_bytes)], = spawn(update_rank, 1, 1)
    assert metrics["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    assert held == whole_bytes
    for name, value in weights.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)


# (family, options) at TP=2, all in one pair of processes: the tiny model (Qwen2, tied output layer) and random
# Llama, Qwen3 (q/k norms) and Gemma3 (q/k norms, a scaled embedding, four norms a layer, tied) models; the fused
# log-prob path (training/fused.py) and sequence parallelism (the norms and the residual stream split over the
# positions), each against the plain one-process update
TP2_CASES = [("tiny", {}), ("llama", {}), ("qwen3", {}), ("gemma3_text", {}), ("tiny", {"fused": True}),
             ("tiny", {"sequence_parallel": True}), ("qwen3", {"sequence_parallel": True}),
             ("gemma3_text", {"sequence_parallel": True, "fused": True}), ("tiny", {"plan": "tp_plans.qwen_plan"})]


@pytest.fixture(scope="module")
def tp2_ranks():
    ranks = spawn(update_rank, 2, 2, TP2_CASES)
    print(f"TP=2: each rank holds {ranks[0][0][2] / 2**20:.2f} of the model's {ranks[0][0][3] / 2**20:.2f} MiB")
    return ranks


@pytest.mark.parametrize("case", range(len(TP2_CASES)),
                         ids=[f + "".join(f"-{k}" for k in o) for f, o in TP2_CASES])
def test_an_update_at_tp_2_equals_one_process(tp2_ranks, case):
    """vocabulary 259 (split unevenly), 2 ranks at TP=2: two mini-batches of SGD with an entropy bonus give the
    one-process loss, gradient norm and weights; each rank holds about half the weights (the norms whole on
    both)."""
    family, options = TP2_CASES[case]
    want, weights = one_process_update(family)
    for rank in tp2_ranks:
        metrics, got, held, whole_bytes = rank[case]
        mine, positions = metrics.pop("norm_positions")  # with SP each rank's norms run on its half of them
        assert mine == (-(-positions // 2) if options.get("sequence_parallel") else positions), (mine, positions)
        for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert set(got) == set(weights)
        for name, value in weights.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
        assert 0.5 <= held / whole_bytes <= 0.52, held / whole_bytes


@pytest.fixture(scope="module")
def four_ranks():
    """2 x 2 data-parallel x TP, then Ulysses 2 x TP 2 (each pair of TP groups splits the positions), then the
    same with Qwen3's q/k norms, in one set of four processes."""
    return spawn(update_rank, 4, 2, [("tiny", {}), ("tiny", {"ulysses": 2}), ("qwen3", {"ulysses": 2})])


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
    for metrics, nll, got in [case for rank in spawn(sft_rank, 2, 2, [{}, {"fused": True}]) for case in rank]:
        for key in ("train/loss", "train/grad_norm", "train/learned_tokens", "train/nonfinite_updates"):
            assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert nll[1] == want_nll[1] and nll[0] == pytest.approx(want_nll[0], rel=1e-5)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_an_sft_update_under_ulysses_2_by_tp_2_equals_one_process():
    """posttrain sft at TP=2 beside Ulysses 2 (4 ranks, each TP pair's positions split over a Ulysses pair, FSDP2
    over it): the loss, gradient norm, validation loss and weights are one process's."""
    from posttrain.training.sft import nll_of, sft_update

    torch.set_num_threads(1)
    model, batch = sft_case()
    want = sft_update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, sft_settings())
    want_nll = nll_of(model, batch, sft_settings())
    for [(metrics, nll, got)] in spawn(sft_rank, 4, 2, [{"ulysses": 2}]):
        for key in ("train/loss", "train/grad_norm", "train/learned_tokens"):
            assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert nll[1] == want_nll[1] and nll[0] == pytest.approx(want_nll[0], rel=1e-5)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_data_parallel_2_by_tp_2_in_four_ranks_equals_one_process(four_ranks):
    """A 2 x 2 mesh: FSDP2 over the data-parallel pair, TP=2 within each; each data-parallel rank its half of every
    mini-batch. The weights after the update and the gradient norm are one process's; the metrics averaged over
    the data-parallel ranks are too; each rank holds about a quarter of the weights."""
    want, weights = one_process_update()
    ranks = [r[0] for r in four_ranks]
    for key in ("actor/loss", "actor/pg_loss", "actor/entropy"):
        mean = sum(m[key] for m, *_ in ranks) / 4
        assert mean == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for metrics, got, held, whole_bytes in ranks:
        assert metrics["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
        for name, value in weights.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
        assert 0.25 <= held / whole_bytes <= 0.27, held / whole_bytes


@pytest.mark.slow
@pytest.mark.parametrize("case, family", [(1, "tiny"), (2, "qwen3")])
def test_ulysses_2_by_tp_2_in_four_ranks_equals_one_process(four_ranks, case, family):
    """NeMo-RL's context parallelism beside tensor parallelism: four ranks take the same rows, each TP pair splits
    the layers and the vocabulary, each Ulysses pair (ranks 0 and 2, 1 and 3) the positions; FSDP2 shards over the
    Ulysses pairs. Loss, gradient norm and weights are one process's."""
    want, weights = one_process_update(family)
    for rank in four_ranks:
        metrics, got, held, whole_bytes = rank[case]
        for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        for name, value in weights.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
        assert 0.25 <= held / whole_bytes <= 0.27, held / whole_bytes


@pytest.mark.slow
def test_the_distillation_and_log_prob_passes_under_ulysses_2_by_tp_2_equal_one_process():
    """logprobs.topk_stats (the student's pass of the top-k distillation modes: log p at the token and at the
    teacher's top-k ids, the entropy) and the log-prob pass, with each sequence's positions split over a Ulysses
    pair and the vocabulary over a TP pair, equal the whole model's on the response tokens."""
    for diffs in spawn(topk_pass_rank, 4, 2, 2):
        assert max(diffs.values()) < 1e-5, diffs


def test_a_teacher_split_wider_than_its_student_scores_each_workers_rows():
    """distillation.tensor_parallel_size=2 over two workers with rows of their own (3 and 2 rows, other widths):
    each worker's top-k log-probs and ids and log-probs equal the whole teacher's on its rows."""
    for rank, diffs in enumerate(spawn(teacher_group_rank, 2)):
        assert diffs.pop("ids_equal") and diffs.pop("shape") == (3 if rank == 0 else 2, 9 - 2 * rank, 4), diffs
        assert max(diffs.values()) < 1e-5, diffs


def test_workers_with_rows_of_their_own_cut_as_many_micro_batches_with_the_same_forwards():
    """FSDP2's workers gather and reduce together in every forward and backward: two workers with other rows (one
    with prompts shared by 2 samples, one without) and a token budget agree on how many micro-batches (the fewer
    split theirs) and on which of them run the shared-prompt forwards (where one cannot, none does)."""
    (agreed0, alone0), (agreed1, alone1) = spawn(plan_rank, 2)
    assert len(alone0) != len(alone1)  # alone they would not even cut as many
    assert len(agreed0) == len(agreed1) == max(len(alone0), len(alone1))
    for agreed, alone in ((agreed0, alone0), (agreed1, alone1)):
        assert sorted(i for rows, _ in agreed for i in rows) == list(range(8))  # every row once
        assert [i for rows, _ in agreed for i in rows] == [i for rows, _ in alone for i in rows]  # in order
    assert any(shared for _, shared in alone0) and not any(shared for _, shared in alone1)
    assert [s for _, s in agreed0] == [s for _, s in agreed1] == [False] * len(agreed0)


def test_a_plan_of_the_users_own_is_checked():
    """actor.tensor_parallel_plan (NeMo-RL's custom_parallel_plan) that leaves the vocabulary whole, is not a dict,
    or cannot be imported: one line each. (tests/tp_plans.py's good plan runs in the TP=2 cases above.)"""
    whole_head, not_a_plan, missing = spawn(plan_errors, 1)[0]
    assert whole_head.startswith("the tensor-parallel plan 'tp_plans.whole_head_plan' leaves the output layer's "
                                 "vocabulary whole")
    assert "'tp_plans.not_a_plan' is not a dict {module path: ParallelStyle}" in not_a_plan
    assert missing == ("the tensor-parallel plan 'tp_plans_missing.plan': no module named 'tp_plans_missing'; "
                       "install it, or put its directory on PYTHONPATH")


REFUSED = [
    (["trainer.n_gpus_per_node=3"], r"actor.tensor_parallel_size=2 must divide the 3 workers"),
    (["actor.ulysses_sequence_parallel_size=2"], r"actor.tensor_parallel_size=2 x actor.ulysses_sequence_parallel_"
                                                 r"size=2 must divide the 2 workers"),
    (["distillation.enabled=true", "distillation.teacher_models.t.model_path=x", "distillation.tensor_parallel_size=3"],
     r"^distillation.tensor_parallel_size=3 must divide the 2 workers"),
    (["distillation.enabled=true", "distillation.teacher_models.t.model_path=x", "distillation.tensor_parallel_size=3",
      "trainer.n_gpus_per_node=6", "data.train_batch_size=12", "actor.ppo_mini_batch_size=12"],
     r"^distillation.tensor_parallel_size=3 must be a multiple or a divisor of the 2 workers that share rows"),
    (["actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=4", "actor.sequence_parallel=true"],
     r"with actor.sequence_parallel=true and actor.ulysses_sequence_parallel_size > 1 \(both split the positions\)"),
    (["model.lora_rank=4"], r"with LoRA \(model.lora_rank\): not supported together yet"),
    (["actor.sequence_parallel=true", "actor.tensor_parallel_plan=my.plan"],
     r"^actor.sequence_parallel=true with actor.tensor_parallel_plan=my.plan: the plan decides every layout"),
]


# sft has no teachers: the distillation cases are train's
@pytest.mark.parametrize("command, extra, message", [(c, e, m) for c in ("train", "sft") for e, m in REFUSED
                                                     if c == "train" or not e[0].startswith("distillation.")])
def test_what_does_not_combine_with_tensor_parallelism_is_refused_in_one_line(command, extra, message):
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
