"""On-policy distillation: the per-token signal by hand, its two losses, verl's keys, a student that moves
toward its teacher."""

import math
import shutil

import pytest
import torch

from posttrain.algorithms.distill import DistillSettings, distillation_advantages, token_divergence, topk_divergence
from posttrain.algorithms.losses import agg_loss
from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.config.schema_distill import teachers_of
from posttrain.errors import ConfigError
from posttrain.driver.loop import train
from posttrain.training.actor import distilled

from helpers import read_metrics, small_run_overrides

STUDENT = torch.tensor([[-1.0, -0.5, -2.0]])
TEACHER = torch.tensor([[-3.0, -0.5, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_the_divergence_of_the_sampled_tokens_by_hand():
    assert token_divergence(STUDENT, TEACHER, DistillSettings("k1")).tolist() == [[2.0, 0.0, -1.0]]
    # k3: exp(t - s) - (t - s) - 1: exp(-2) + 1 and 0 and exp(1) - 2
    k3 = token_divergence(STUDENT, TEACHER, DistillSettings("k3"))
    assert k3[0].tolist() == pytest.approx([math.exp(-2) + 1, 0.0, math.e - 2], abs=1e-6)
    clamped = token_divergence(STUDENT, TEACHER, DistillSettings("k1", log_prob_min_clamp=-2.0, loss_max_clamp=0.5))
    # teacher -3 -> -2: -1 - (-2) = 1, at most 0.5; the third (-2 vs -1): -1, at least -0.5 (both sides, as verl)
    assert clamped.tolist() == [[0.5, 0.0, -0.5]]
    # the policy-gradient form: minus k1 of the sampling policy, masked
    adv = distillation_advantages(STUDENT, TEACHER, MASK, DistillSettings("k1", use_policy_gradient=True))
    assert adv.tolist() == [[-2.0, 0.0, 0.0]]


def lp(*probs):
    return torch.tensor([[list(probs)]]).log()  # [1, 1, k]


def test_the_top_k_divergences_by_hand():
    t, st = lp(0.5, 0.3), lp(0.25, 0.25)
    # verl's forward_kl_topk: sum p_t (log p_t - log p_s) over the k, full-vocabulary log-probs
    fwd = topk_divergence(st, t, DistillSettings("forward_kl_topk", topk=2))
    assert fwd.item() == pytest.approx(0.5 * math.log(2) + 0.3 * math.log(1.2), abs=1e-6)
    # where the student holds more of the k than the teacher the sum is negative: clamped at 0, as verl
    assert topk_divergence(lp(0.5, 0.4), lp(0.1, 0.1), DistillSettings("forward_kl_topk", topk=2)).item() == 0.0
    # NeMo-RL's kl_topk renormalises both over the k: teacher [0.625, 0.375], student [0.5, 0.5]
    forward = 0.625 * math.log(1.25) + 0.375 * math.log(0.75)
    reverse = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)
    for kl_type, expected in (("forward", forward), ("reverse", reverse), ("mixed", 0.3 * forward + 0.7 * reverse)):
        got = topk_divergence(st, t, DistillSettings("kl_topk", topk=2, kl_type=kl_type, mixed_kl_weight=0.3))
        assert got.item() == pytest.approx(expected, abs=1e-6), kl_type
    # zero_outside_topk: the student's own probabilities (0.25, 0.25, and 0.5 on the other tokens, of which
    # sum p log p = 0.5 log 0.5 + ... here one token of 0.5); the teacher's renormalised top k, e^-100 elsewhere
    neg_entropy = torch.tensor([[2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)]])
    s = DistillSettings("kl_topk", topk=2, kl_type="reverse", zero_outside_topk=True)
    by_hand = (0.25 * math.log(0.25 / 0.625) + 0.25 * math.log(0.25 / 0.375)  # on the k
               + 0.5 * (math.log(0.5) + 100.0))  # the rest: p_s (log p_s - (-100))
    assert topk_divergence(st, t, s, neg_entropy).item() == pytest.approx(by_hand, rel=1e-6)
    forward_only = DistillSettings("kl_topk", topk=2, kl_type="forward", zero_outside_topk=True)
    assert topk_divergence(st, t, forward_only, neg_entropy).item() == pytest.approx(
        0.625 * math.log(0.625 / 0.25) + 0.375 * math.log(0.375 / 0.25), abs=1e-6)


def test_with_the_whole_vocabulary_as_k_the_top_k_kls_are_the_full_kls():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 6).log_softmax(-1), torch.randn(2, 3, 6).log_softmax(-1)
    forward = (teacher.exp() * (teacher - student)).sum(-1)
    reverse = (student.exp() * (student - teacher)).sum(-1)
    neg_entropy = (student.exp() * student).sum(-1)
    for zero in (False, True):
        for kl_type, full in (("forward", forward), ("reverse", reverse)):
            got = topk_divergence(student, teacher, DistillSettings("kl_topk", topk=6, kl_type=kl_type,
                                                                     zero_outside_topk=zero), neg_entropy)
            assert torch.allclose(got, full, atol=1e-5), (kl_type, zero)
    assert torch.allclose(topk_divergence(student, teacher, DistillSettings("forward_kl_topk", topk=6)), forward,
                          atol=1e-5)


