"""On-policy distillation: the per-token signal by hand, its two losses, verl's keys, a student that moves
toward its teacher."""

import math
import shutil

import pytest
import torch

from posttrain.algorithms.distill import DistillSettings, distillation_advantages, token_divergence
from posttrain.algorithms.losses import agg_loss
from posttrain.build import build_run
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.loop import train
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
    # teacher -3 -> -2: -1 - (-2) = 1, at most 0.5; the third (-2 vs -1) is within the clamp: -1
    assert clamped.tolist() == [[0.5, 0.0, -1.0]]
    # the policy-gradient form: minus k1 of the sampling policy, masked
    adv = distillation_advantages(STUDENT, TEACHER, MASK, DistillSettings("k1", use_policy_gradient=True))
    assert adv.tolist() == [[-2.0, 0.0, 0.0]]


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

    task = torch.tensor(10.0)
    loss, m = distilled(task, log_prob, log_prob.detach(), TEACHER, MASK, None, s, agg)
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
    with pytest.raises(ConfigError, match="top-k modes need the teacher's top-k logits"):
        load_config(None, ["distillation.enabled=true", "distillation.teacher_models.t.model_path=/t",
                           "distillation.distillation_loss.loss_mode=forward_kl_topk"])
    with pytest.raises(ConfigError, match="holds 2 teachers"):
        load_config(None, ["distillation.enabled=true", "distillation.teacher_models.a.model_path=/a",
                           "distillation.teacher_models.b.model_path=/b"])
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
