"""posttrain's estimators, policy losses and KL estimators against verl 0.9.1's own `core_algos`, for every
name both implement (the shared names are read from both registries, so one added on either side is
compared or the test says which has no case).

verl runs in a child process (tests/verl_reference.py) from the folder `make test` installs it into,
`.venv/verl` (pip --target --no-deps: verl and the four packages core_algos imports beyond posttrain's;
posttrain's own packages are left as they are), or from $POSTTRAIN_VERL_PATH, or wherever the
interpreter already finds it. Without verl the test skips, and under CI=true fails.

The inputs are small hand-made tensors in float64: groups of 1 to 4 rows given in no order, right-padded
rows of every length (0 included), rows with masked tokens inside them (tool output), rewards and
advantages of both signs, zero scores, ratios far outside every clip range and past every clamp. Values
and gradients are compared to within verl's own 1e-8 epsilons (see TOL), everywhere in the tensors except
where posttrain documents that it differs from verl (GAE and ReMax in masked positions, which no loss
reads).

verl's deprecated global micro-batch sizes: verl 0.9.1's own checks of them (its FSDPActorConfig and
FSDPCriticConfig: a global and a per-GPU size both set, and a global size under one sequence per data-parallel
worker, are refused) against posttrain's, at 1 to 8 workers with and without Ulysses. The division itself is not
verl 0.9.1's code: its engine workers read only the *_per_gpu keys, and the `size // (workers / Ulysses size)` of
verl 0.4-0.7's fsdp_workers.py (a worker class that needs GPUs and a process group) is read, not run; the
hand-computed cases of tests/test_verl_batch_sizes.py hold it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import ADV_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, POLICY_LOSSES, compute_advantages
from posttrain.algorithms import get_policy_loss, kl_penalty
from posttrain.config import load_config
from posttrain.errors import ConfigError

HERE = Path(__file__).parent
T = torch.tensor
F64 = torch.float64
# float64 inputs: equal to about 1e-8, verl's own epsilon in two divisors (masked_whiten divides by
# n + 1e-8 valid tokens, seq-mean-token-mean by length + 1e-8), below float32's rounding (1.2e-7)
TOL = {"rtol": 1e-7, "atol": 1e-8}
INSTALL = "make test (it installs verl into .venv/verl), or: pip install --no-deps --target .venv/verl " \
          "verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 codetiming==1.4.0"


def verl_dir() -> str | None:
    """The folder to add to the child's path ("" when the interpreter imports verl by itself); None: no verl."""
    for where in (os.environ.get("POSTTRAIN_VERL_PATH"), str(Path(sys.prefix) / "verl")):
        if where and (Path(where) / "verl" / "trainer" / "ppo" / "core_algos.py").is_file():
            return where
    return "" if importlib.util.find_spec("verl") is not None else None


# ---------------------------------------------------------------- the inputs

def right_padded(lengths, R):
    return (torch.arange(R) < T(lengths).unsqueeze(-1)).to(F64)  # [B, R]


# 12 rows, R = 5: rows of every length, two fully masked; groups in no order, sizes 4, 3, 2, 2 and 1
LENGTHS = [5, 3, 0, 1, 5, 4, 2, 5, 0, 5, 3, 2]
INDEX = ["a", "b", "a", "c", "b", "a", "d", "e", "c", "b", "a", "d"]
PAIRS = [g if g != "e" else "d" for g in INDEX]  # no group of one
MASK = right_padded(LENGTHS, 5)
# the same rows with holes inside (masked tool-output tokens between generated ones)
HOLES = MASK.clone()
HOLES[0, 1:3] = 0
HOLES[4, 2] = 0
HOLES[9, 0] = 0
HOLES[5, 1] = 0


def outcome_rewards(mask, scores):
    """scores [B] on each row's last valid token (a fully masked row: its score nowhere)."""
    last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(-1)  # [B]
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = T(scores, dtype=F64) * (mask.sum(-1) > 0)
    return out


# scores with ties, zeros (GPG counts the non-zero ones) and both signs; dense rewards of both signs
SCORES = [1.0, 0.0, 0.5, -1.0, 2.0, 1.0, 0.0, 0.7, 3.0, -0.5, 0.0, 0.25]
DENSE = torch.linspace(-1.3, 1.7, 60, dtype=F64).reshape(12, 5).roll(7).sin() * 2


def reward_sets():
    """(label, rewards, mask): outcome and dense rewards on right-padded rows and on rows with holes."""
    return [(f"{r}/{m}", rew * mask, mask)
            for m, mask in (("padded", MASK), ("holes", HOLES))
            for r, rew in (("outcome", outcome_rewards(mask, SCORES)), ("dense", DENSE))]


