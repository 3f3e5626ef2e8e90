"""NeMo-RL's GRPO layout: a resolved tree (files.py reads the files and applies the overrides)
-> posttrain's keys, with the tables of keys.py.

    translate({"grpo": {"max_num_steps": 20}}, "in run.yaml")   # {"trainer.total_training_steps": 20}

Where NeMo-RL's meaning differs from verl's, NeMo-RL's keys keep NeMo-RL's:
`policy.train_global_batch_size` counts samples (verl's mini-batch counts
prompts), `grpo.use_leave_one_out_baseline` picks the leave-one-out GRPO
estimator, `checkpointing.keep_top_k` with `metric_name: null` keeps the
newest k, `grpo.max_num_epochs` caps `grpo.max_num_steps`, validation samples
at `policy.generation.val_temperature` (the training temperature unless set).

Every leaf of the file is accounted for: mapped, an "off" value of a feature
posttrain does not have, a setting of a section the file disables
(`megatron_cfg.enabled: false`), or an engine/launcher tuning knob with no
effect on the result (TUNING). Anything else is refused with one line.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any

from posttrain.config.checks import whole
from posttrain.config.dialects.nemo_rl.cluster import split
from posttrain.config.dialects.nemo_rl.rollout_correction import from_nemo_rl
from posttrain.config.dialects.nemo_rl.keys import (IS_CORRECTION, KL_IN_REWARD, KL_TYPES, OFF, OTHER_TRAINERS, RENAMES,
                                                    SWITCHED, TUNING, VALIDATION_SPLITS)
from posttrain.config.dialects.nemo_rl.policy import ABSENT, Leaves, checkpointing_and_logger, policy
from posttrain.config.dialects.nemo_rl.vlm import multimodal, vlm_envs
from posttrain.errors import ConfigError
from posttrain.text.lines import clipped


def translate(tree: dict, origin: str, reward_share: bool = True) -> dict[str, Any]:
    """A resolved NeMo-RL tree -> {posttrain key: value}. ConfigError names the first NeMo-RL key
    posttrain cannot honour. reward_share: a reward model's resources are its own in the cluster split (GRPO's
    and PPO's rule; distillation.py passes false)."""
    if "ppo" in tree:  # NeMo-RL's PPO layout: grpo.*'s with a value model (ppo.py)
        from posttrain.config.dialects.nemo_rl.ppo import translate_ppo

        return translate_ppo(tree, origin, translate)
    if {"distillation", "teacher", "teachers"} & set(tree):  # NeMo-RL's distillation layout (distillation.py)
        from posttrain.config.dialects.nemo_rl.distillation import translate_distillation

        return translate_distillation(tree, origin, translate)
    f = Leaves(tree)
    out: dict[str, Any] = {}
    for section, what in OTHER_TRAINERS.items():
        if f.under(section):
            raise ConfigError(f"{section}.* ({origin}): {what} is not supported by posttrain train, which runs "
                              "NeMo-RL's GRPO layout (grpo.*)")
    for section, why in SWITCHED.items():
        if f.get(f"{section}.enabled") is True:
            raise ConfigError(f"{section}.enabled=true ({origin}): {why}")
        f.under(section)
    for nemo, ours in RENAMES.items():
        if f.has(nemo):
            out[ours] = f.get(nemo)
    _grpo(f, out, origin)
    _async(f, out, origin, reward_share)
    _loss(f, out, origin)
    policy(f, out, origin)
    _force_on_policy(f, out, origin)
    checkpointing_and_logger(f, out, origin)
    _data(f, out, origin)
    _env(f, out, origin)
    multimodal(f, out, origin)
    _splits(f, origin)
    for key, value in f.left().items():
        allowed = next((v for pattern, v in OFF.items() if fnmatch.fnmatchcase(key, pattern)), None)
        if allowed is not None and value in allowed:
            continue
        if allowed is not None:
            raise ConfigError(f"{key}={clipped(value)} ({origin}) is not supported by posttrain; set it to "
                              f"{' or '.join('null' if a is None else str(a).lower() for a in allowed)}")
        if any(fnmatch.fnmatchcase(key, pattern) or key == pattern.removesuffix(".*") for pattern in TUNING):
            continue
        raise ConfigError(f"NeMo-RL key {key!r} ({origin}) is not supported by posttrain{_nearest(key)} "
                          "(the guide docs/coming-from-nemo-rl.md lists the keys)")
    return {k: v for k, v in out.items() if v is not ABSENT}