def test_the_teachers_pass_keeps_its_k_likeliest_tokens(tiny_model_dir):
    """compute_topk_log_probs: the k likeliest tokens of each response position, most likely first, their
    full-vocabulary log-probs, and the sampled tokens' log-probs as compute_log_probs gives them."""
    from posttrain.driver.batch import RolloutBatch
    from posttrain.models.loader import load_model
    from posttrain.training.logprobs import compute_log_probs, compute_topk_log_probs, response_logits

    model = load_model(str(tiny_model_dir)).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, 20, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    mask[:, 4:] = response_mask
    batch = RolloutBatch(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         responses=ids[:, 4:], response_mask=response_mask, group=torch.tensor([0, 1, 2]))
    sampled, top_lp, top_ids = compute_topk_log_probs(model, batch, 4, micro_batch_size=2)
    assert top_lp.shape == top_ids.shape == (3, 3, 4) and top_ids.dtype == torch.int32
    with torch.no_grad():
        full = torch.log_softmax(response_logits(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                                 3, 1.0), -1)
    real = response_mask.bool()
    expected_lp, expected_ids = full.topk(4, dim=-1)
    assert torch.allclose(top_lp[real], expected_lp[real], atol=1e-5)
    assert torch.equal(top_ids[real].long(), expected_ids[real])
    assert bool((top_lp[real][:, :-1] >= top_lp[real][:, 1:]).all())  # most likely first
    plain = compute_log_probs(model, batch, 2)[0]
    assert torch.allclose(sampled[real], plain[real], atol=1e-5)


class Micro:
    pass


@pytest.mark.parametrize("use_policy_gradient, use_task_rewards", [(False, False), (True, False), (True, True)])
def test_the_loss_alone_or_beside_the_tasks(use_policy_gradient, use_task_rewards):
    from posttrain.training.actor import UpdateSettings

    log_prob = STUDENT.clone().requires_grad_(True)
    s = UpdateSettings(mini_batch_size=1, micro_batch_size=1, distill=DistillSettings(
        "k1", use_policy_gradient=use_policy_gradient, use_task_rewards=use_task_rewards, coef=0.5))

    def agg(x):
        return agg_loss(x, MASK, "token-mean")

    task, mb = torch.tensor(10.0), Micro()
    mb.teacher_log_probs = TEACHER
    loss, m = distilled(task, log_prob, log_prob.detach(), mb, MASK, None, s, agg, "cpu")
    assert m["distillation/reverse_kl"] == pytest.approx(1.0)  # (2 + 0) / 2 masked tokens
    if not use_policy_gradient:
        assert loss.item() == pytest.approx(1.0)  # k1 itself, token-mean
    else:  # ratio 1: -A = (2 + 0) / 2, and its gradient -A / 2 on each token
        expected = 1.0 if not use_task_rewards else 10.0 + 0.5 * 1.0
        assert loss.item() == pytest.approx(expected)
        loss.backward()
        scale = 0.5 if use_task_rewards else 1.0
        assert log_prob.grad[0].tolist() == pytest.approx([scale * 2.0 / 2, 0.0, 0.0])  # descent lowers the first


def verl_opd(teacher) -> list[str]:
    """verl's on-policy distillation keys as its example commands pass them."""
    return ["distillation.enabled=True", "distillation.n_gpus_per_node=1", "distillation.nnodes=1",
            "distillation.teacher_models.teacher_model.key=openai/gsm8k",
            f"distillation.teacher_models.teacher_model.model_path={teacher}",
            "distillation.teacher_models.teacher_model.num_replicas=1",
            "distillation.teacher_models.teacher_model.inference.name=vllm",
            "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=True",
            "distillation.distillation_loss.use_task_rewards=False",
            "distillation.distillation_loss.loss_max_clamp=10.0",
            "distillation.distillation_loss.log_prob_min_clamp=-10.0"]


