"""NeMo-RL's config layout: its files (with `defaults:`), its Hydra-style overrides, and the places
where its keys mean something else than verl's (train_global_batch_size counts samples,
use_leave_one_out_baseline, keep_top_k without a metric), and NeMo-RL's own example configs
(tests/data/nemo_rl/examples_*.json, from bench/nemo_rl_configs.py) loading as the guide's section 6 says."""

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from posttrain.config.dialects.nemo_rl import files as nemo_rl, grpo
from posttrain.arguments import split_train_args
from posttrain.config import config_to_dict, load_config
from posttrain.errors import ConfigError

from helpers import read_metrics

HERE = Path(__file__).parent / "data" / "nemo_rl"
BASE, SEED = str(HERE / "grpo_base.yaml"), str(HERE / "grpo_seed.yaml")
FSDP2 = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true", "++policy.optimizer.kwargs.lr=2e-6"]
GUIDE = Path(__file__).parents[1] / "docs" / "coming-from-nemo-rl.md"

# NeMo-RL's own top-level examples/configs/*.yaml, each as the loader reads it (its `defaults:` merged in), written
# by `python bench/nemo_rl_configs.py --nemo-rl DIR --generate tests/data/nemo_rl` from a checkout at the named commit
EXAMPLES = HERE / "examples_7ea279a.json"
LOADS, SWITCHED = "loads", "loads with the FSDP2 switch"
# What `posttrain train --config FILE` (`posttrain sft` for an SFT file) makes of each, as the guide's section 6
# lists them: it loads, it loads with section 2's FSDP2 switch, or it is refused (a Megatron file with the switch)
# in one line naming this NeMo-RL key
EXAMPLE_OUTCOMES = {
    "grpo_math_1B": LOADS, "grpo_math_8B": LOADS, "grpo_smoke": LOADS, "grpo_rm_1B": LOADS,
    "grpo_math_1B_megatron": SWITCHED, "grpo_math_8B_megatron": SWITCHED, "grpo_math_70B_megatron": SWITCHED,
    "grpo_math_qwen30ba3b_megatron": SWITCHED,
    "grpo_math_70B_megatron_fp8": SWITCHED, "grpo_math_8B_megatron_fp8": SWITCHED,  # with raw token IS weights
    "grpo_math_1B_dynamo": "policy.generation.backend",
    "grpo_math_1B_sglang": "policy.generation.backend", "grpo_math_1B_trtllm": "policy.generation.backend",
    "grpo_math_1B_megatron_single_controller": "grpo.async_grpo",
    "grpo_math_8B_megatron_nixl": SWITCHED,  # generation on a node of its own: asynchronous training, k = 0
    "grpo_multiple_datasets": "data.train",
    "grpo_sliding_puzzle": LOADS,
    "prorlv2.v2": LOADS, "prorlv2_1_moe.v2": LOADS,
    "gdpo_math_1B": LOADS,
    "ppo_math_1B": LOADS, "ppo_math_1B_megatron": "value.megatron_cfg.enabled",
    "sft": "data.train.dataset_name", "sft_avlm": "data.train.dataset_name",  # Hub sets: give data.train_files
    "sft_vlm_3B": "data.train.dataset_name",
    # OpenMathInstruct-2's SFT rows (its generated_solution): posttrain's named set, prepared once
    "sft_openmathinstruct2": LOADS, "sft_openmathinstruct2_megatron": SWITCHED,
    "dpo": "dpo", "rm": "rm",
    "distillation_math": LOADS,  # tensor parallel 2 x context parallel (Ulysses) 2
    "distillation_math_megatron": SWITCHED,
    "xtoken_off_policy_distillation": "teachers", "xtoken_multiteacher_off_policy_distillation": "teachers",
    "audio_grpo_3B_megatron": "policy.generation.vllm_cfg.limit_mm_per_prompt.audio",  # with the FSDP2 switch
    "vlm_grpo_3B": LOADS, "vlm_grpo_3B_megatron": SWITCHED,  # its environment's reward_functions: reward.functions
}


def layer(path=None, *overrides):
    """The posttrain keys a NeMo-RL file (and overrides) map to, before posttrain's defaults."""
    tree = nemo_rl.load_tree(path) if path else {}
    ops = [("~", a[1:], None) if a.startswith("~") else
           ("+" if a.startswith("+") else "", a.split("=", 1)[0].lstrip("+"), nemo_rl.value_of(a.split("=", 1)[1]))
           for a in overrides]
    return grpo.translate(nemo_rl.resolve(nemo_rl.apply_overrides(tree, ops)), "in test")


def test_a_file_in_nemo_rl_layout_maps_onto_posttrain_keys():
    cfg = load_config(BASE, ["policy.model_name=m", "data.dataset_name=null"])
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.trainer.total_training_steps) == (4, 4, 100)
    assert cfg.trainer.max_epochs == 1 and cfg.trainer.seed == 7 and cfg.trainer.val_at_end is False
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c) == (0.2, 0.28, None)
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.01 and cfg.actor.kl_loss_type == "k3"
    assert cfg.actor.loss_agg_mode == "token-mean" and cfg.actor.lr == 1e-6 and cfg.actor.weight_decay == 0.0
    assert (cfg.actor.lr_warmup_steps, cfg.actor.lr_warmup_start_factor) == (2, 0.1)  # LinearLR(0.1, 2 iters)
    assert cfg.actor.ppo_micro_batch_size == 4 and cfg.rollout.log_prob_micro_batch_size == 4  # interpolated
    # max_new_tokens and max_input_seq_length interpolate max_total_sequence_length
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 64)
    assert cfg.rollout.name == "hf" and cfg.rollout.top_k == -1
    assert cfg.rollout.val_kwargs.temperature == 0.0 and cfg.rollout.val_kwargs.do_sample is False
    assert cfg.trainer.run_dir == "results/grpo" and cfg.trainer.save_freq == 10
    assert cfg.reward.num_workers == 0 and cfg.trainer.logger == ["console"]


def test_prorl_v2s_stop_properly_penalty_replaces_the_overlong_buffer():
    """NeMo-RL's apply_reward_shaping: with reward_shaping enabled, stop_properly_penalty_coef scales truncated
    responses' rewards and the DAPO buffer's settings are ignored; disabled, neither shapes anything."""
    on = layer(None, "++grpo.reward_shaping.enabled=true", "++grpo.reward_shaping.stop_properly_penalty_coef=0.1",
               "++grpo.reward_shaping.overlong_buffer_length=128")
    assert on["reward.truncated_scale"] == 0.1 and on["reward.overlong_buffer.enable"] is False
    assert "reward.overlong_buffer.len" not in on
    off = layer(None, "++grpo.reward_shaping.enabled=false", "++grpo.reward_shaping.stop_properly_penalty_coef=0.1")
    assert "reward.truncated_scale" not in off and off["reward.overlong_buffer.enable"] is False
    dapo = layer(None, "++grpo.reward_shaping.enabled=true", "++grpo.reward_shaping.stop_properly_penalty_coef=null")
    assert "reward.truncated_scale" not in dapo and dapo["reward.overlong_buffer.enable"] is True


def test_reward_scaling_maps_onto_reward_scaling():
    got = layer(None, "++grpo.reward_scaling.enabled=true", "++grpo.reward_scaling.target_min=-1.0",
                "++grpo.reward_scaling.source_max=2.0")
    assert (got["reward.scaling.enable"], got["reward.scaling.target_min"], got["reward.scaling.source_max"]) == \
        (True, -1.0, 2.0)
    assert not any(k.startswith("reward.scaling") for k in layer(None, "++grpo.reward_scaling.enabled=false",
                                                                   "++grpo.reward_scaling.target_min=-1.0"))