def _grpo(f: Leaves, out: dict, origin: str) -> None:
    name = f.get("grpo.adv_estimator.name", "grpo")
    normalize = f.get("grpo.adv_estimator.normalize_rewards", f.get("grpo.normalize_rewards", True))
    loo = f.get("grpo.adv_estimator.use_leave_one_out_baseline", f.get("grpo.use_leave_one_out_baseline", False))
    if f.has("grpo.adv_estimator.name") or f.has("grpo.use_leave_one_out_baseline") or f.has("grpo.normalize_rewards"):
        if name == "grpo":
            out["algorithm.adv_estimator"] = "grpo_loo" if loo else "grpo"
            out["algorithm.norm_adv_by_std_in_grpo"] = bool(normalize)
        elif name == "reinforce_plus_plus":
            baseline = f.get("grpo.adv_estimator.minus_baseline", True)
            out["algorithm.adv_estimator"] = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
        elif name == "gdpo":  # each reward component normalized in its group (the rewards' dict: math_multi_reward)
            out["algorithm.adv_estimator"] = "gdpo"
            out["algorithm.norm_adv_by_std_in_grpo"] = bool(normalize)
            out["algorithm.gdpo.leave_one_out"] = bool(loo)
            if f.get("grpo.adv_estimator.reward_weights") is not None:
                out["algorithm.gdpo.reward_weights"] = list(f.get("grpo.adv_estimator.reward_weights"))
        else:
            raise ConfigError(f"grpo.adv_estimator.name={name} ({origin}) is not supported; use grpo, gdpo or "
                              "reinforce_plus_plus (posttrain's algorithm.adv_estimator lists more)")
    f.get("grpo.adv_estimator.minus_baseline")
    if f.get("grpo.reward_scaling.enabled", False) is True:  # clamp to the source range, map onto the target's
        out["reward.scaling.enable"] = True
        for key in ("source_min", "source_max", "target_min", "target_max"):
            if f.has(f"grpo.reward_scaling.{key}"):
                out[f"reward.scaling.{key}"] = f.get(f"grpo.reward_scaling.{key}")
    f.under("grpo.reward_scaling")
    coef = f.get("grpo.reward_shaping.stop_properly_penalty_coef")
    if f.has("grpo.reward_shaping.enabled"):
        out["reward.overlong_buffer.enable"] = bool(f.get("grpo.reward_shaping.enabled"))
        if out["reward.overlong_buffer.enable"] and coef is not None:  # ProRL v2: it replaces the overlong buffer
            out["reward.truncated_scale"] = coef
            out["reward.overlong_buffer.enable"] = False
        if not out["reward.overlong_buffer.enable"]:  # its other settings then do nothing
            for key in ("len", "penalty_factor", "max_resp_len"):
                out.pop(f"reward.overlong_buffer.{key}", None)