def test_verls_keys_load_and_what_posttrain_cannot_honour_is_refused():
    with pytest.warns(UserWarning, match="teacher_models.teacher_model.key.*beside the policy"):
        cfg = load_config(None, verl_opd("/t"))
    d = cfg.distillation
    assert d.enabled and d.teacher_models["teacher_model"]["model_path"] == "/t"
    assert (d.distillation_loss.loss_mode, d.distillation_loss.use_policy_gradient) == ("k1", True)
    one = ["distillation.enabled=true", "distillation.teacher_models.t.model_path=/t"]
    with pytest.raises(ConfigError, match="needs the student's own top-k tokens"):
        load_config(None, [*one, "distillation.distillation_loss.loss_mode=jsd_topk"])
    with pytest.raises(ConfigError, match=r"topk=None: loss_mode=forward_kl_topk needs the number"):
        load_config(None, [*one, "distillation.distillation_loss.loss_mode=forward_kl_topk"])
    topk = [*one, "distillation.distillation_loss.loss_mode=kl_topk", "distillation.distillation_loss.topk=8"]
    with pytest.raises(ConfigError, match="is a direct loss.*use_policy_gradient=false"):
        load_config(None, [*topk, "distillation.distillation_loss.use_policy_gradient=true"])
    with pytest.raises(ConfigError, match="kl_type=both is not one of: forward, reverse, mixed"):
        load_config(None, [*topk, "distillation.distillation_loss.kl_type=both"])
    with pytest.raises(ConfigError, match="model.use_fused_kernels=true never forms"):
        load_config(None, [*topk, "model.use_fused_kernels=true"])
    assert load_config(None, topk).distillation.distillation_loss.topk == 8
    # several teachers (verl's MOPD): each routed its rows by key; verl's empty teacher_model entry is left out
    two = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=null",
           "distillation.teacher_models.a.model_path=/a", "distillation.teacher_models.a.key=openai/gsm8k",
           "distillation.teacher_models.b.model_path=/b"]
    assert teachers_of(load_config(None, two).distillation) == {"openai/gsm8k": {"model_path": "/a",
                                                                               "key": "openai/gsm8k"},
                                                                "b": {"model_path": "/b"}}
    with pytest.raises(ConfigError, match="two teachers share the routing key 'b'"):
        load_config(None, [*two, "distillation.teacher_models.a.key=b"])
    with pytest.raises(ConfigError, match=r"loss_mode=k1 as a direct loss .*use_policy_gradient=true"):
        load_config(None, [*one, "distillation.distillation_loss.loss_mode=k1"])
    with pytest.raises(ConfigError, match="teacher_models.a.model_path is not set"):
        load_config(None, ["distillation.enabled=true", "distillation.teacher_models.a.key=x"])


def test_a_student_moves_toward_its_teacher(tmp_path, data, trained_tiny_model_dir):
    """The embedded model distilled from its number-guessing variant (the same tokenizer, another way of
    answering) with verl's command keys (k1, the reverse KL's policy gradient, no reward): the reverse KL
    on its own samples falls."""
    from posttrain.models import shipped

    args = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "r", 12, *verl_opd(shipped.games_model()),
                               "trainer.test_freq=-1")
    with pytest.warns(UserWarning):
        summary = train(build_run(load_config(None, args)))
    assert summary["steps"] == 12
    lines = [x for x in read_metrics(tmp_path / "r") if "distillation/reverse_kl" in x]
    kl = [x["distillation/reverse_kl"] for x in lines]
    # last 3 steps' mean over the first 3's, measured on seeds 0-3: 0.55, 0.02, 0.02, 0.003
    assert len(kl) == 12 and sum(kl[-3:]) < 0.75 * sum(kl[:3])
    assert all("timing_s/teacher" in x for x in lines)


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, data, tiny_model_dir):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(str(other))
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(str(other))
    args = small_run_overrides(tiny_model_dir, data, tmp_path / "r", 1, "distillation.enabled=true",
                               f"distillation.teacher_models.t.model_path={other}")
    with pytest.raises(ConfigError, match="its tokenizer's vocabulary differs from the student's"):
        build_run(load_config(None, args))