def test_force_on_policy_ratio_is_the_update_taking_its_own_log_probs_and_needs_one_update_per_step():
    """loss_fn.force_on_policy_ratio (ProRL v2's MoE file): old log-probs = the update's own, detached
    (actor.reuse_on_policy_log_probs); NeMo-RL asserts one update per step, so does the mapping."""
    one = layer(BASE, "++loss_fn.force_on_policy_ratio=true")  # BASE: 16 samples = 4 prompts x 4, one update
    assert one["actor.reuse_on_policy_log_probs"] is True and one["actor.ppo_epochs"] == 1
    with pytest.raises(ConfigError, match=r"force_on_policy_ratio=true .* needs one update per step: "
                                          r"policy.train_global_batch_size = .*\(now 2 of 4 prompts per update\)"):
        layer(BASE, "++loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=8")
    assert "actor.reuse_on_policy_log_probs" not in layer(BASE, "++loss_fn.force_on_policy_ratio=false")


def test_train_global_batch_size_counts_samples_not_prompts():
    # NeMo-RL: 16 samples per optimizer step = 4 prompts x 4 generations; verl's ppo_mini_batch_size counts prompts
    nemo = load_config(BASE, ["policy.model_name=m", "data.dataset_name=null"])
    assert nemo.actor.ppo_mini_batch_size == 16 // 4
    assert layer(BASE, "policy.train_global_batch_size=8", "grpo.num_generations_per_prompt=2")[
        "actor.ppo_mini_batch_size"] == 4
    verl = load_config(None, ["model.path=m", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                              "data.train_batch_size=16"])
    assert verl.actor.ppo_mini_batch_size == 16
    with pytest.raises(ConfigError, match=r"train_global_batch_size=18 .* multiple of grpo.num_generations_per_prompt=4"):
        layer(BASE, "policy.train_global_batch_size=18")
    with pytest.raises(ConfigError, match="give grpo.num_generations_per_prompt too"):
        layer(None, "policy.train_global_batch_size=16")


def test_leave_one_out_baseline_picks_nemo_rls_grpo_estimator():
    assert layer(BASE)["algorithm.adv_estimator"] == "grpo_loo"
    plain = layer(BASE, "grpo.use_leave_one_out_baseline=false", "grpo.normalize_rewards=false")
    assert plain["algorithm.adv_estimator"] == "grpo" and plain["algorithm.norm_adv_by_std_in_grpo"] is False
    # verl's GRPO (posttrain's default) has no leave-one-out baseline
    assert load_config(None, ["model.path=m"]).algorithm.adv_estimator == "grpo"


def test_keep_top_k_without_a_metric_keeps_the_newest_k():
    newest = layer(BASE, "checkpointing.keep_top_k=2", "checkpointing.metric_name=null")
    assert newest["trainer.max_ckpt_to_keep"] == 2 and "trainer.keep_top_k" not in newest
    best = layer(BASE, "checkpointing.keep_top_k=2")
    assert (best["trainer.keep_top_k"], best["trainer.keep_top_k_metric"], best["trainer.keep_top_k_mode"]) == (
        2, "val/score/mean", "max")
    assert "trainer.max_ckpt_to_keep" not in best
    low = layer(BASE, "checkpointing.metric_name=train:loss", "checkpointing.higher_is_better=false")
    assert (low["trainer.keep_top_k_metric"], low["trainer.keep_top_k_mode"]) == ("actor/pg_loss", "min")
    assert layer(BASE, "checkpointing.keep_top_k=null").get("trainer.max_ckpt_to_keep") is None  # keep all
    off = layer(BASE, "checkpointing.enabled=false")
    assert (off["trainer.save_freq"], off["trainer.save_last"]) == (-1, False)  # NeMo-RL then saves nothing
    with pytest.raises(ConfigError, match="metric_name=val:bogus"):
        layer(BASE, "checkpointing.metric_name=val:bogus")


def test_defaults_inheritance_and_overrides_before_interpolation(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {BASE}\npolicy:\n  max_total_sequence_length: 32\n"
                     "logger:\n  _override_: true\n  wandb_enabled: true\n  wandb:\n    project: p\n    name: n\n")
    got = layer(str(child))
    assert got["data.max_response_length"] == got["data.max_prompt_length"] == 32  # the parent's ${...} follow
    assert got["trainer.logger"] == ["console", "wandb"] and got["trainer.project_name"] == "p"
    assert "trainer.run_dir" in got and got["trainer.experiment_name"] == "n"
    over = layer(str(child), "policy.max_total_sequence_length=16", "++grpo.seed=3", "~policy.scheduler")
    assert over["data.max_response_length"] == 16 and over["trainer.seed"] == 3
    assert "actor.lr_warmup_steps" not in over
    loop = tmp_path / "loop.yaml"
    loop.write_text("defaults: loop.yaml\ngrpo: {}\n")
    with pytest.raises(ConfigError, match="inherits from itself"):
        nemo_rl.load_tree(loop)
    orphan = tmp_path / "orphan.yaml"
    orphan.write_text("defaults: missing.yaml\ngrpo: {}\n")
    with pytest.raises(ConfigError, match=r"missing.yaml' \(named by `defaults:`"):
        nemo_rl.load_tree(orphan)


def test_megatron_is_refused_with_the_fsdp2_switch_unless_disabled():
    with pytest.raises(ConfigError) as e:
        load_config(SEED, ["policy.model_name=m"])
    assert "\n" not in str(e.value) and "policy.megatron_cfg.enabled=false policy.dtensor_cfg.enabled=true" in str(e.value)
    with pytest.raises(ConfigError, match=r"policy.optimizer is null .* \+\+policy.optimizer.kwargs.lr"):
        load_config(SEED, ["policy.model_name=m", "policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"])
    cfg = load_config(SEED, ["policy.model_name=m", "data.dataset_name=null", *FSDP2])
    assert cfg.actor.lr == 2e-6 and cfg.actor.lr_warmup_steps <= 0 and cfg.actor.lr_warmup_steps_ratio == 0  # none
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8)
    assert cfg.actor.ppo_mini_batch_size == 32 // 4


def test_tensor_parallelism_maps_and_what_it_does_not_combine_with_is_refused():
    """policy.dtensor_cfg.tensor_parallel_size is actor.tensor_parallel_size, sequence_parallel is
    actor.sequence_parallel, custom_parallel_plan is actor.tensor_parallel_plan; beside context parallelism (Ulysses)
    it loads where the workers divide by both, else one line names both keys."""
    cfg = load_config(BASE, [*"policy.model_name=m data.dataset_name=null cluster.gpus_per_node=2".split(),
                             "policy.dtensor_cfg.tensor_parallel_size=2"])
    assert cfg.actor.tensor_parallel_size == 2 and cfg.trainer.n_gpus_per_node == 2
    both = ["policy.model_name=m", "data.dataset_name=null", "policy.dtensor_cfg.tensor_parallel_size=2",
            "policy.dtensor_cfg.context_parallel_size=2"]
    cfg = load_config(BASE, [*both, "cluster.gpus_per_node=4"])
    assert (cfg.actor.tensor_parallel_size, cfg.actor.ulysses_sequence_parallel_size) == (2, 2)
    with pytest.raises(ConfigError, match=r"^actor.tensor_parallel_size=2 x actor.ulysses_sequence_parallel_size=2 "
                                          r"must divide the 2 workers"):
        load_config(BASE, [*both, "cluster.gpus_per_node=2"])
    both = layer(BASE, "policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.sequence_parallel=true")
    assert both["actor.tensor_parallel_size"] == 2 and both["actor.sequence_parallel"] is True
    plan = layer(BASE, "policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.custom_parallel_plan=my.plan")
    assert plan["actor.tensor_parallel_plan"] == "my.plan"


