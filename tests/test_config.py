import pytest
import yaml

from posttrain.config import config_to_yaml, load_config
from posttrain.errors import ConfigError
from posttrain.help_config import describe_keys

VERL_COMMAND = """data.train_files=gsm8k/train.parquet data.val_files=gsm8k/test.parquet data.train_batch_size=16
data.max_prompt_length=256 data.max_response_length=64 actor_rollout_ref.model.path=/m
actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.actor.ppo_mini_batch_size=16
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.n=8
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl algorithm.adv_estimator=grpo algorithm.kl_ctrl.kl_coef=0.001
trainer.logger=console trainer.val_before_train=True trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=2
trainer.test_freq=2 trainer.default_local_dir=runs/x trainer.total_epochs=1 trainer.total_training_steps=2
trainer.project_name=p trainer.experiment_name=e""".split()


def error(overrides, path=None):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_the_verl_tutorial_command_maps_onto_our_keys():
    c = load_config(None, VERL_COMMAND)
    assert c.model.path == "/m" and c.actor.lr == 1e-5 and isinstance(c.actor.lr, float)
    assert c.data.train_files == ["gsm8k/train.parquet"] and c.data.val_files == ["gsm8k/test.parquet"]
    assert (c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size) == (16, 8)
    assert (c.rollout.log_prob_micro_batch_size, c.ref.log_prob_micro_batch_size) == (8, 8)
    assert c.actor.use_kl_loss is True and c.actor.kl_loss_type == "low_var_kl"
    assert c.trainer.run_dir == "runs/x" and c.trainer.logger == ["console"]
    assert c.trainer.total_training_steps == 2 and c.algorithm.kl_ctrl.kl_coef == 0.001
    assert c.actor.clip_ratio_low == c.actor.clip_ratio_high == 0.2   # derived from clip_ratio
    assert c.data.max_response_length == 64 and c.actor.weight_decay == 0.01  # no preset: a model was given


def test_preset_only_without_a_model():
    c = load_config(None, [])
    assert c.model.path is None and c.actor.lr == 1e-4 and c.data.max_response_length == 8
    c = load_config(None, ["actor.lr=3e-4"])
    assert c.actor.lr == 3e-4 and c.data.train_batch_size == 32  # preset below the override
    c = load_config(None, ["model.path=/m"])
    assert c.actor.lr == 1e-6 and c.data.train_batch_size == 64  # general defaults


def test_misspelt_keys_name_the_nearest():
    assert "did you mean 'actor.lr'" in error(["actor.lrr=1"])
    assert "did you mean 'actor_rollout_ref.actor.optim.lr'" in error(["actor_rollout_ref.actor.optim.lrr=1"])
    assert "trainer.total_training_steps" in error(["trainer.total_trainig_steps=3"])


def test_unsupported_verl_key():
    msg = error(["actor_rollout_ref.actor.checkpoint.async_save=true"])
    assert "verl key 'actor_rollout_ref.actor.checkpoint.async_save'" in msg and "not supported yet" in msg
    assert "--help-config" in msg
    assert "not supported; supported: grpo" in error(["algorithm.adv_estimator=opo"])
    assert "'neptune' is not one of: console, jsonl, tensorboard, wandb, mlflow" in error(["trainer.logger=[neptune]"])


def test_wrong_types_and_ranges():
    assert error(["data.train_batch_size=abc"]) == (
        "config key 'data.train_batch_size' expects int, got 'abc'; fix the value")
    assert "actor.use_kl_loss" in error(["actor.use_kl_loss=maybe"])
    assert "rollout.top_p" in error(["rollout.top_p=1.5"])
    assert "rollout.temperature" in error(["rollout.temperature=-1"])
    assert "rollout.n must be a positive integer" in error(["rollout.n=0"])
    assert "actor.loss_agg_mode=sum is not one of" in error(["actor.loss_agg_mode=sum"])
    assert "clip_ratio_c" in error(["actor.clip_ratio_c=0.5"])
    assert "not key=value" in error(["actor.lr"])