def estimator_cases(name):
    """-> [(label, our kwargs for compute_advantages, verl's kwargs, verl's AlgoConfig fields, compare)];
    compare "all" (every position) or "valid" (the mask's positions only: a documented difference)."""
    out = []
    for label, rewards, mask in reward_sets():
        base = {"token_level_rewards": rewards, "response_mask": mask}
        holes = label.endswith("holes")
        if name in ("grpo", "grpo_passk"):
            index = INDEX if name == "grpo" else PAIRS  # pass@k refuses a group of one (both do)
            for norm in (True, False):
                for eps in (1e-6, 0.1):
                    ours = {**base, "index": index, "norm_adv_by_std_in_grpo": norm, "epsilon": eps}
                    theirs = {**base, "index": index, "epsilon": eps, "norm_adv_by_std_in_grpo": norm}
                    if name == "grpo_passk":  # verl's pass@k reads the flag from its config only
                        theirs.pop("norm_adv_by_std_in_grpo")
                    out.append((f"{label} norm={norm} eps={eps}", ours, theirs,
                                {"norm_adv_by_std_in_grpo": norm}, "all"))
        elif name in ("rloo", "gpg", "reinforce_plus_plus_baseline"):
            out.append((label, {**base, "index": INDEX}, {**base, "index": INDEX}, {}, "all"))
        elif name == "reinforce_plus_plus":
            for gamma in (1.0, 0.9):
                out.append((f"{label} gamma={gamma}", {**base, "index": INDEX, "gamma": gamma}, base,
                            {"gamma": gamma}, "all"))
        elif name == "remax":
            baselines = torch.linspace(-1, 2, 12, dtype=F64)
            ours = {**base, "index": INDEX, "reward_baselines": baselines}
            out.append((label, ours, {**base, "reward_baselines": baselines}, {}, "valid" if holes else "all"))
        elif name == "gae":
            values = torch.linspace(-0.8, 1.1, 60, dtype=F64).reshape(12, 5).roll(3).cos()
            for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.5, 0.0)):
                kw = {**base, "values": values, "gamma": gamma, "lam": lam}
                out.append((f"{label} gamma={gamma} lam={lam}", {**kw, "index": INDEX}, kw, {}, "valid"))
        else:
            raise KeyError(name)
    return out


def policy_loss_cases(name):
    """-> [(label, kwargs for both)]: every aggregation, symmetric and asymmetric clip ranges (GSPO's own
    tiny ones too), two dual-clip bounds, a constant Dr. GRPO divisor or the padded length."""
    g = torch.Generator().manual_seed(3)
    log_prob = -torch.rand(12, 5, generator=g, dtype=F64) * 3  # [B, R], log-probs of sampled tokens
    # log-ratios from -2.5 to 2.5: ratios 0.08 to 12, inside and far outside every clip range
    old_log_prob = log_prob - torch.linspace(-2.5, 2.5, 60, dtype=F64)[torch.randperm(60, generator=g)].reshape(12, 5)
    old_log_prob[7] = log_prob[7] - 25  # ratios of e^25: past PPO's clamp of the log-ratio at 20, GSPO's at 10
    advantages = (torch.randn(12, 1, generator=g, dtype=F64) + torch.randn(12, 5, generator=g, dtype=F64) * 0.3)
    advantages[7] = -advantages[7].abs()  # A < 0: the unclipped side, where that clamp shows
    clips = [(0.2, 0.2, 3.0), (0.1, 0.28, 10.0)] + ([(3e-4, 4e-4, 3.0)] if name == "gspo" else [])
    out = []
    for mask_label, mask in (("padded", MASK), ("holes", HOLES)):
        for mode in LOSS_AGG_MODES:
            for scale in ((None, 7.0) if mode == "seq-mean-token-sum-norm" else (None,)):
                for low, high, c in clips:
                    out.append((f"{mask_label} {mode} scale={scale} clip=({low}, {high}, {c})",
                                {"old_log_prob": old_log_prob, "log_prob": log_prob,
                                 "advantages": advantages * mask, "response_mask": mask, "loss_agg_mode": mode,
                                 "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c,
                                 "loss_scale_factor": scale}))
    return out


def kl_inputs():
    """log_prob, ref [B, R]: differences from -30 to 30 (past k3's clamps on both sides), 0, and +-800
    (where exp overflows even in float64 without k3's clamp, and its gradient would be NaN)."""
    log_prob = -torch.linspace(0.1, 5, 60, dtype=F64).reshape(12, 5)
    d = torch.cat([torch.linspace(-30, 30, 57, dtype=F64), T([0.0, -800.0, 800.0], dtype=F64)])
    return log_prob, log_prob - d.reshape(12, 5)


# ---------------------------------------------------------------- verl's answers, once