def test_what_posttrain_cannot_honour_is_refused_in_one_line():
    cases = {
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true": "recompute_kv_cache_after_weight_updates=True",
        "policy.generation.backend=sglang": r"generates with vllm \(GPUs\) or hf",
        "grpo.max_rollout_turns=3": "grpo.max_rollout_turns=3 .*turns after the first need an environment",
        "loss_fn.use_cispo=true": "use_cispo=True .* set it to false",
        "++grpo.num_promtps_per_step=3": "not supported by posttrain; did you mean 'grpo.num_prompts_per_step'",
        "++policy.scheduler=[{name: CosineAnnealingLR}]": r"scheduler.*T_max is fixed.*actor.lr_scheduler_type=cosine",
        "++policy.scheduler=[{name: ExponentialLR}]": r"\['ExponentialLR'\] .* then a constant LR or a cosine$",
        "policy.optimizer.name=torch.optim.SGD": "AdamW",
        # a mapping refused as a whole, not leaf by leaf ("did you mean 'policy.hf_config_overrides'?")
        "++policy.hf_config_overrides={rope_scaling: {rope_type: yarn}}": r"hf_config_overrides=\{'rope_scaling'.* set "
                                                                          r"it to \{\} or null",
        "++env.reward_model.model_name=rm": "no data.*.env_name names it",  # set, but scoring nothing
        "++env.penguin.cfg.size=3": "other than math, math_multi_reward, reward_model, sliding_puzzle_game and the VLM "
                                    "environment",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message) as e:
            layer(BASE, override)
        assert "\n" not in str(e.value)


def test_nemo_rls_sliding_puzzle_is_the_built_in_game_on_its_seeds(tmp_path, monkeypatch, trained_tiny_model_dir):
    """env.sliding_puzzle_game -> posttrain.envs.sliding_puzzle with its game_config and max_moves, the turns from
    grpo.max_rollout_turns, the sliding_puzzle dataset (its script reads no data.* dataset or prompt file); and
    NeMo-RL's grpo_sliding_puzzle.yaml (resolved, as tests/data/nemo_rl holds it) runs two steps on the tiny model."""
    got = layer(BASE, "++env.sliding_puzzle_game.cfg.game_config.size=3", "++env.sliding_puzzle_game.cfg.max_moves=9",
                "grpo.max_rollout_turns=4", "++data.add_system_prompt=false")
    assert got["rollout.multi_turn.environment"] == "posttrain.envs.sliding_puzzle:SlidingPuzzle"
    assert got["rollout.multi_turn.environment_kwargs"] == {"size": 3, "shuffle_moves": 10, "max_moves": 9}
    assert (got["rollout.multi_turn.max_assistant_turns"], got["data.dataset_name"]) == (4, "sliding_puzzle")
    assert got["data.apply_chat_template_kwargs"] == {"add_system_prompt": False}
    from posttrain.driver.build import build_run
    from posttrain.data.preprocess import sliding_puzzle
    from posttrain.driver.loop import train

    monkeypatch.setenv("POSTTRAIN_DATA", str(tmp_path / "data"))
    sliding_puzzle.run(tmp_path / "data" / "sliding-puzzle", num_train=8, num_test=2)
    path = tmp_path / "grpo_sliding_puzzle.yaml"
    path.write_text(json.dumps(examples()["configs"]["grpo_sliding_puzzle.yaml"]))  # JSON is YAML
    small = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_rollout_turns=2",
             "grpo.max_num_steps=2", "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4",
             "policy.logprob_batch_size=4", "policy.max_total_sequence_length=900", "policy.generation.backend=hf",
             "grpo.val_period=2", "checkpointing.enabled=false", f"logger.log_dir={tmp_path / 'logs'}",
             f"model.path={trained_tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.val_before_train=false",
             "rollout.multi_turn.environment_workers=1", "data.max_response_length=24"]  # posttrain's keys mix in
    assert train(build_run(load_config(str(path), small)))["steps"] == 2


def test_nemo_rls_prorl_v2_file_runs_on_the_tiny_model(tmp_path, trained_tiny_model_dir):
    """prorlv2.v2.yaml (resolved, as tests/data/nemo_rl holds it) runs two steps on the tiny model and the arith
    task: dynamic sampling, REINFORCE++ with a baseline, ICE-POP and the stop-properly scale, as the file sets."""
    from posttrain.driver.build import build_run
    from posttrain.data.preprocess import arith
    from posttrain.driver.loop import train

    train_file, test_file = arith.run(tmp_path / "data", num_train=32, num_test=8)
    path = tmp_path / "prorlv2.v2.yaml"
    path.write_text(json.dumps(examples()["configs"]["prorlv2.v2.yaml"]))  # JSON is YAML
    small = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
             "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
             "policy.max_total_sequence_length=64", "policy.generation.backend=hf", "policy.precision=float32",
             "grpo.val_period=2", "checkpointing.enabled=false", f"logger.log_dir={tmp_path / 'logs'}",
             f"model.path={trained_tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}",
             "trainer.val_before_train=false", f"data.train_files=[{train_file}]", f"data.val_files=[{test_file}]",
             "data.prompt_file=null", "data.max_response_length=3"]  # posttrain's keys mix in
    cfg = load_config(str(path), small)
    assert cfg.reward.truncated_scale == 0.0 and cfg.algorithm.filter_groups.enable
    assert train(build_run(cfg))["steps"] == 2
    steps = [x for x in read_metrics(tmp_path / "run") if "critic/score/mean" in x]
    assert len(steps) == 2 and all("reward/truncated_ratio" in x and "train/num_gen_batches" in x for x in steps)


COMPONENTS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = float(solution_str.strip() == str(ground_truth).strip())
    return {"score": right, "correctness": right, "short": float(len(solution_str.strip()) <= 2)}