def test_cross_field_rules():
    assert "divisible by actor.ppo_mini_batch_size" in error(["data.train_batch_size=48", "actor.ppo_mini_batch_size=32"])
    assert "larger than data.train_batch_size" in error(["data.train_batch_size=16"])  # preset mini is 32
    assert "divisible by actor.ppo_micro_batch_size=48" in error(["actor.ppo_micro_batch_size=48"])  # 32 x 8 = 256
    assert "target_kl" in error(["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"])
    assert "critic" in error(["trainer.critic_warmup=1"])


def test_yaml_files_in_our_layout_and_verls(tmp_path):
    ours = tmp_path / "ours.yaml"
    ours.write_text(yaml.safe_dump({"actor": {"lr": 2e-4}, "rollout": {"n": 4, "val_kwargs": {"n": 2}}}))
    c = load_config(str(ours), ["rollout.n=16"])
    assert c.actor.lr == 2e-4 and c.rollout.n == 16 and c.rollout.val_kwargs.n == 2
    verl = tmp_path / "verl.yaml"
    verl.write_text("actor_rollout_ref:\n  model: {path: /m}\n  actor:\n    optim: {lr: 1e-5}\n"
                    "custom_reward_function: {path: r.py, name: score}\n")
    c = load_config(str(verl))
    assert c.model.path == "/m" and c.actor.lr == 1e-5 and c.reward.custom_fn == "r.py:score"
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lrr: 1\n")
    assert "unknown config key 'actor.lrr' (in" in error([], str(bad))
    assert "does not exist" in error([], str(tmp_path / "none.yaml"))


def test_hydra_plus_and_lists():
    c = load_config(None, ["+trainer.val_before_train=False", "trainer.logger=[console]", "actor.betas=[0.9,0.95]"])
    assert c.trainer.val_before_train is False and c.trainer.logger == ["console"] and c.actor.betas == [0.9, 0.95]


def test_saved_config_loads_back(tmp_path):
    c = load_config(None, VERL_COMMAND)
    (tmp_path / "config.yaml").write_text(config_to_yaml(c))  # as a run saves it
    assert load_config(str(tmp_path / "config.yaml")) == c
    assert "actor_rollout_ref.actor.optim.lr -> actor.lr" in describe_keys()


def test_algorithm_presets_set_their_keys_and_yours_win():
    cfg = load_config(None, ["algorithm.name=dapo"])
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    assert cfg.algorithm.filter_groups.enable and cfg.reward.overlong_buffer.enable
    assert cfg.reward.overlong_buffer.len == 1  # a fifth of the embedded task's 8-token limit
    cfg = load_config(None, ["algorithm.name=dapo", "actor_rollout_ref.actor.clip_ratio_high=0.3",
                             "algorithm.filter_groups.enable=false"])
    assert cfg.actor.clip_ratio_high == 0.3 and not cfg.algorithm.filter_groups.enable
    cfg = load_config(None, ["algorithm.name=drgrpo"])
    assert not cfg.algorithm.norm_adv_by_std_in_grpo and cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    cfg = load_config(None, ["algorithm.name=gspo"])
    assert cfg.actor.policy_loss.loss_mode == "gspo" and cfg.actor.clip_ratio_low == 3e-4
    assert load_config(None, ["algorithm.name=ppo"]).algorithm.adv_estimator == "gae"
    with pytest.raises(ConfigError, match="algorithm.name=ppo2 is not one of: grpo, ppo"):
        load_config(None, ["algorithm.name=ppo2"])


def test_a_preset_in_a_yaml_file_is_overridden_on_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  name: gspo\n")
    cfg = load_config(str(path), ["actor.loss_agg_mode=token-mean"])
    assert cfg.actor.policy_loss.loss_mode == "gspo" and cfg.actor.loss_agg_mode == "token-mean"
    cfg = load_config(str(path), ["algorithm.name=rloo"])  # the last name wins, and only its keys apply
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.actor.policy_loss.loss_mode == "vanilla"