@pytest.fixture(scope="module")
def verl(tmp_path_factory):
    """-> (verl's registries, {(kind, name, label): verl's answer})."""
    where = verl_dir()
    if where is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"verl is not installed: the cross-check against verl's core_algos must run in CI. {INSTALL}")
        pytest.skip(f"verl is not installed: {INSTALL}")
    cases, keys = [], []
    for name in ADV_ESTIMATORS:
        try:
            for label, _, theirs, algo, _ in estimator_cases(name):
                cases.append({"kind": "adv", "name": name, "kwargs": theirs, "algo": algo})
                keys.append(("adv", name, label))
        except KeyError:
            continue  # no case: the test below fails if verl has this estimator
    for name in POLICY_LOSSES:
        for label, kw in policy_loss_cases(name):
            actor = {"clip_ratio": kw["clip_ratio_low"], "clip_ratio_low": kw["clip_ratio_low"],
                     "clip_ratio_high": kw["clip_ratio_high"], "clip_ratio_c": kw["clip_ratio_c"]}
            cases.append({"kind": "loss", "name": name, "actor": actor,
                          **{k: kw[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask",
                                                "loss_agg_mode", "loss_scale_factor")}})
            keys.append(("loss", name, label))
    log_prob, ref = kl_inputs()
    for kind in KL_KINDS:
        cases.append({"kind": "kl", "name": kind, "log_prob": log_prob, "ref_log_prob": ref})
        keys.append(("kl", kind, ""))
    for role, size, workers, ulysses, per_gpu in size_cases():
        config = {"rollout_n": 8, "ppo_mini_batch_size": 60, "ppo_micro_batch_size": size,
                  "ppo_micro_batch_size_per_gpu": per_gpu, "ulysses_sequence_parallel_size": ulysses}
        cases.append({"kind": "sizes", "name": role, "config": config, "n_gpus": workers, "train_batch_size": 60})
        keys.append(("sizes", role, (size, workers, ulysses, per_gpu)))
    tmp = tmp_path_factory.mktemp("verl")
    torch.save(cases, tmp / "cases.pt")
    cmd = [sys.executable, str(HERE / "verl_reference.py"), str(tmp / "cases.pt"), str(tmp / "answers.pt")]
    proc = subprocess.run(cmd + ([where] if where else []), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp / "answers.pt", weights_only=True)
    assert "verl" in got["verl"] and got["verl"].endswith("core_algos.py")
    return got["registries"], dict(zip(keys, got["answers"]))


def size_cases():
    """(role, global size, workers, Ulysses size, per-GPU size or None): 60 prompts x 8 samples a mini-batch, a
    global size of 1 to 6 sequences (each divides 60 prompts, as verl's actor asks), 1 to 8 workers."""
    for role in ("actor", "critic"):
        for workers, ulysses in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 2), (8, 4)):
            for size in range(1, 7):
                yield role, size, workers, ulysses, None
        yield role, 8, 2, 1, 4  # both set


def no_error(answer, what):
    assert not (isinstance(answer, dict) and "error" in answer), f"verl refused {what}: {answer['error']}"


def test_every_estimator_both_have_matches_verls(verl):
    registries, answers = verl
    shared = sorted(set(ADV_ESTIMATORS) & set(registries["adv"]))
    # what verl 0.9.1 and posttrain share today; grpo_loo is NeMo-RL's, not verl's. gdpo is both frameworks', and
    # posttrain's is NeMo-RL's: verl whitens the weighted sum over tokens (a long response weighs more) and gives a
    # prompt with one sample its score, NeMo-RL whitens over sequences and gives it 0 (docs/algorithms.md)
    assert shared == ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                      "remax", "rloo"]
    shared.remove("gdpo")
    assert sorted(set(ADV_ESTIMATORS) - set(registries["adv"])) == ["grpo_loo"]
    compared = 0
    for name in shared:
        for label, ours_kw, _, _, where in estimator_cases(name):
            theirs = answers[("adv", name, label)]
            no_error(theirs, f"{name} {label}")
            ours = compute_advantages(name, **ours_kw)
            keep = ours_kw["response_mask"].bool() if where == "valid" else torch.ones(12, 5, dtype=torch.bool)
            for what, a, b in zip(("advantages", "returns"), ours, theirs):
                assert a.abs().sum() > 0, f"{name} {label}: {what} all 0 (the case shows nothing)"
                torch.testing.assert_close(a[keep], b.to(F64)[keep], **TOL,
                                           msg=lambda m: f"{name} {label} {what}: {m}")
            compared += 1
    assert compared == 68  # every case of estimator_cases, each once