"""


def test_nemo_rls_gdpo_file_runs_on_the_tiny_model(tmp_path, trained_tiny_model_dir):
    """gdpo_math_1B.yaml: the GDPO estimator over math_multi_reward's components; here two steps on the tiny model
    and the arith task, scored by a reward file whose components the tiny model can vary (right, short): the
    components are logged, each normalized in its group, and the weights move."""
    from posttrain.driver.build import build_run
    from posttrain.data.preprocess import arith
    from posttrain.driver.loop import train

    cfg = load_config(None, [f"model.path={trained_tiny_model_dir}", "algorithm.adv_estimator=gdpo"])
    assert cfg.algorithm.adv_estimator == "gdpo" and cfg.algorithm.gdpo.reward_keys == []
    with pytest.raises(ConfigError, match="algorithm.gdpo.reward_weights has 1 weights for the 2 algorithm.gdpo"):
        load_config(None, ["algorithm.adv_estimator=gdpo", "algorithm.gdpo.reward_keys=[a,b]",
                           "algorithm.gdpo.reward_weights=[1.0]"])
    with pytest.raises(ConfigError, match="reward.data_source=nope: no built-in reward for data_source 'nope'"):
        load_config(None, ["reward.data_source=nope"])
    got = layer(None, "++grpo.adv_estimator.name=gdpo", "++grpo.adv_estimator.use_leave_one_out_baseline=true",
                "++grpo.adv_estimator.reward_weights=[2,1,1]")
    assert (got["algorithm.adv_estimator"], got["algorithm.gdpo.leave_one_out"]) == ("gdpo", True)
    assert got["algorithm.gdpo.reward_weights"] == [2, 1, 1]
    train_file, test_file = arith.run(tmp_path / "data", num_train=32, num_test=8)
    (tmp_path / "parts.py").write_text(COMPONENTS)
    path = tmp_path / "gdpo_math_1B.yaml"
    path.write_text(json.dumps(examples()["configs"]["gdpo_math_1B.yaml"]))  # JSON is YAML
    small = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
             "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
             "policy.max_total_sequence_length=64", "policy.generation.backend=hf", "policy.precision=float32",
             "grpo.val_period=2", "checkpointing.enabled=false",
             f"logger.log_dir={tmp_path / 'logs'}", f"model.path={trained_tiny_model_dir}",
             f"trainer.run_dir={tmp_path / 'run'}", "trainer.val_before_train=false", "data.system_prompt_file=null",
             f"data.train_files=[{train_file}]", f"data.val_files=[{test_file}]", "data.max_response_length=4",
             f"reward.custom_fn={tmp_path / 'parts.py'}", "reward.num_workers=0"]
    cfg = load_config(str(path), small)
    assert (cfg.algorithm.adv_estimator, cfg.reward.data_source) == ("gdpo", "math_multi_reward")
    assert train(build_run(cfg))["steps"] == 2
    steps = [x for x in read_metrics(tmp_path / "run") if "critic/score/mean" in x]
    assert all("reward/correctness/mean" in x and "reward/short/mean" in x for x in steps)
    assert all(x["actor/grad_norm"] > 0 for x in steps)


def test_nemo_rls_ppo_layout_is_gae_with_its_value_model_as_the_critic(tmp_path, trained_tiny_model_dir):
    """ppo_math_1B.yaml: ppo.* is grpo.*'s layout with GAE, PPO epochs and a critic warm-up; value.* (a policy
    section of its own) is the critic; value_loss_fn its loss; reward_scaling on. It runs two steps on the tiny
    model, the critic trained (its loss logged) beside the policy."""
    from posttrain.driver.build import build_run
    from posttrain.data.preprocess import arith
    from posttrain.driver.loop import train

    path = tmp_path / "ppo_math_1B.yaml"
    path.write_text(json.dumps(examples()["configs"]["ppo_math_1B.yaml"]))  # JSON is YAML
    cfg = load_config(str(path), [])
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.lam, cfg.algorithm.gamma) == ("gae", 0.95, 1.0)
    assert (cfg.actor.ppo_epochs, cfg.trainer.critic_warmup, cfg.data.train_batch_size, cfg.rollout.n) == (4, 0, 32, 16)
    assert (cfg.critic.loss_coef, cfg.critic.cliprange_value, cfg.critic.ppo_mini_batch_size) == (0.4, 0.2, 32)
    assert cfg.critic.model.path is None and cfg.critic.ppo_micro_batch_size_per_gpu == 4  # the policy's model, its sizes
    assert (cfg.reward.scaling.enable, cfg.reward.scaling.target_min) == (True, -1.0)
    with pytest.raises(ConfigError, match=r"^value.dtensor_cfg.tensor_parallel_size=2 \(.*\): posttrain splits the "
                                          r"value model as the policy \(policy.dtensor_cfg.tensor_parallel_size=1\)"):
        load_config(str(path), ["value.dtensor_cfg.tensor_parallel_size=2"])
    for bad, said in (("ppo.adv_estimator.gae_lambda_value=0.9", "ppo.adv_estimator.gae_lambda_value=0.9 .* set it "
                                                                 "to null or 0.95"),
                      ("ppo.adv_estimator.name=grpo", "ppo.adv_estimator.name=grpo .* NeMo-RL's PPO estimates with gae"),
                      ("value.precision=float32", "value.precision=float32 .* the policy's precision"),
                      ("value.dtensor_cfg.lora_cfg.enabled=true", "LoRA on the value model is not supported"),
                      ("value_loss_fn.huber=1", "value_loss_fn.huber")):
        with pytest.raises(ConfigError, match=said):
            load_config(str(path), ["++" + bad])
    train_file, test_file = arith.run(tmp_path / "data", num_train=32, num_test=8)
    small = ["ppo.num_prompts_per_step=4", "ppo.num_generations_per_prompt=2", "ppo.max_num_steps=2",
             "ppo.ppo_epochs=2", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
             "policy.logprob_batch_size=8", "policy.max_total_sequence_length=64", "policy.generation.backend=hf",
             "policy.precision=float32", "value.precision=float32", "ppo.val_period=2",
             "checkpointing.enabled=false", f"logger.log_dir={tmp_path / 'logs'}", f"model.path={trained_tiny_model_dir}",
             f"trainer.run_dir={tmp_path / 'run'}", "trainer.val_before_train=false", "data.prompt_file=null",
             f"data.train_files=[{train_file}]", f"data.val_files=[{test_file}]", "data.max_response_length=4",
             "reward.num_workers=0"]
    assert train(build_run(load_config(str(path), small)))["steps"] == 2
    steps = [x for x in read_metrics(tmp_path / "run") if "critic/score/mean" in x]
    assert all(x["critic/vf_loss"] > 0 and x["actor/grad_norm"] > 0 for x in steps)


IS = "loss_fn.use_importance_sampling_correction=true"


def correction(*overrides) -> dict:
    """The algorithm.rollout_correction.* keys (short names) that loss_fn's settings map to."""
    got = layer(BASE, *overrides)
    return {k.rsplit(".", 1)[1]: v for k, v in got.items() if k.startswith("algorithm.rollout_correction.")}


def test_async_grpo_and_generation_of_its_own_map_onto_asynchronous_training():
    def async_keys(*overrides):
        return {k.rsplit(".", 1)[1]: v for k, v in layer(BASE, *overrides).items() if k.startswith("async_training.")}

    assert async_keys() == {}
    assert async_keys("grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=2",
                      "grpo.async_grpo.in_flight_weight_updates=true") == {
        "enable": True, "max_trajectory_age_steps": 2, "in_flight_weight_updates": True, "max_rollout_failures": 0}
    # generation on GPUs of its own, synchronous: the rollout in workers of its own, k = 0; 1 of the node's 4 GPUs
    assert async_keys("policy.generation.colocated.enabled=false", "cluster.gpus_per_node=4",
                      "++policy.generation.colocated.resources.gpus_per_node=1") == {
        "enable": True, "max_trajectory_age_steps": 0, "in_flight_weight_updates": False, "max_rollout_failures": 0,
        "rollout_nnodes": 1, "rollout_n_gpus_per_node": 1}
    # NeMo-RL's failed rollout batches tolerated (0 unless set): posttrain's rollout workers replaced
    assert async_keys("grpo.async_grpo.enabled=true", "grpo.async_grpo.max_generation_failures=2")[
        "max_rollout_failures"] == 2
    assert async_keys("grpo.async_grpo.enabled=true")["max_rollout_failures"] == 0
    with pytest.raises(ConfigError, match=r"max_generation_failures=-1 \(in test\): an integer >= 0"):
        layer(BASE, "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_generation_failures=-1")


