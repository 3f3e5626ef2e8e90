"""NeMo-RL's distillation layout (examples/run_distillation.py, e.g. distillation_math.yaml) -> posttrain's keys:
distillation.* is grpo.*'s layout (its step, validation and epoch keys) plus topk_logits_k; loss_fn.* is the
distillation loss over the teacher's top-k logits (kl_type forward | reverse | mixed, mixed_kl_weight,
zero_outside_topk); teacher.* is the teacher model, a policy section of which posttrain reads the model, its
precision and its log-prob pass (the rest, a copy of the policy's in NeMo-RL's examples, trains nothing there
either: the teacher is frozen, and posttrain places it as the reference).

    translate_distillation(tree, "in distillation_math.yaml", translate)   # translate: grpo.py's

As NeMo-RL's distillation: the teacher's top-k loss alone trains the student (no task reward in the loss; the
rewards are scored and logged, and validation scores the student as GRPO's does).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from posttrain.algorithms.distill import KL_TYPES
from posttrain.config.dialects.nemo_rl.policy import Leaves
from posttrain.errors import ConfigError
from posttrain.text.lines import clipped

TEACHER = "teacher"  # the name of the one teacher in distillation.teacher_models
LOSS = "distillation.distillation_loss."
# teacher.* keys read (the rest is the teacher's copy of the policy's training and generation settings)
TEACHER_KEYS = ("model_name", "tokenizer.name", "precision", "logprob_batch_size", "dtensor_cfg.cpu_offload",
                "dtensor_cfg.tensor_parallel_size")


def translate_distillation(tree: dict, origin: str, translate: Callable[..., dict]) -> dict[str, Any]:
    """NeMo-RL's distillation layout -> posttrain's keys (module docstring)."""
    if tree.get("teachers") is not None:
        raise ConfigError(f"teachers ({origin}): NeMo-RL's cross-tokenizer off-policy distillation "
                          "(examples/run_xtoken_off_policy_distillation.py: teachers with other tokenizers scoring a "
                          "fixed dataset's responses) is not supported; posttrain distils on-policy from one teacher "
                          "with the student's tokenizer (distillation_math.yaml's teacher.model_name)")
    for section in ("distillation", "loss_fn", "teacher"):
        if not isinstance(tree.get(section) or {}, dict):
            raise ConfigError(f"{section} ({origin}) must be a mapping of NeMo-RL's {section}.* keys, got "
                              f"{clipped(tree[section])}")
    dist = dict(tree.get("distillation") or {})
    k = dist.pop("topk_logits_k", 64)
    loss = dict(tree.get("loss_fn") or {})
    teacher = tree.get("teacher") or {}
    rest = {key: v for key, v in tree.items() if key not in ("distillation", "loss_fn", "teacher", "teachers")}
    try:
        # NeMo-RL's distillation splits the cluster without a reward model's share (cluster.py)
        out = translate({**rest, **({"grpo": dist} if dist else {})}, origin, reward_share=False)
    except ConfigError as e:  # its keys as the file spells them
        raise ConfigError(str(e).replace("grpo.", "distillation.")) from None
    kl_type = loss.pop("kl_type", "mixed")
    if kl_type not in KL_TYPES:
        raise ConfigError(f"loss_fn.kl_type={clipped(kl_type)} ({origin}) is not one of: {', '.join(KL_TYPES)}")
    out.update({"distillation.enabled": True, LOSS + "loss_mode": "kl_topk", LOSS + "topk": k,
                LOSS + "kl_type": kl_type, LOSS + "mixed_kl_weight": loss.pop("mixed_kl_weight", 0.5),
                LOSS + "zero_outside_topk": bool(loss.pop("zero_outside_topk", False)),
                LOSS + "use_policy_gradient": False, LOSS + "use_task_rewards": False})
    if loss:
        raise ConfigError(f"NeMo-RL key 'loss_fn.{next(iter(loss))}' ({origin}) is not supported by posttrain "
                          "(a distillation file's loss_fn takes kl_type, mixed_kl_weight and zero_outside_topk)")
    out.update(_teacher(teacher, out, origin))
    return out


def _teacher(teacher: dict, policy_out: dict, origin: str) -> dict[str, Any]:
    """teacher.* -> distillation.teacher_models.teacher and the teacher's pass."""
    flat = Leaves(teacher).flat
    model = flat.get("model_name")
    if not model:
        raise ConfigError(f"teacher.model_name is not set ({origin}): the teacher's Hugging Face model directory")
    tokenizer = flat.get("tokenizer.name")
    if tokenizer not in (None, model):
        raise ConfigError(f"teacher.tokenizer.name={tokenizer} ({origin}): the teacher scores the student's token ids "
                          "with its own model directory's tokenizer, which must be the student's; drop this key")
    precision = flat.get("precision")
    if precision is not None and precision != policy_out.get("model.dtype", precision):
        warnings.warn(f"teacher.precision={precision} ({origin}): posttrain runs the teacher in the policy's "
                      f"precision ({policy_out['model.dtype']}): set, but unused", stacklevel=2)
    out: dict[str, Any] = {f"distillation.teacher_models.{TEACHER}.model_path": model}
    if flat.get("logprob_batch_size") is not None:
        out["distillation.log_prob_micro_batch_size"] = flat["logprob_batch_size"]
    if flat.get("dtensor_cfg.cpu_offload"):
        out["distillation.param_offload"] = True
    size = flat.get("dtensor_cfg.tensor_parallel_size")  # a large teacher split wider than its student
    if size is not None and size != policy_out.get("actor.tensor_parallel_size", 1):
        out["distillation.tensor_parallel_size"] = size
    return out

