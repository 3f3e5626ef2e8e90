"""verl's own answers for tests/test_verl_crosscheck.py, computed in a process of their own.

    python tests/verl_reference.py CASES.pt ANSWERS.pt [VERL_DIR]

VERL_DIR (appended to sys.path, after every installed package) holds verl 0.9.1 and the few packages its
`core_algos` imports beyond posttrain's (the Makefile's `$(VENV)/verl`); without it verl must be importable.
verl is imported only here, never in the test process: its import configures logging and reads Ray
flags, which must not leak into the rest of the suite.

CASES.pt is a list of dicts (torch.save):
    {"kind": "adv",  "name": ESTIMATOR, "kwargs": {...}, "algo": {AlgoConfig fields}}
    {"kind": "loss", "name": POLICY_LOSS, "old_log_prob", "log_prob", "advantages", "response_mask",
     "loss_agg_mode", "actor": {ActorConfig fields}, "loss_scale_factor"}
    {"kind": "kl",   "name": KL_KIND, "log_prob", "ref_log_prob"}
    {"kind": "sizes", "name": "actor" | "critic", "config": {FSDPActorConfig / FSDPCriticConfig fields},
     "n_gpus", "train_batch_size"}: verl's own checks of its micro-batch sizes (the dataclass, then its validate)
ANSWERS.pt: {"registries": {"adv": [...], "loss": [...]}, "answers": one per case, in order}:
    adv  -> (advantages, returns);  kl -> (value, d sum(value) / d log_prob)
    loss -> {"pg_loss", "grad" (d pg_loss / d log_prob), and verl's metrics, without the "actor/" prefix}
    sizes -> {"accepted": True}
    a case verl rejects -> {"error": "TypeName: message"}
"""

import inspect
import sys

import numpy as np
import torch


def adv_answer(core_algos, case):
    from verl.trainer.config import AlgoConfig

    kwargs = dict(case["kwargs"])
    if "index" in kwargs:
        kwargs["index"] = np.array(kwargs["index"], dtype=object)  # what verl's trainer passes (uids)
    # verl's estimators change token_level_rewards in place (GRPO assigns into its sum): fresh copies
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    fn = core_algos.get_adv_estimator_fn(case["name"])
    if "config" in inspect.signature(fn).parameters:  # verl's trainer calls GAE with its own arguments only
        kwargs["config"] = AlgoConfig(**case["algo"])
    return tuple(fn(**kwargs))


def loss_answer(core_algos, case):
    from verl.workers.config import ActorConfig

    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                        loss_scale_factor=case["loss_scale_factor"], **case["actor"])
    # as verl's workers/utils/losses.py: the policy losses pass global_batch_info on to agg_loss
    actor.global_batch_info["loss_scale_factor"] = actor.loss_scale_factor
    log_prob = case["log_prob"].clone().requires_grad_(True)
    pg_loss, metrics = core_algos.get_policy_loss_fn(case["name"])(
        old_log_prob=case["old_log_prob"], log_prob=log_prob, advantages=case["advantages"],
        response_mask=case["response_mask"], loss_agg_mode=case["loss_agg_mode"], config=actor)
    (grad,) = torch.autograd.grad(pg_loss, log_prob)
    return {"pg_loss": pg_loss.detach(), "grad": grad,
            **{k.removeprefix("actor/"): torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()}}


def kl_answer(core_algos, case):
    log_prob = case["log_prob"].clone().requires_grad_(True)
    value = core_algos.kl_penalty(log_prob, case["ref_log_prob"], case["name"])
    (grad,) = torch.autograd.grad(value.sum(), log_prob)
    return value.detach(), grad


def sizes_answer(core_algos, case):
    from verl.workers.config import FSDPActorConfig, FSDPCriticConfig

    config = {"actor": FSDPActorConfig, "critic": FSDPCriticConfig}[case["name"]](strategy="fsdp", **case["config"])
    config.validate(case["n_gpus"], case["train_batch_size"])
    return {"accepted": True}


def main(argv):
    if len(argv) > 3:
        sys.path.append(argv[3])
    from verl.trainer.ppo import core_algos

    answer = {"adv": adv_answer, "loss": loss_answer, "kl": kl_answer, "sizes": sizes_answer}
    out = []
    for case in torch.load(argv[1], weights_only=True):
        try:
            out.append(answer[case["kind"]](core_algos, case))
        except Exception as e:  # noqa: BLE001 - the test says which case verl refused, and why
            out.append({"error": f"{type(e).__name__}: {e}"})
    registries = {"adv": sorted(core_algos.ADV_ESTIMATOR_REGISTRY), "loss": sorted(core_algos.POLICY_LOSS_REGISTRY)}
    torch.save({"registries": registries, "answers": out, "verl": core_algos.__file__}, argv[2])


if __name__ == "__main__":
    main(sys.argv)