def test_generation_on_gpus_of_its_own_splits_the_cluster_as_nemo_rl_does():
    """policy.generation.colocated.enabled=false: generation takes G GPUs of a one-node cluster, or N whole nodes
    of several; training the rest (NeMo-RL's grpo.py setup). What NeMo-RL asserts against is refused in one line."""
    def devices(*overrides):
        got = layer(BASE, "policy.generation.colocated.enabled=false", *overrides)
        return tuple(got[k] for k in ("trainer.nnodes", "trainer.n_gpus_per_node", "async_training.rollout_nnodes",
                                      "async_training.rollout_n_gpus_per_node"))

    res = "++policy.generation.colocated.resources."
    assert devices("cluster.gpus_per_node=8", res + "gpus_per_node=2") == (1, 6, 1, 2)
    assert devices("cluster.gpus_per_node=8", "cluster.num_nodes=4", res + "gpus_per_node=8",
                   res + "num_nodes=1") == (3, 8, 1, 8)
    # a reward model's environment takes its own share first (GRPO's rule): 8 - 2 - 1 GPUs train
    assert devices("cluster.gpus_per_node=8", res + "gpus_per_node=2", "++data.default.env_name=reward_model",
                   "++env.reward_model.model_name=rm", "++env.reward_model.resources.gpus_per_node=1",
                   "++env.reward_model.resources.num_nodes=1") == (1, 5, 1, 2)
    for overrides, message in [
        ([], r"resources.gpus_per_node=null \(in test\): the policy has one node, whose GPUs generation and "),
        (["cluster.gpus_per_node=2", res + "gpus_per_node=2"],
         r"gpus_per_node=2 \(in test\) leaves no GPU of the node's cluster.gpus_per_node=2 for training"),
        (["cluster.gpus_per_node=2", res + "gpus_per_node=1", "++data.default.env_name=reward_model",
          "++env.reward_model.model_name=rm", "++env.reward_model.resources.gpus_per_node=1"],
         r"gpus_per_node=1 and env.reward_model.resources.gpus_per_node=1 \(in test\) leave no GPU"),
        (["cluster.gpus_per_node=8", res + "gpus_per_node=2", res + "num_nodes=2"],
         r"resources.num_nodes=2 \(in test\): the policy has one node"),
        (["cluster.num_nodes=2", "cluster.gpus_per_node=8", res + "gpus_per_node=4", res + "num_nodes=1"],
         r"resources.gpus_per_node=4 \(in test\): on several nodes generation takes whole nodes; set it to "
         r"cluster.gpus_per_node=8"),
        (["cluster.num_nodes=2", "cluster.gpus_per_node=8", res + "gpus_per_node=8"],
         r"resources.num_nodes=null \(in test\): on several nodes"),
        (["cluster.num_nodes=2", "cluster.gpus_per_node=8", res + "gpus_per_node=8", res + "num_nodes=2"],
         r"resources.num_nodes=2 \(in test\) leaves no node for training of the policy's 2"),
    ]:
        with pytest.raises(ConfigError, match=message) as refused:
            devices(*overrides)
        assert "\n" not in str(refused.value)


def test_nemo_rls_nixl_example_trains_on_one_node_beside_generation_on_the_other(tmp_path):
    """grpo_math_8B_megatron_nixl.yaml (with the FSDP2 switch): a cluster of 2 x 8 GPUs, generation on 1 x 8 of its
    own: the trainer's group on the other node's 8, the rollout workers on the generation node's 8 (vLLM TP 1)."""
    path = tmp_path / "nixl.yaml"
    path.write_text(json.dumps(examples()["configs"]["grpo_math_8B_megatron_nixl.yaml"]))
    cfg = train_config(path, FSDP2)
    a = cfg.async_training
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 8)
    assert (a.enable, a.rollout_nnodes, a.rollout_n_gpus_per_node, a.max_trajectory_age_steps) == (True, 1, 8, 0)


def test_help_config_says_where_generations_own_gpus_and_failures_go():
    from posttrain.help_config import describe_keys

    text = describe_keys()
    assert "  grpo.async_grpo.max_generation_failures (async GRPO; else 0) -> async_training.max_rollout_failures" \
        in text
    assert ("  policy.generation.colocated.resources.num_nodes, gpus_per_node (colocated.enabled: false) -> "
            "async_training.rollout_nnodes, rollout_n_gpus_per_node; the rest of cluster.* -> trainer.*") in text


def test_async_ppo_tolerates_no_failed_generation():
    """NeMo-RL's asynchronous PPO has no max_generation_failures (its collector stops at the first failure)."""
    ppo = ["++ppo.num_generations_per_prompt=8", "++value.model_name=m", "++ppo.async_ppo.enabled=true"]
    assert layer(BASE, *ppo)["async_training.max_rollout_failures"] == 0
    with pytest.raises(ConfigError, match=r"ppo.async_ppo.max_generation_failures=2 \(in test\): NeMo-RL's "):
        layer(BASE, *ppo, "++ppo.async_ppo.max_generation_failures=2")