def test_verl_keys_of_the_algorithm_family():
    cfg = load_config(None, [
        "algorithm.adv_estimator=gae", "critic.model.path=/m", "critic.optim.lr=2e-5",
        "critic.ppo_micro_batch_size_per_gpu=4", "critic.forward_micro_batch_size_per_gpu=16", "critic.cliprange_value=0.2",
        "trainer.critic_warmup=3", "algorithm.gamma=0.99", "algorithm.lam=0.95",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "reward_model.overlong_buffer.enable=True",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=0.5",
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=seq_reward",
        "algorithm.filter_groups.max_num_gen_batches=3",
    ])
    c = cfg.critic
    assert (c.model.path, c.lr, c.ppo_micro_batch_size_per_gpu, c.forward_micro_batch_size_per_gpu,
            c.cliprange_value) == ("/m", 2e-5, 4, 16, 0.2)
    # null critic sizes follow the actor's
    assert (c.ppo_mini_batch_size, c.ppo_epochs, c.loss_agg_mode) == (32, 1, "token-mean")
    assert (cfg.trainer.critic_warmup, cfg.algorithm.gamma, cfg.algorithm.lam) == (3, 0.99, 0.95)
    assert cfg.actor.policy_loss.loss_mode == "gspo"
    assert (cfg.reward.overlong_buffer.len, cfg.reward.overlong_buffer.penalty_factor) == (4, 0.5)
    assert (cfg.algorithm.filter_groups.metric, cfg.algorithm.filter_groups.max_num_gen_batches) == ("seq_reward", 3)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.critic_warmup=2"], "trainer.critic_warmup=2 needs a critic"),
    (["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=5"], "divisible by critic.ppo_mini_batch_size=5"),
    (["algorithm.adv_estimator=gae", "critic.cliprange_value=0"], "critic.cliprange_value must be > 0"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9"], "reward.overlong_buffer.len=9 must be"),
    (["reward_model.reward_kwargs.max_resp_len=0"], "reward.overlong_buffer.max_resp_len must be > 0"),
    (["algorithm.filter_groups.metric=accuracy"], "algorithm.filter_groups.metric=accuracy is not one of"),
    (["actor.policy_loss.loss_mode=clip_cov"], "actor.policy_loss.loss_mode=clip_cov is not one of: vanilla, gspo, gpg"),
    (["algorithm.adv_estimator=opo"], "algorithm.adv_estimator=opo is not supported; supported: grpo"),
    (["algorithm.lam=1.5"], "algorithm.lam in \\[0, 1\\]"),
    (["algorithm.name=grpo_passk", "rollout.n=1", "actor.ppo_micro_batch_size=32"], "it needs rollout.n >= 2"),
    (["algorithm.adv_estimator=grpo_loo", "rollout.n=1", "actor.ppo_micro_batch_size=32"],
     "grpo_loo compares each sample .* it needs rollout.n >= 2"),
    (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c must be > 1, or null"),
    (["actor.lr_warmup_start_factor=0"], "actor.lr_warmup_start_factor must be in \\(0, 1\\]"),
    (["critic.lr_warmup_start_factor=1.5"], "critic.lr_warmup_start_factor must be in \\(0, 1\\]"),
    (["trainer.max_epochs=0"], "trainer.max_epochs must be >= 1 or null"),
    (["actor.lr_scheduler_type=linear"], "^actor.lr_scheduler_type=linear is not one of: constant, cosine$"),
    (["actor_rollout_ref.actor.optim.warmup_style=wsd"], "actor.lr_scheduler_type=wsd is not one of: constant, cosine"),
    (["critic.optim.lr_scheduler_type=exp"], "critic.lr_scheduler_type=exp is not one of: constant, cosine"),
    (["actor.min_lr_ratio=1.5"], "actor.min_lr_ratio must be in \\[0, 1\\]"),
    (["critic.optim.min_lr_ratio=-0.1"], "critic.min_lr_ratio must be in \\[0, 1\\]"),
    (["actor_rollout_ref.actor.optim.num_cycles=0"], "actor.num_cycles must be a number > 0"),
    (["critic.num_cycles=.inf"], "critic.num_cycles must be a number > 0"),
    (["algorithm.overlong_filtering=true", "rollout.ignore_eos=true"], "every one would be filtered"),
])
def test_algorithm_family_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_nemo_rl_grpo_keys_load_and_reach_the_update():
    from posttrain.driver.settings import critic_spec, update_settings, worker_spec

    cfg = load_config()
    assert cfg.actor.clip_ratio_c == 3.0 and cfg.actor.lr_warmup_start_factor is None
    assert not cfg.algorithm.overlong_filtering and cfg.trainer.max_epochs is None and cfg.trainer.val_at_end
    cfg = load_config(None, ["algorithm.name=grpo_loo", "actor.clip_ratio_c=null", "actor.lr_warmup_start_factor=0.1",
                             "critic.lr_warmup_start_factor=0.5", "algorithm.overlong_filtering=true",
                             "trainer.max_epochs=2", "trainer.val_at_end=false"])
    assert cfg.algorithm.adv_estimator == "grpo_loo" and cfg.algorithm.norm_adv_by_std_in_grpo
    assert cfg.actor.clip_ratio_c is None and update_settings(cfg).clip_ratio_c is None
    assert worker_spec(cfg, "m", None, "cpu", 10).warmup_start_factor == 0.1
    assert critic_spec(cfg, "m", 10).warmup_start_factor == 0.5
    assert (cfg.algorithm.overlong_filtering, cfg.trainer.max_epochs, cfg.trainer.val_at_end) == (True, 2, False)
    # verl's spelling of the dual clip takes null too
    assert load_config(None, ["actor_rollout_ref.actor.clip_ratio_c=null"]).actor.clip_ratio_c is None