def test_every_policy_loss_both_have_matches_verls_value_gradient_and_metrics(verl):
    registries, answers = verl
    shared = sorted(set(POLICY_LOSSES) & set(registries["loss"]))
    assert shared == sorted(POLICY_LOSSES) == ["gpg", "gspo", "vanilla"]  # all of posttrain's are verl's
    for name in shared:
        clipped = 0.0
        for label, kw in policy_loss_cases(name):
            theirs = answers[("loss", name, label)]
            no_error(theirs, f"{name} {label}")
            log_prob = kw["log_prob"].clone().requires_grad_(True)
            ours = get_policy_loss(name)(**{**kw, "log_prob": log_prob})
            (grad,) = torch.autograd.grad(ours["pg_loss"], log_prob)
            msg = f"{name} {label}"
            torch.testing.assert_close(ours["pg_loss"].detach(), theirs["pg_loss"], **TOL,
                                       msg=lambda m: f"{msg} pg_loss: {m}")
            torch.testing.assert_close(grad, theirs["grad"], **TOL,
                                       msg=lambda m: f"{msg} gradient: {m}")
            assert grad.abs().sum() > 0
            # verl's gpg reports no metrics; its others report these three, computed in float64 here
            for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
                if key in theirs:
                    torch.testing.assert_close(ours[key].to(F64), theirs[key], **TOL,
                                               msg=lambda m: f"{msg} {key}: {m}")
            assert set(theirs) - {"pg_loss", "grad"} == (set() if name == "gpg" else
                                                           {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})
            clipped += float(ours["pg_clipfrac"])
        # the cases reach the clipped regions (gpg has no clip)
        assert (clipped > 0) == (name != "gpg")


def test_every_kl_kind_matches_verls_value_and_gradient(verl):
    _, answers = verl
    log_prob, ref = kl_inputs()
    for kind in KL_KINDS:  # kl k1 abs mse k2 low_var_kl k3, and each with "+" (k2's gradient)
        theirs = answers[("kl", kind, "")]
        no_error(theirs, kind)
        lp = log_prob.clone().requires_grad_(True)
        value = kl_penalty(lp, ref, kind)
        (grad,) = torch.autograd.grad(value.sum(), lp)
        torch.testing.assert_close(value.detach(), theirs[0], **TOL, msg=lambda m: f"{kind}: {m}")
        torch.testing.assert_close(grad, theirs[1], **TOL, msg=lambda m: f"{kind} grad: {m}")
    # the cases reach k3's clamps: its value is 10 somewhere, and its "+" gradient is k2's, not its own
    k3 = answers[("kl", "k3", "")]
    assert k3[0].max() == 10 and not torch.equal(answers[("kl", "k3+", "")][1], k3[1])


# verl's spelling of each role's global size (its per-GPU one: + "_per_gpu")
GLOBAL_KEY = {"actor": "actor_rollout_ref.actor.ppo_micro_batch_size", "critic": "critic.ppo_micro_batch_size"}


def test_verls_checks_of_a_global_micro_batch_refuse_what_posttrain_refuses(verl):
    _, answers = verl
    refused = accepted = 0
    for role, size, workers, ulysses, per_gpu in size_cases():
        theirs = answers[("sizes", role, (size, workers, ulysses, per_gpu))]
        nodes = 2 if workers == 8 else 1  # 8 workers as 2 nodes of 4: verl and posttrain count nnodes x per node
        overrides = ["actor_rollout_ref.model.path=/m", "data.train_batch_size=60", "algorithm.adv_estimator=gae",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=60", "actor_rollout_ref.rollout.n=8",
                     f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={workers // nodes}",
                     f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={ulysses}", f"{GLOBAL_KEY[role]}={size}"]
        overrides += [f"{GLOBAL_KEY[role]}_per_gpu={per_gpu}"] if per_gpu else []
        case = f"{role} {GLOBAL_KEY[role]}={size} per_gpu={per_gpu} on {workers} workers, Ulysses {ulysses}"
        if "error" in theirs:
            with pytest.raises(ConfigError) as e:
                load_config(None, overrides)
            said = "are both set" if per_gpu else "it is 0 per worker"
            assert said in str(e.value), f"{case}: verl: {theirs['error']}; posttrain: {e.value}"
            assert ("set both" if per_gpu else "must be >= n_gpus") in theirs["error"], case
            refused += 1
        else:
            cfg = load_config(None, overrides)  # verl accepts: so does posttrain, each worker taking its share
            per_worker = cfg.actor.ppo_micro_batch_size if role == "actor" else cfg.critic.ppo_micro_batch_size_per_gpu
            assert per_worker == size // (workers // ulysses) > 0, case
            accepted += 1
    # per role: 9 sizes under one a worker (1 at 2 data-parallel workers x 3 layouts, 1-3 at 4 x 2) and one both set
    assert (refused, accepted) == (2 * 10, 2 * 33)