def _async(f: Leaves, out: dict, origin: str, reward_share: bool) -> None:
    """grpo.async_grpo.* and policy.generation.colocated.* -> async_training.*: async GRPO is posttrain's
    asynchronous training, k = max_trajectory_age_steps; generation on resources of its own without it is the
    rollout in workers of its own, synchronous (k = 0). Generation on GPUs of its own splits the cluster between
    the rollout and the trainer as NeMo-RL does (cluster.py)."""
    a = "grpo.async_grpo."
    single_controller = f.under("async_rl")
    if single_controller and f.has("grpo.async_grpo"):  # grpo.async_grpo: null selects NeMo-RL's other path
        raise ConfigError(f"grpo.async_grpo=null with async_rl.* ({origin}): NeMo-RL's single-controller "
                          "asynchronous GRPO is not supported; posttrain's is grpo.async_grpo.enabled=true "
                          "(async_training.* in posttrain's keys)")
    on, colocated = f.get(a + "enabled", False), f.get("policy.generation.colocated.enabled", True)
    for key, value in ((a + "enabled", on), ("policy.generation.colocated.enabled", colocated)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{key}={clipped(value)} ({origin}): true or false")
    age, in_flight = f.get(a + "max_trajectory_age_steps", 1), f.get(a + "in_flight_weight_updates", False)
    # NeMo-RL's AsyncTrajectoryCollector stops the run once more than this many rollout batches failed in a row (a
    # batch done resets the count; 0: the first failure). posttrain counts the failures of the whole run, each a
    # dead rollout worker replaced and its prompts sampled again: a run NeMo-RL stops stops here too, at the same
    # failure or before. Synchronous (enabled: false), NeMo-RL does not read it: the first failure stops the run.
    failures = f.get(a + "max_generation_failures")
    if failures is not None and not whole(failures):
        raise ConfigError(f"{a}max_generation_failures={clipped(failures)} ({origin}): an integer >= 0")
    f.under("policy.generation.colocated.resources")  # split reads it; with colocated generation nothing does
    if on or colocated is False:
        out["async_training.enable"] = True
        out["async_training.max_trajectory_age_steps"] = age if on else 0
        out["async_training.in_flight_weight_updates"] = bool(in_flight) if on else False
        out["async_training.max_rollout_failures"] = (failures or 0) if on else 0
    if colocated is False:
        out.update(split(f, origin, reward_share))


def _loss(f: Leaves, out: dict, origin: str) -> None:
    if f.has("loss_fn.reference_policy_kl_penalty"):
        coef = f.get("loss_fn.reference_policy_kl_penalty") or 0.0
        kind = f.get("loss_fn.reference_policy_kl_type", "k3")
        if kind not in KL_TYPES:
            raise ConfigError(f"loss_fn.reference_policy_kl_type={kind} ({origin}) is not one of: k1, k2, k3")
        if f.get("loss_fn.use_kl_in_reward", False):  # Reinforce++'s KL in the reward instead of the loss
            out.update({"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": coef,
                        "algorithm.kl_penalty": KL_IN_REWARD[kind], "actor.use_kl_loss": False})
        else:
            out.update({"actor.use_kl_loss": coef > 0, "actor.kl_loss_coef": coef, "actor.kl_loss_type": kind,
                        "algorithm.use_kl_in_reward": False})
    elif f.has("loss_fn.use_kl_in_reward"):
        out["algorithm.use_kl_in_reward"] = bool(f.get("loss_fn.use_kl_in_reward"))
    f.get("loss_fn.reference_policy_kl_type")
    seq_ratio = f.get("loss_fn.sequence_level_importance_ratios", False)
    if f.has("loss_fn.token_level_loss"):
        token = f.get("loss_fn.token_level_loss")
        out["actor.loss_agg_mode"] = "token-mean" if token else "seq-mean-token-mean"
    if seq_ratio:
        out["actor.policy_loss.loss_mode"] = "gspo"  # one importance ratio per sequence: GSPO
    _is_correction(f, out, origin, seq_ratio)


def _force_on_policy(f: Leaves, out: dict, origin: str) -> None:
    """loss_fn.force_on_policy_ratio: the update's old log-probs are its own forward's, detached (ratio 1):
    posttrain's actor.reuse_on_policy_log_probs, which needs one mini-batch per step, as NeMo-RL asserts."""
    force = f.get("loss_fn.force_on_policy_ratio", False)
    if force is True:
        prompts, mini = out.get("data.train_batch_size"), out.get("actor.ppo_mini_batch_size")
        if prompts is not None and mini is not None and mini < prompts:
            raise ConfigError(f"loss_fn.force_on_policy_ratio=true ({origin}) needs one update per step: "
                              "policy.train_global_batch_size = grpo.num_prompts_per_step x "
                              f"grpo.num_generations_per_prompt (now {mini} of {prompts} prompts per update)")
        out["actor.reuse_on_policy_log_probs"] = True
        out["actor.ppo_epochs"] = 1
    elif force is not False:
        raise ConfigError(f"loss_fn.force_on_policy_ratio={clipped(force)} ({origin}): true or false")


def _is_correction(f: Leaves, out: dict, origin: str, sequence_level) -> None:
    """loss_fn's importance-sampling correction (NeMo-RL weighs the loss by pi_old / pi_rollout, its
    prev_logprobs / generation_logprobs: posttrain's decoupled mode) -> algorithm.rollout_correction.*,
    every key set (posttrain's default truncation at 2 is not NeMo-RL's); nothing with it off."""
    use, kind, ratio, ratio_min = (f.get(key) for key in IS_CORRECTION)
    for key, value in ((IS_CORRECTION[0], use), ("loss_fn.sequence_level_importance_ratios", sequence_level)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{key}={clipped(value)} ({origin}): true or false")
    for key, value in zip(IS_CORRECTION[2:], (ratio, ratio_min)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{key}={clipped(value)} ({origin}): a number or null")
    try:
        keys = from_nemo_rl(bool(use), kind, ratio, ratio_min, sequence_level=bool(sequence_level))
    except ValueError as e:  # "loss_fn.KEY: why" -> the loader's one line, the key and its value first
        key, _, why = str(e).partition(": ")
        value = f.flat.get(key)
        raise ConfigError(f"{key}={'null' if value is None else clipped(value)} ({origin}): {why}") from None
    out.update({f"algorithm.rollout_correction.{k}": v for k, v in keys.items()})


def _data(f: Leaves, out: dict, origin: str) -> None:
    for split in ("train", "validation"):
        if isinstance(f.flat.get(f"data.{split}"), list):
            raise ConfigError(f"data.{split} is a list of datasets ({origin}): give posttrain their parquet files, "
                              f"data.{'train' if split == 'train' else 'val'}_files=[a.parquet,b.parquet] (`posttrain "
                              "preprocess` writes them), instead of NeMo-RL's per-dataset entries")
    if f.has("data.add_system_prompt"):  # NeMo-RL hands it to the chat template; so does posttrain
        out["data.apply_chat_template_kwargs"] = {**out.get("data.apply_chat_template_kwargs", {}),
                                                  "add_system_prompt": f.get("data.add_system_prompt")}
    repeat = f.get("data.validation.repeat")
    if repeat:  # each validation prompt k times: k samples per prompt
        out["rollout.val_kwargs.n"] = repeat * out.get("rollout.val_kwargs.n", 1)
    size = f.get("data.train.split_validation_size")
    if size:  # NeMo-RL holds out this share of the training rows for validation when no validation set is named
        out["data.val_split_size"] = size
    for split, ours in (("train", "data.dataset_name"), ("validation", "data.val_dataset_name")):
        name = f.get(f"data.{split}.dataset_name")
        if split == "train" and name is None:
            name = f.get("data.dataset_name")  # the older flat layout
        path = f.get(f"data.{split}.data_path")
        if path is not None:
            if not str(path).endswith(".parquet"):
                raise ConfigError(f"data.{split}.data_path={path} ({origin}): posttrain reads parquet rows in its "
                                  "(verl's) layout; convert it with `posttrain preprocess` and give the .parquet")
            out["data.train_files" if split == "train" else "data.val_files"] = [path]
        elif name is not None:
            out[ours] = name
        if f.get(f"data.{split}.seed") is not None:
            out["data.seed"] = f.get(f"data.{split}.seed")

    for key in ("prompt_file", "system_prompt_file"):  # a split's own first (validation's), then the defaults
        for where in ("validation", "train", "default", None):
            spelled = f"data.{where}.{key}" if where else f"data.{key}"
            if f.has(spelled):
                out.setdefault(f"data.{key}", f.get(spelled))
    f.get("data.validation")


def _splits(f: Leaves, origin: str) -> None:
    """data.train.split / data.validation.split: a named dataset's split; posttrain's train on their train split
    and validate on their test split (checked after the environments, whose refusals say more)."""
    for split, allowed in (("train", ("train",)), ("validation", ("test", "validation"))):
        part = f.get(f"data.{split}.split")
        name = f.flat.get(f"data.{split}.dataset_name")
        if split == "validation" and name in VALIDATION_SPLITS:  # NeMo-RL's names of the split posttrain tests on
            allowed = VALIDATION_SPLITS[name]
        if part is not None and part not in allowed:
            ours = f" ({name}'s is NeMo-RL's {' or '.join(allowed)})" if split == "validation" and \
                name in VALIDATION_SPLITS else ""
            raise ConfigError(f"data.{split}.split={clipped(part)} ({origin}): posttrain's named datasets "
                              f"{'train on their train' if split == 'train' else 'validate on their test'} split"
                              f"{ours}; give the file instead (data.train_files / data.val_files)")


def _env(f: Leaves, out: dict, origin: str) -> None:
    envs = {k.split(".")[1] for k in f.flat if k.startswith("env.")}
    used = {f.flat.get(f"data.{s}.env_name") for s in ("default", "train", "validation")} - {None}
    if "reward_model" in envs and "reward_model" in used:  # a reward model scores every response
        rm = f.under("env.reward_model")
        out["reward.model.enable"] = True
        out["reward.model.path"] = rm.get("env.reward_model.model_name")
        if rm.get("env.reward_model.batch_size"):
            out["reward.model.micro_batch_size"] = rm["env.reward_model.batch_size"]
        if rm.get("env.reward_model.max_model_len"):
            out["reward.model.max_length"] = rm["env.reward_model.max_model_len"]
        if rm.get("env.reward_model.tokenizer.name") not in (None, out["reward.model.path"]):
            raise ConfigError(f"env.reward_model.tokenizer.name ({origin}): posttrain uses the reward model "
                              "directory's own tokenizer; drop the key")
        for key in ("data.default.env_name", "data.train.env_name", "data.validation.env_name"):
            f.get(key)
        envs.discard("reward_model")
    if "math_multi_reward" in envs and "math_multi_reward" in used:  # GDPO's: correctness, integer and format
        impl = f.get("env.math_multi_reward.math_verify_impl", "hf_math_verify")
        if impl != "hf_math_verify":
            raise ConfigError(f"env.math_multi_reward.math_verify_impl={clipped(impl)} ({origin}) is not supported; "
                              "posttrain's math_multi_reward is NeMo-RL's hf_math_verify")
        if f.get("env.math_multi_reward.num_workers") is not None:
            out.setdefault("reward.num_workers", f.get("env.math_multi_reward.num_workers"))
        f.under("env.math_multi_reward")
        out["reward.data_source"] = "math_multi_reward"
        envs.discard("math_multi_reward")
    envs -= vlm_envs(f, out, origin, envs)
    if "sliding_puzzle_game" in envs:  # NeMo-RL's game, built in: posttrain.envs.sliding_puzzle
        _sliding_puzzle(f, out)
        envs.discard("sliding_puzzle_game")
    turns = f.get("grpo.max_rollout_turns")
    if turns not in (None, 1) and not out.get("rollout.multi_turn.environment"):
        raise ConfigError(f"grpo.max_rollout_turns={turns} ({origin}): turns after the first need an environment "
                          "(env.sliding_puzzle_game, or posttrain's rollout.multi_turn.environment); set it to 1")
    other = sorted(envs - {"math"})
    if other == ["reward_model"]:  # set, but no data split scores with it
        raise ConfigError(f"env.reward_model ({origin}) is set but no data.*.env_name names it; set "
                          "data.default.env_name=reward_model to score with it, or drop env.reward_model")
    if other:
        raise ConfigError(f"env.{other[0]} ({origin}): posttrain scores with reward functions by data_source (math, "
                          "gsm8k, ...) and built-in environments; NeMo-RL environments other than math, "
                          "math_multi_reward, reward_model, sliding_puzzle_game and the VLM environment "
                          "(env.<name>.reward_functions) are not supported")


def _sliding_puzzle(f: Leaves, out: dict) -> None:
    """env.sliding_puzzle_game.cfg.{game_config.size, game_config.shuffle_moves, max_moves} -> the built-in game;
    grpo.max_rollout_turns -> its turns; its data: the sliding_puzzle dataset of seeds (NeMo-RL's example script
    generates its puzzles and reads no data.* dataset either)."""
    g = "env.sliding_puzzle_game.cfg."
    kwargs = {"size": f.get(g + "game_config.size", 3), "shuffle_moves": f.get(g + "game_config.shuffle_moves", 10),
              "max_moves": f.get(g + "max_moves", 30)}
    f.under("env.sliding_puzzle_game")
    out.update({"rollout.multi_turn.enable": True,
                "rollout.multi_turn.environment": "posttrain.envs.sliding_puzzle:SlidingPuzzle",
                "rollout.multi_turn.environment_kwargs": kwargs})
    if f.get("grpo.max_rollout_turns") is not None:
        out["rollout.multi_turn.max_assistant_turns"] = f.get("grpo.max_rollout_turns")
    for key in ("data.train_files", "data.val_files", "data.val_dataset_name", "data.prompt_file",
                "data.system_prompt_file"):  # its script reads no data.* dataset or prompt
        out.pop(key, None)
    out["data.dataset_name"] = "sliding_puzzle"


def _nearest(key: str) -> str:
    known = [*RENAMES, *OFF, *IS_CORRECTION, *(f"{s}.enabled" for s in SWITCHED)]
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""