def test_verls_lr_schedule_keys_reach_the_actors_and_critics_specs():
    from posttrain.driver.settings import critic_spec, worker_spec

    cfg = load_config()
    assert (cfg.actor.lr_scheduler_type, cfg.actor.min_lr_ratio, cfg.actor.num_cycles) == ("constant", 0.0, 0.5)
    assert load_config(None, ["actor_rollout_ref.actor.optim.warmup_style=cosine"]).actor.lr_scheduler_type == "cosine"
    assert load_config(None, ["critic.optim.warmup_style=cosine"]).critic.lr_scheduler_type == "cosine"
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                             "actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "actor_rollout_ref.actor.optim.num_cycles=1",
                             "critic.optim.lr_scheduler_type=cosine", "critic.optim.min_lr_ratio=0.2",
                             "actor.lr_warmup_steps_ratio=0.1"])
    spec = worker_spec(cfg, "m", None, "cpu", 30)
    assert (spec.lr_scheduler_type, spec.min_lr_ratio, spec.num_cycles, spec.total_steps) == ("cosine", 0.1, 1.0, 30)
    assert spec.warmup_steps == 3
    critic = critic_spec(cfg, "m", 30)
    assert (critic.lr_scheduler_type, critic.min_lr_ratio, critic.num_cycles, critic.total_steps) == ("cosine", 0.2,
                                                                                                      0.5, 30)
    text = describe_keys()
    assert "actor_rollout_ref.actor.optim.warmup_style -> actor.lr_scheduler_type  [honoured]" in text
    assert "critic.optim.num_cycles -> critic.num_cycles  [honoured]" in text


def test_the_algorithms_page_table_matches_the_presets():
    import re
    from pathlib import Path

    from posttrain.config.presets import ALGORITHMS

    page = (Path(__file__).parents[1] / "docs" / "algorithms.md").read_text()
    rows = {}
    for line in page.splitlines():
        m = re.match(r"\| `(\w+)`[^|]*\| [^|]+ \| (.+) \|$", line)
        if m and m.group(1) in ALGORITHMS:
            pairs = re.findall(r"`([\w.]+)=([^`]+)`", m.group(2))
            rows[m.group(1)] = {k: yaml.safe_load(v) for k, v in pairs}
    assert rows == {name: p.keys for name, p in ALGORITHMS.items()}