@pytest.mark.parametrize("mode", ["forward_kl_topk", "kl_topk"])
def test_a_student_moves_toward_its_teachers_top_k(tmp_path, data, trained_tiny_model_dir, mode):
    """The same student and teacher with a top-k loss (verl's forward KL over the teacher's 8 likeliest tokens,
    NeMo-RL's mixed KL over them renormalised): the loss falls, and the reverse KL on the student's samples too."""
    from posttrain.models import shipped

    keys = [k for k in verl_opd(shipped.games_model()) if "loss_mode" not in k and "policy_gradient" not in k]
    args = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "r", 8, *keys, "trainer.test_freq=-1",
                               f"distillation.distillation_loss.loss_mode={mode}", "distillation.distillation_loss.topk=8",
                               "distillation.distillation_loss.use_policy_gradient=false")
    with pytest.warns(UserWarning):
        summary = train(build_run(load_config(None, args)))
    assert summary["steps"] == 8
    lines = [x for x in read_metrics(tmp_path / "r") if "distillation/loss" in x]
    loss, kl = [x["distillation/loss"] for x in lines], [x["distillation/reverse_kl"] for x in lines]
    assert sum(loss[-2:]) < 0.75 * sum(loss[:2]) and sum(kl[-2:]) < sum(kl[:2])
    assert all(0 < x["distillation/teacher_mass"] <= 1 and 0 < x["distillation/student_mass"] <= 1 for x in lines)


def test_several_teachers_each_score_the_rows_routed_to_them(tmp_path, trained_tiny_model_dir):
    """verl's MOPD: two teachers, each with a key; a row goes to the teacher whose key is the row's
    distillation.teacher_key value (here a field of extra_info). Their log-probs land on their own rows, a row no
    teacher claims is refused by name, and a run with both trains."""
    from posttrain.driver.batch import RolloutBatch
    from posttrain.data.schema import write_rows
    from posttrain.driver.loop import teacher_pass
    from posttrain.models import shipped
    from posttrain.rollout.base import SamplingParams

    from helpers import embedded_rows

    rows = embedded_rows()[:12]
    for i, row in enumerate(rows):
        row["extra_info"]["teacher"] = "games" if i % 2 else "arith"
    write_rows(rows[:8], tmp_path / "train.parquet")
    write_rows(rows[8:], tmp_path / "val.parquet")
    teachers = ["distillation.enabled=true", "distillation.teacher_key=teacher",
                f"distillation.teacher_models.g.model_path={shipped.games_model()}",
                "distillation.teacher_models.g.key=games",
                f"distillation.teacher_models.a.model_path={trained_tiny_model_dir}",
                "distillation.teacher_models.a.key=arith",
                "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true"]
    run = build_run(load_config(None, small_run_overrides(trained_tiny_model_dir, tmp_path, tmp_path / "r", 2,
                                                          *teachers)))
    out = run.actor.generate([[5 + i, 6, 7] for i in range(4)], SamplingParams(max_new_tokens=4, n=2, temperature=1.0))
    routes = ["games", "arith", "arith", "games"]
    batch = RolloutBatch.from_rollout(out, 2, ["arith"] * 4, ["0"] * 4, [{"teacher": t} for t in routes], [""] * 8)
    teacher_pass(run, batch)
    real = batch.response_mask.bool()
    for key in ("games", "arith"):
        mine = torch.tensor([routes[i // 2] == key for i in range(8)])
        own = run.actor.compute_log_probs(batch, "teacher", key)
        assert torch.allclose(batch.teacher_log_probs[mine][real[mine]], own[mine][real[mine]], atol=1e-6)
        other = run.actor.compute_log_probs(batch, "teacher", "arith" if key == "games" else "games")
        assert not torch.allclose(batch.teacher_log_probs[mine][real[mine]], other[mine][real[mine]], atol=1e-3)
    batch.extra_info[0] = {"teacher": "nobody"}
    with pytest.raises(ConfigError, match="distillation.teacher_key=teacher: row 0's routing value 'nobody' names no "
                                          "teacher"):
        teacher_pass(run, batch)
    assert train(run)["steps"] == 2
    assert all("distillation/reverse_kl" in x for x in read_metrics(tmp_path / "r") if "actor/grad_norm" in x)