def test_importance_sampling_correction_maps_onto_rollout_correction():
    ratio, low = "loss_fn.truncated_importance_sampling_ratio=", "++loss_fn.truncated_importance_sampling_ratio_min="
    kind = "loss_fn.truncated_importance_sampling_type="
    off = dict(rollout_is_threshold_lower=None, rollout_rs=None, rollout_rs_threshold=None,
               rollout_rs_threshold_lower=None)
    assert correction() == {}  # off: posttrain's defaults stand
    assert correction(IS) == {**off, "rollout_is": "token", "rollout_is_threshold": None}  # raw: not truncated
    assert correction(IS, kind + "tis", ratio + "2") == {**off, "rollout_is": "token", "rollout_is_threshold": 2}
    assert correction(IS, kind + "tis", ratio + "2", low + "0.5") == {
        **off, "rollout_is": "token", "rollout_is_threshold": 2, "rollout_is_threshold_lower": 0.5}
    assert correction(IS, kind + "icepop", ratio + "5", low + "0.5") == {
        **off, "rollout_is": "token", "rollout_is_threshold": 5, "rollout_rs": "token", "rollout_rs_threshold": 5,
        "rollout_rs_threshold_lower": 0.5}
    assert correction(IS, kind + "seq-mask-tis", ratio + "1.002", low + "0.999") == {
        **off, "rollout_is": "token", "rollout_is_threshold": None, "rollout_rs": "geometric",
        "rollout_rs_threshold": 1.002, "rollout_rs_threshold_lower": 0.999}
    # with sequence_level_importance_ratios (GSPO) the weights, and icepop's band, are the sequence's
    seq = correction(IS, kind + "icepop", ratio + "5", low + "0.5", "loss_fn.sequence_level_importance_ratios=true")
    assert (seq["rollout_is"], seq["rollout_rs"]) == ("sequence", "sequence")
    # the loaded config is validated, and turns the engine's log-probs on
    cfg = load_config(BASE, ["policy.model_name=m", "data.dataset_name=null", IS, kind + "tis", ratio + "2"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.bypass_mode) == ("token", 2, False)
    from posttrain.driver.settings import rollout_log_probs
    assert rollout_log_probs(cfg)


def test_importance_sampling_settings_posttrain_or_nemo_rl_refuse_name_the_key():
    ratio, low = "loss_fn.truncated_importance_sampling_ratio=", "++loss_fn.truncated_importance_sampling_ratio_min="
    kind = "loss_fn.truncated_importance_sampling_type="
    cases = {
        (kind + "tis", ratio + "2"): r"^loss_fn.truncated_importance_sampling_type=tis .*use_importance_sampling_corr",
        (IS, kind + "clip", ratio + "2"): r"^loss_fn.truncated_importance_sampling_type=clip .*tis, icepop, seq-mask",
        (IS, ratio + "2"): r"^loss_fn.truncated_importance_sampling_ratio=2 .*needs truncated_importance_sampling_type",
        (IS, kind + "tis"): r"^loss_fn.truncated_importance_sampling_ratio=null .*a number > 0",
        (IS, kind + "tis", ratio + "0"): r"^loss_fn.truncated_importance_sampling_ratio=0 ",
        (IS, kind + "icepop", ratio + "5"): r"^loss_fn.truncated_importance_sampling_ratio_min=null .*lower bound",
        (IS, kind + "tis", ratio + "2", low + "3"): r"^loss_fn.truncated_importance_sampling_ratio_min=3 .*below",
        (IS, kind + "seq-mask-tis", ratio + "2", low + "0.5", "loss_fn.sequence_level_importance_ratios=true"):
            r"^loss_fn.sequence_level_importance_ratios=True .*needs sequence_level_importance_ratios false",
        (IS, low + "0.5"): r"^loss_fn.truncated_importance_sampling_ratio_min=0.5 .*needs truncated_importance_samp",
        ("loss_fn.use_importance_sampling_correction=maybe",): r"^loss_fn.use_importance_sampling_correction=maybe "
                                                               r".*true or false",
        (IS, kind + "tis", ratio + "big"): r"^loss_fn.truncated_importance_sampling_ratio=big .*a number or null",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message) as e:
            layer(BASE, *overrides)
        assert "\n" not in str(e.value) and "(in test)" in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'loss_fn.use_importance_sampling_correction'"):
        layer(BASE, "++loss_fn.use_importance_sampling_corection=true")


def test_engine_knobs_are_accepted_and_nemo_keys_alone_work_on_posttrains_defaults():
    assert "rollout.max_model_len" not in layer(BASE)  # a vLLM setting: not handed to the hf engine
    vllm = layer(BASE, "policy.generation.backend=vllm", "++policy.generation.vllm_cfg.use_tqdm=false",
                 "++cluster.master_port_range_low=1400")
    assert vllm["rollout.max_model_len"] == 64 and vllm["rollout.gpu_memory_utilization"] == 0.6
    # sequence parallelism without tensor parallelism: no effect, and a warning says so (as NeMo-RL's)
    with pytest.warns(UserWarning, match="actor.sequence_parallel=true has no effect without tensor parallelism"):
        load_config(None, ["policy.dtensor_cfg.sequence_parallel=true", "grpo.max_num_steps=3", "model.path=m",
                           "trainer.device=cpu"])
    cfg = load_config(None, ["grpo.max_num_steps=3", "grpo.num_generations_per_prompt=2", "trainer.device=cpu",
                             "model.path=m"])
    assert cfg.trainer.total_training_steps == 3 and cfg.rollout.n == 2 and cfg.trainer.device == "cpu"


def test_command_line_keys_of_posttrain_win_and_files_replace_the_dataset():
    cfg = load_config(BASE, ["policy.model_name=m", "data.train_files=[a.parquet]", "actor.lr=3e-6"])
    assert cfg.data.train_files == ["a.parquet"] and cfg.data.dataset_name is None and cfg.actor.lr == 3e-6


def test_config_flag_and_hydra_delete_on_the_command_line():
    assert split_train_args(["grpo.seed=1", "~policy.scheduler"], BASE) == (BASE, ["grpo.seed=1", "~policy.scheduler"])
    assert split_train_args([BASE, "a=1"]) == (BASE, ["a=1"])
    with pytest.raises(ConfigError, match="two config files"):
        split_train_args([BASE], SEED)


def test_split_validation_size_holds_out_a_seeded_share_of_the_training_prompts():
    from posttrain.driver.build_data import hold_out
    from posttrain.data.dataset import PromptDataset

    assert layer(BASE, "++data.train.split_validation_size=0.05")["data.val_split_size"] == 0.05
    train = PromptDataset(list(range(20)))
    kept, val = hold_out(train, None, 0.1, seed=3)
    assert len(val) == 2 and len(kept) == 18 and sorted(kept.items + val.items) == list(range(20))
    again, val_again = hold_out(train, None, 0.1, seed=3)
    assert val_again.items == val.items and again.items == kept.items  # the same rows on a resumed run
    assert len(hold_out(train, None, 0.01, seed=3)[1]) == 1  # at least one
    given = PromptDataset([99])
    assert hold_out(train, given, 0.1, seed=3) == (train, given)  # a validation set is given: nothing held out
    with pytest.raises(ConfigError, match="holds out all"):
        hold_out(PromptDataset([1]), None, 0.5, seed=0)


def test_the_guide_commands_parse_and_its_tables_name_real_keys():
    import re
    import shlex

    from posttrain.cli import build_parser
    from posttrain.config import SCHEMA

    text = (Path(__file__).parents[1] / "docs" / "coming-from-nemo-rl.md").read_text()
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith("posttrain ")]
    assert len(commands) >= 3
    for line in commands:
        build_parser().parse_args(shlex.split(line)[1:])
    rows = [r for r in text.splitlines() if r.startswith("| `")]
    assert len(rows) > 40
    for row in rows:
        ours = row.rstrip("|").rsplit("|", 1)[1]
        first = re.search(r"`([a-z_]+\.[a-z_.]+)", ours)
        key = first and first.group(1)
        assert key and (key in SCHEMA or any(key.startswith(k + ".") for k in SCHEMA)), row


@functools.cache
def examples() -> dict:
    return json.loads(EXAMPLES.read_text())


def train_config(path, overrides=(), command="train"):
    """What `posttrain train --config PATH OVERRIDES` (or `posttrain sft`) loads and checks before it builds the
    run."""
    from posttrain.cli import build_parser

    args = build_parser().parse_args([command, "--config", str(path), *overrides])
    return load_config(*split_train_args(args.args, args.config), command=command)


def test_the_example_configs_are_nemo_rls_named_with_their_source():
    about, configs = examples()["about"], examples()["configs"]
    assert about["source"] == "https://github.com/NVIDIA-NeMo/RL" and EXAMPLES.stem == f"examples_{about['commit'][:7]}"
    assert "Apache License, Version 2.0" in about["attribution"] and "NVIDIA" in about["attribution"]
    assert about["generated_by"].startswith("python bench/nemo_rl_configs.py --nemo-rl DIR --generate ")
    assert sorted(configs) == sorted(f"{name}.yaml" for name in EXAMPLE_OUTCOMES)
    assert not any("defaults" in tree for tree in configs.values())  # each one self-contained


@pytest.mark.parametrize("name", sorted(EXAMPLE_OUTCOMES))
def test_nemo_rls_example_configs_load_or_are_refused_as_the_guide_says(name, tmp_path):
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(examples()["configs"][path.name]))  # JSON is YAML (its strings stay strings)
    expected = EXAMPLE_OUTCOMES[name]
    command = "sft" if "sft" in examples()["configs"][path.name] else "train"  # NeMo-RL's SFT layout
    try:
        cfg, got = train_config(path, command=command), LOADS
    except ConfigError as e:
        if expected == LOADS or not str(e).startswith("policy.megatron_cfg.enabled=true"):
            assert expected not in (LOADS, SWITCHED), f"{name} is refused: {e}"
            assert "\n" not in str(e) and re.match(rf"{re.escape(expected)}\b", str(e)), str(e)
            return
        assert "policy.megatron_cfg.enabled=false policy.dtensor_cfg.enabled=true" in str(e)  # the switch, named
        try:
            cfg, got = train_config(path, FSDP2, command), SWITCHED
        except ConfigError as e:
            assert expected not in (LOADS, SWITCHED), f"{name} is refused with the FSDP2 switch: {e}"
            assert "\n" not in str(e) and re.match(rf"{re.escape(expected)}\b", str(e)), str(e)
            return
    assert got == expected, f"{name} {got}, the guide says: {expected}"
    if name == "grpo_rm_1B":  # the guide: its reward-model environment becomes reward.model.*
        assert cfg.reward.model.enable and cfg.reward.model.path == "Skywork/Skywork-Reward-V2-Qwen3-0.6B"
    rc = cfg.algorithm.rollout_correction
    if name.endswith("_fp8"):  # use_importance_sampling_correction without a type: pi_old / pi_rollout as it is
        assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs) == ("token", None, None)
    elif name == "prorlv2.v2":  # ProRL v2: REINFORCE++ with a baseline, ICE-POP, dynamic sampling, stop properly
        assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold_lower) == \
            ("token", 5.0, "token", 0.5)
        assert cfg.algorithm.adv_estimator == "reinforce_plus_plus_baseline" and cfg.algorithm.filter_groups.enable
        assert cfg.reward.truncated_scale == 0.0 and not cfg.reward.overlong_buffer.enable
        assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.kl_loss_type) == (0.2, 0.27, "k2")
    elif name == "prorlv2_1_moe.v2":  # its ratio forced to 1; seq-mask-tis: the geometric mean's bounds
        assert (rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower) == ("geometric", 1.002, 0.999)
        assert cfg.actor.reuse_on_policy_log_probs and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    else:
        assert rc.rollout_is is None and rc.rollout_rs is None