def test_an_empty_section_in_a_yaml_file_sets_nothing(tmp_path):
    (tmp_path / "c.yaml").write_text("actor:\nactor_rollout_ref:\n  rollout: {}\ntrainer:\n  total_training_steps: 3\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert cfg.trainer.total_training_steps == 3 and cfg.actor.lr == load_config().actor.lr
    (tmp_path / "typo.yaml").write_text("actorr:\n")
    with pytest.raises(ConfigError, match="unknown config key 'actorr'"):
        load_config(str(tmp_path / "typo.yaml"))


def test_verls_dynamic_batch_keys_set_token_budgets_for_every_pass():
    from posttrain.driver.settings import critic_spec, update_settings, worker_spec

    base = ["model.path=/m", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=3",
            "actor.ppo_micro_batch_size=5"]  # 12 sequences do not divide into 5: no matter with a token budget
    c = load_config(None, base + ["actor_rollout_ref.actor.use_dynamic_bsz=True",
                                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3000",
                                  "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=5000",
                                  "critic.ppo_max_token_len_per_gpu=7000", "algorithm.adv_estimator=gae"])
    # the log-prob passes follow the actor unless set (verl's defaults); the critic's value passes its own budget
    assert (c.rollout.log_prob_use_dynamic_bsz, c.rollout.log_prob_max_token_len_per_gpu) == (True, 3000)
    assert (c.ref.log_prob_use_dynamic_bsz, c.ref.log_prob_max_token_len_per_gpu) == (True, 5000)
    assert (c.critic.use_dynamic_bsz, c.critic.forward_max_token_len_per_gpu) == (True, 7000)
    spec = worker_spec(c, "/m", None, "cpu", total_steps=1)
    assert spec.update.micro_max_tokens == 3000 == update_settings(c).micro_max_tokens
    assert (spec.log_prob_max_tokens, spec.ref.log_prob_max_tokens) == (3000, 5000)
    critic = critic_spec(c, "/m", 1).update
    assert (critic.micro_max_tokens, critic.forward_max_tokens) == (7000, 7000)
    off = worker_spec(load_config(None, base[:-1] + ["actor.ppo_micro_batch_size=4"]), "/m", None, "cpu", total_steps=1)
    assert off.update.micro_max_tokens is None and off.log_prob_max_tokens is None
    assert "must be divisible by actor.ppo_micro_batch_size=5" in error(base)
    assert "actor.ppo_max_token_len_per_gpu must be a positive number of tokens" in error(
        base + ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=0"])


def test_verls_switches_for_what_posttrain_does_not_do():
    """The value that means "off" loads (it is what posttrain does); any other
    is one line naming the alternative; verl-only inputs are named unused."""
    import warnings

    ok = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=1", "actor_rollout_ref.actor.use_torch_compile=False",
          "actor_rollout_ref.ref.use_torch_compile=False", "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
          "critic.model.fsdp_config.fsdp_size=-1", "actor_rollout_ref.ref.strategy=fsdp",
          "actor_rollout_ref.nccl_timeout=1800", "data.trust_remote_code=True", "data.image_key=images"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = load_config(None, ["model.path=/m", *ok])
    assert c.trainer.collective_timeout_s == 1800 and c.model.trust_remote_code is True
    for override, message in [
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor.ulysses_sequence_parallel_size=2 must "
                                                                      "divide the 1 workers"),
        ("critic.ulysses_sequence_parallel_size=4", "critic.ulysses_sequence_parallel_size=4 differs from actor."),
        ("actor_rollout_ref.ref.fsdp_config.fsdp_size=8", "ref.fsdp_size=8: hybrid sharding is not supported"),
        ("actor_rollout_ref.model.fused_kernel_options.impl_backend=cuda", "impl_backend=cuda is not one of: torch"),
        ("actor_rollout_ref.rollout.name=sglang", "posttrain has no sglang engine; use rollout.name=vllm"),
    ]:
        assert message in error(["model.path=/m", override]), override
    with pytest.warns(UserWarning, match="data.return_raw_chat, trainer.use_legacy_worker_impl: verl's settings"):
        load_config(None, ["model.path=/m", "data.return_raw_chat=True", "trainer.use_legacy_worker_impl=disable"])


def test_verls_unused_keys_are_its_dialects_named_in_one_line_as_before(tmp_path):
    """verl's keys that posttrain takes and does not use are not posttrain's keys (dialects/verl/keys.py: UNUSED):
    read in verl's spelling and in posttrain's former one, after every layer (a later one winning), dropped before
    the merge; the ones set to anything but their default are named in validation's one line, a value the merge
    would refuse is refused in its words."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"use_shm": True}, "reward_model": {"rollout": {"name": "vllm"}}}))
    with pytest.warns(UserWarning) as caught:
        c = load_config(str(path), ["model.path=/m", "actor_rollout_ref.rollout.layered_summon=True", "model.use_shm=0",
                                    "actor_rollout_ref.actor.fsdp_config.use_orig_params=1", "data.gen_batch_size=1",
                                    "trainer.max_critic_ckpt_to_keep=3"])
    assert [str(w.message) for w in caught] == [
        "reward.model.rollout, rollout.layered_summon, actor.use_orig_params, data.gen_batch_size, "
        "trainer.max_critic_ckpt_to_keep (no critic): verl's settings for what posttrain does its own way (its "
        "servers, worker classes, kernels: `posttrain train --help-config` says each); set, but unused"]
    saved = config_to_yaml(c)
    assert "use_shm" not in saved and "layered_summon" not in saved and "gen_batch_size" not in saved
    assert error(["data.return_raw_chat=x"]) == "config key 'data.return_raw_chat' expects bool, got 'x'; fix the value"
    assert error(["actor_rollout_ref.rollout.trace=0"]) == (
        "config key 'rollout.trace' expects Dict[str, Any], got 0; fix the value")


def test_verls_memory_and_compile_switches_reach_the_passes():
    """use_fused_kernels, the entropy's chunking and checkpointing and torch.compile
    are honoured (their effect: tests/test_fast_paths.py); a triton backend is named unused."""
    import warnings

    from posttrain.driver.settings import update_settings, worker_spec

    keys = ["actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.actor.entropy_checkpointing=true",
            "++actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
            "actor_rollout_ref.actor.use_torch_compile=True", "actor_rollout_ref.ref.use_torch_compile=True"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = load_config(None, ["model.path=/m", *keys])
    o = update_settings(c).pass_options()
    assert (o.fused, o.entropy_chunking, o.entropy_checkpointing, o.compile) == (True, True, True, True)
    assert worker_spec(c, "/m", None, "cpu", 10).ref.torch_compile is True
    with pytest.warns(UserWarning, match="model.fused_kernel_options.impl_backend=triton: verl's settings"):
        c = load_config(None, ["model.path=/m", "actor_rollout_ref.model.use_fused_kernels=True",
                               "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"])
    assert c.model.use_fused_kernels


def test_a_verl_dataset_class_is_refused_in_one_line():
    assert error(["data.custom_cls.path=recipe/minicpmo/rl_dataset.py", "data.custom_cls.name=RLHFDataset"]) == (
        "data.custom_cls.path=recipe/minicpmo/rl_dataset.py: a verl dataset class is not supported; posttrain reads "
        "parquet rows itself (prompt, data_source, reward_model.ground_truth): write the data in that layout "
        "(`posttrain preprocess` has examples) and leave data.custom_cls out")


def test_critic_checkpoints_are_kept_with_the_actors():
    ppo = ["algorithm.adv_estimator=gae", "trainer.max_actor_ckpt_to_keep=1"]
    assert load_config(None, [*ppo, "trainer.max_critic_ckpt_to_keep=1"]).trainer.max_ckpt_to_keep == 1
    with pytest.warns(UserWarning, match=r"trainer.max_critic_ckpt_to_keep \(no critic\): verl's settings"):
        load_config(None, ["trainer.max_critic_ckpt_to_keep=3"])
    assert error([*ppo, "trainer.max_critic_ckpt_to_keep=2"]) == (
        "trainer.max_critic_ckpt_to_keep=2: a posttrain checkpoint holds the actor and the critic together; set "
        "trainer.max_ckpt_to_keep (verl's max_actor_ckpt_to_keep, now 1) to the count you want for both")


def test_multi_turn_keys_load_off_and_enabling_it_is_one_line():
    with pytest.warns(UserWarning, match="rollout.multi_turn.format: settings of LoRA .* or multi-turn rollouts"):
        c = load_config(None, ["model.path=/m", "actor_rollout_ref.rollout.multi_turn.format=chatml"])
    assert c.rollout.multi_turn.format == "chatml"
    assert error(["model.path=/m", "actor_rollout_ref.rollout.multi_turn.enable=True"]) == (
        "rollout.multi_turn.enable=true needs the other side of the conversation: tools "
        "(rollout.multi_turn.tool_config_path=TOOLS.yaml in verl's format, or rollout.multi_turn.tools=[pkg.mod:fn]), "
        "an environment (rollout.multi_turn.environment=pkg.mod:Class), verl's simulated user "
        "(rollout.multi_turn.interaction_config_path=FILE.yaml) or an agent program "
        "(rollout.multi_turn.agent=pkg.mod:function)")
    on = ["model.path=/m", "actor_rollout_ref.rollout.multi_turn.enable=True", "rollout.multi_turn.tools=[m:f]"]
    assert error([*on, "actor_rollout_ref.rollout.multi_turn.format=chatml"]) == (
        "rollout.multi_turn.format=chatml is not one of: hermes")
    assert "tools and an environment / interaction / agent together are not supported yet" in error(
        [*on, "actor_rollout_ref.rollout.multi_turn.interaction_config_path=i.yaml"])
    assert load_config(None, on).rollout.multi_turn.tools == ["m:f"]


def test_verls_vision_data_keys_map_or_are_named_unused():
    """data.image_key / data.video_key are posttrain's; verl's return_multi_modal_inputs (true: what posttrain
    does) and image_patch_size (the processor's own is used) are named unused when set otherwise."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = load_config(None, ["model.path=/m", "data.image_key=pics", "data.video_key=clips",
                               "data.return_multi_modal_inputs=True", "data.image_patch_size=14",
                               "actor_rollout_ref.actor.freeze_vision_tower=True"])
    assert (c.data.image_key, c.data.video_key, c.actor.freeze_vision_tower) == ("pics", "clips", True)
    with pytest.warns(UserWarning, match="^data.return_multi_modal_inputs, data.image_patch_size: verl's settings"):
        load_config(None, ["model.path=/m", "data.return_multi_modal_inputs=False", "data.image_patch_size=16"])
    text = describe_keys()
    assert "data.video_key: str = 'videos'  [rows with videos refused (not supported yet)]" in text
    assert ("data.return_multi_modal_inputs: bool = True  [true: posttrain always passes the images' tensors; "
            "false named unused]") in text
    assert "data.image_patch_size: int = 14  [the processor's own patch size is used; another value named unused]" in text


def test_help_config_says_what_happens_to_each_verl_key():
    text = describe_keys()
    assert "actor_rollout_ref.actor.fsdp_config.param_offload -> actor.param_offload  [honoured]" in text
    assert "actor_rollout_ref.rollout.enforce_eager -> rollout.enforce_eager  [vLLM's engine" in text
    assert ("actor_rollout_ref.actor.fsdp_config.fsdp_size -> actor.fsdp_size  "
            "[only this value; others refused]") in text
    assert ("actor_rollout_ref.ref.ulysses_sequence_parallel_size -> ref.ulysses_sequence_parallel_size  "
            "[only the actor's value]") in text
    assert "actor_rollout_ref.model.lora_rank -> model.lora_rank  [honoured]" in text
    assert "actor_rollout_ref.model.use_fused_kernels -> model.use_fused_kernels  [honoured]" in text
    assert "data.return_raw_chat: bool = False  [verl only: unused]" in text
    assert "Any other verl key is refused" in text