def test_the_guides_section_6_lists_each_example_config_as_it_loads():
    section = GUIDE.read_text().split("\n## 6. ", 1)[1].split("\n## ", 1)[0]
    commit = re.search(r"commit ([0-9a-f]{7})\b", section).group(1)
    assert examples()["about"]["commit"].startswith(commit)
    assert "`python bench/nemo_rl_configs.py --nemo-rl DIR`" in section  # the script, and what it wrote
    assert f"`tests/data/nemo_rl/{EXAMPLES.name}`" in section
    bullets = [" ".join(b.split()) for b in re.findall(r"^- (.*?)(?=\n- |\n\n|\Z)", section, flags=re.S | re.M)]
    assert len(bullets) == 3
    listed: dict[str, str] = {}
    for bullet in bullets:
        head, count, body = re.match(r"(.*?) \((\d+)\): (.*)", bullet).groups()
        kind = next(k for start, k in (("load as they are", LOADS), ("load with the FSDP2 switch", SWITCHED),
                                       ("refused", "refused")) if head.startswith(start))
        names: list[str] = []
        for m in re.finditer(r"`([\w.]+)`|\(([^()]*)\)", body):
            if m.group(1):
                names.append(m.group(1))
                assert m.group(1) not in listed, f"{m.group(1)} is listed twice"
                listed[m.group(1)] = kind
            elif kind == "refused":  # the reason of the names before it: it names the key the refusal names
                keys = set(re.findall(r"`([\w.]+)`", m.group(2)))
                for n in [n for n in names if listed[n] == "refused"]:
                    listed[n] = EXAMPLE_OUTCOMES[n] if EXAMPLE_OUTCOMES.get(n) in keys else f"refused ({m.group(2)})"
                names = []
        assert int(count) == len(re.findall(r"`[\w.]+`", re.sub(r"\([^()]*\)", "", body))), bullet
    assert listed == EXAMPLE_OUTCOMES


def test_chat_template_kwargs_pass_on_as_one_mapping(tmp_path):
    """NeMo-RL's policy.tokenizer.chat_template_kwargs (e.g. enable_thinking: false) is one value: the chat
    template's keyword arguments, handed on whole (not refused leaf by leaf)."""
    f = tmp_path / "grpo.yaml"
    f.write_text("policy:\n  tokenizer:\n    chat_template_kwargs:\n      enable_thinking: false\n")
    assert layer(str(f))["data.apply_chat_template_kwargs"] == {"enable_thinking": False}


def test_nemo_rls_distillation_file_runs_on_the_tiny_model(tmp_path, trained_tiny_model_dir):
    """distillation_math.yaml: distillation.* read as grpo.*'s layout, loss_fn.* the KL over the teacher's top-k
    logits (kl_type, mixed_kl_weight, zero_outside_topk), teacher.* the teacher. It loads as it is (tensor parallel
    2 beside context parallel 2: Ulysses); on one worker (both at 1) it runs two steps on the tiny model, distilled
    from its number-guessing variant, one sample a prompt as the file says; the loss is the top-k KL alone, logged
    beside the reward it does not train on. (TP x Ulysses: tests/test_tensor_parallel.py.)"""
    from posttrain.driver.build import build_run
    from posttrain.data.preprocess import arith
    from posttrain.driver.loop import train
    from posttrain.models import shipped

    path = tmp_path / "distillation_math.yaml"
    path.write_text(json.dumps(examples()["configs"]["distillation_math.yaml"]))  # JSON is YAML
    as_is = load_config(str(path), [])
    assert (as_is.actor.tensor_parallel_size, as_is.actor.ulysses_sequence_parallel_size) == (2, 2)
    assert as_is.distillation.tensor_parallel_size == 4  # teacher.dtensor_cfg's: the teacher split wider
    single = ["policy.dtensor_cfg.tensor_parallel_size=1"]
    cfg = load_config(str(path), single)
    assert cfg.actor.ulysses_sequence_parallel_size == 2  # its context parallelism: Ulysses, 2 workers a sequence
    d, loss = cfg.distillation, cfg.distillation.distillation_loss
    assert d.enabled and d.teacher_models == {"teacher": {"model_path": "Qwen/Qwen3-4B"}}
    assert (loss.loss_mode, loss.topk, loss.kl_type, loss.mixed_kl_weight, loss.zero_outside_topk) == \
        ("kl_topk", 64, "mixed", 0.5, False)
    assert not loss.use_task_rewards and not loss.use_policy_gradient
    assert (cfg.rollout.n, cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (1, 128, 64)
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.actor.lr) == (1000, 20, 2e-5)
    for bad, said in (("loss_fn.kl_type=both", r"loss_fn\.kl_type=both .* not one of: forward, reverse, mixed"),
                      ("++loss_fn.ratio_clip_min=0.2", r"'loss_fn\.ratio_clip_min' .* takes kl_type"),
                      ("teacher.tokenizer.name=other", r"^teacher\.tokenizer\.name=other"),
                      ("++teachers=[{model_name: x}]", r"^teachers .*cross-tokenizer off-policy distillation")):
        with pytest.raises(ConfigError, match=said):
            load_config(str(path), [*single, bad])
    train_file, test_file = arith.run(tmp_path / "data", num_train=32, num_test=8)
    small = [*single, "policy.dtensor_cfg.context_parallel_size=1", "teacher.dtensor_cfg.tensor_parallel_size=1",
             "distillation.num_prompts_per_step=8", "distillation.max_num_steps=2",
             "distillation.val_period=2", "distillation.topk_logits_k=8", "loss_fn.kl_type=reverse",
             "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8",
             "policy.max_total_sequence_length=64", "policy.generation.backend=hf", "policy.precision=float32",
             "teacher.precision=float32", f"teacher.model_name={shipped.games_model()}", "checkpointing.enabled=false",
             "cluster.gpus_per_node=1", "teacher.logprob_batch_size=8",
             f"logger.log_dir={tmp_path / 'logs'}", f"model.path={trained_tiny_model_dir}",
             f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files=[{train_file}]", f"data.val_files=[{test_file}]",
             "data.prompt_file=null", "data.max_response_length=4"]  # posttrain's keys mix in
    cfg = load_config(str(path), small)
    assert (cfg.distillation.distillation_loss.kl_type, cfg.distillation.log_prob_micro_batch_size) == ("reverse", 8)
    run = build_run(cfg)
    before = {n: p.detach().clone() for n, p in run.actor.policy.named_parameters()}
    assert train(run)["steps"] == 2
    assert any(not torch.equal(before[n], p.detach()) for n, p in run.actor.policy.named_parameters())
    steps = [x for x in read_metrics(tmp_path / "run") if "distillation/loss" in x]
    assert len(steps) == 2 and all(x["distillation/loss"] > 0 and "critic/score/mean" in x for x in steps)
    assert any("val/score/mean" in x for x in read_metrics(tmp_path / "run"))


@pytest.mark.parametrize("text", ["distillation: true\n", "distillation: {max_num_steps: 2}\nloss_fn: [1]\n",
                                  "distillation: {max_num_steps: 2}\nteacher: x\n"])
def test_a_distillation_section_that_is_not_a_mapping_is_named(tmp_path, text):
    from posttrain.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="must be a mapping of NeMo-RL's") as e:
        load_config(str(path), [])
    assert "\n" not in str(e.value)


# Every NeMo-RL config under examples/configs with policy.dtensor_cfg.tensor_parallel_size above 1 at the same commit,
# keyed by its path there (bench/nemo_rl_configs.py --tensor-parallel --generate tests/data/nemo_rl), and what
# posttrain makes of it, as the guide's section 6 says: {path: (LOADS, {key: value it loads with}) or the NeMo-RL
# key its one-line refusal names}
TENSOR_PARALLEL = HERE / "tensor_parallel_7ea279a.json"
RECIPE = "recipes/llm/"
TP_OUTCOMES = {
    "distillation_math.yaml": (LOADS, {"actor.tensor_parallel_size": 2, "actor.ulysses_sequence_parallel_size": 2,
                                       "distillation.tensor_parallel_size": 4}),
    RECIPE + "distillation-qwen3-32b-to-4b-base-1n8g-fsdp2tp2-dynamicbatch.v1.yaml": (
        LOADS, {"actor.tensor_parallel_size": 2, "distillation.tensor_parallel_size": 8}),
    RECIPE + "distillation-qwen3-32b-to-4b-base-2n4g-fsdp2tp1-long.v1.yaml": (
        LOADS, {"actor.tensor_parallel_size": 2, "actor.ulysses_sequence_parallel_size": 2}),
    RECIPE + "distillation-qwen3-32b-to-4b-base-2n8g-fsdp2tp2-long.v1.yaml": (
        LOADS, {"actor.tensor_parallel_size": 2, "actor.ulysses_sequence_parallel_size": 2}),
    RECIPE + "distillation-qwen3-32b-to-4b-base-2n8g-fsdp2tp2-seqpack.v1.yaml": (
        LOADS, {"actor.tensor_parallel_size": 2, "distillation.tensor_parallel_size": 8}),
    # generation on a node of its own (asynchronous training, k = 0), the student and its teacher on the other's 8
    RECIPE + "distillation-qwen3-32b-to-4b-base-2n8g-fsdp2tp8-noncolocated.v1.yaml": (LOADS, {
        "actor.tensor_parallel_size": 8, "trainer.nnodes": 1, "trainer.n_gpus_per_node": 8,
        "async_training.enable": True, "async_training.max_trajectory_age_steps": 0,
        "async_training.rollout_nnodes": 1, "async_training.rollout_n_gpus_per_node": 8}),
    RECIPE + "distillation-xtoken-off-policy-multiteacher-qwen3-4b-llama3.2-3b-to-llama3.2-1b-1n8g-dtensor-tp4cp2.yaml":
        "teachers",
    RECIPE + "distillation-xtoken-off-policy-qwen3-4b-to-llama3.2-1b-1n8g-dtensor-tp4cp2.yaml": "teachers",
    RECIPE + "dpo-llama3.1-8b-instruct-4n8g-fsdp2tp4.yaml": "dpo",
    RECIPE + "dpo-mistral-nemo-instruct-2407-1n8g-fsdp2tp8-actckpt-long.yaml": "dpo",
    RECIPE + "grpo-deepscaler-1.5b-16K.yaml": (LOADS, {"actor.tensor_parallel_size": 2}),
    RECIPE + "grpo-deepscaler-1.5b-24K.yaml": (LOADS, {"actor.tensor_parallel_size": 2}),
    RECIPE + "grpo-gemma3-27b-it-8n4g-fsdp2tp4-actckpt-long.yaml": (LOADS, {"actor.tensor_parallel_size": 4}),
    RECIPE + "grpo-gemma3-27b-it-8n8g-fsdp2tp8-actckpt-long.yaml": (LOADS, {"actor.tensor_parallel_size": 8}),
    RECIPE + "grpo-llama3.2-1b-instruct-1n8g-fsdp2tp2-temp0.8-topp0.9-topk50-tq_mooncake.yaml": (
        LOADS, {"actor.tensor_parallel_size": 2}),
    RECIPE + "grpo-llama3.2-1b-instruct-1n8g-fsdp2tp2-temp0.8-topp0.9-topk50.yaml": (
        LOADS, {"actor.tensor_parallel_size": 2}),
    RECIPE + "grpo-qwen2.5-32b-32n4g-fsdp2tp4-actckpt-long.v3.yaml": (LOADS, {"actor.tensor_parallel_size": 4}),
    RECIPE + "grpo-qwen2.5-32b-32n8g-fsdp2tp8-actckpt-long.v3.yaml": (LOADS, {"actor.tensor_parallel_size": 8}),
    RECIPE + "grpo-qwen2.5-32b-32n8g-fsdp2tp8-actckpt.v3.yaml": (LOADS, {"actor.tensor_parallel_size": 8}),
    RECIPE + "grpo-qwen2.5-7b-instruct-4n4g-fsdp2tp2.v3.yaml": (LOADS, {"actor.tensor_parallel_size": 2}),
    # SFT on OpenMathInstruct-2's SFT rows (posttrain's named set, its generated_solution), the tokenizer named
    # apart from the model as model.tokenizer_path
    RECIPE + "sft-llama3.1-8b-1n8g-fsdp2tp2.yaml": (LOADS, {
        "actor.tensor_parallel_size": 2, "model.tokenizer_path": "meta-llama/Llama-3.1-8B-Instruct",
        "data.dataset_name": "OpenMathInstruct-2", "data.response_key": "generated_solution"}),
    RECIPE + "sft-llama3.1-8b-1n8g-fsdp2tp4-dynamicbatch.yaml": (LOADS, {"actor.tensor_parallel_size": 4}),
    RECIPE + "sft-qwen2.5-32b-4n8g-fsdp2tp8sp-actckpt.v3.yaml": (LOADS, {"actor.tensor_parallel_size": 8,
                                                                        "actor.sequence_parallel": True}),
    "sft_openmathinstruct2.yaml": (LOADS, {"actor.tensor_parallel_size": 4}),
}


def test_the_tensor_parallel_configs_are_every_one_nemo_rl_has():
    stored = json.loads(TENSOR_PARALLEL.read_text())
    assert stored["about"]["commit"] == json.loads(EXAMPLES.read_text())["about"]["commit"]
    assert stored["about"]["generated_by"].endswith("--generate tests/data/nemo_rl --tensor-parallel")
    assert sorted(stored["configs"]) == sorted(TP_OUTCOMES)
    assert all((tree.get("policy") or {}).get("dtensor_cfg", {}).get("tensor_parallel_size", 1) > 1
               for tree in stored["configs"].values())


@pytest.mark.parametrize("name", sorted(TP_OUTCOMES))
def test_nemo_rls_tensor_parallel_configs_load_or_are_refused_as_the_guide_says(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # some recipes name files under ${oc.env:HF_HOME}
    tree = json.loads(TENSOR_PARALLEL.read_text())["configs"][name]
    path = tmp_path / Path(name).name
    path.write_text(json.dumps(tree))  # JSON is YAML
    command = "sft" if "sft" in tree else "train"
    expected = TP_OUTCOMES[name]
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as refused:
            train_config(path, command=command)
        assert "\n" not in str(refused.value) and re.match(rf"{re.escape(expected)}\b", str(refused.value)), \
            str(refused.value)
        return
    cfg, want = train_config(path, command=command), expected[1]
    got = config_to_dict(cfg)
    for key, value in want.items():
        section, field = key.split(".", 1)
        node = got[section]
        for part in field.split("."):
            node = node[part]
        assert node == value, (key, node)
