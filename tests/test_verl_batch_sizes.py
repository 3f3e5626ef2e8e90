"""verl's deprecated global micro-batch sizes keep verl's meaning: sequences (the reward model's: chats) over all
workers, each worker taking size // (trainer.nnodes x trainer.n_gpus_per_node / the Ulysses size), rounded down
(the reward model's: // the workers), as verl's workers divide them (verl 0.4-0.7's fsdp_workers.py); posttrain's
own sizes, and verl's *_per_gpu keys, are per worker. The expected values below are worked out by hand;
tests/test_verl_crosscheck.py runs verl 0.9.1's own checks of the global sizes."""

import pytest
import yaml

from posttrain.config import config_to_yaml, load_config
from posttrain.errors import ConfigError
from posttrain.help_config import describe_keys

# 16 prompts x 8 samples: 128 sequences a mini-batch; the critic is checked (gae)
BASE = ["actor_rollout_ref.model.path=/m", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=gae"]
GLOBALS = ["actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.rollout.log_prob_micro_batch_size=32",
           "actor_rollout_ref.ref.log_prob_micro_batch_size=8", "critic.ppo_micro_batch_size=12",
           "critic.forward_micro_batch_size=20", "reward_model.micro_batch_size=24"]


def sizes(cfg):
    return (cfg.actor.ppo_micro_batch_size, cfg.rollout.log_prob_micro_batch_size, cfg.ref.log_prob_micro_batch_size,
            cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.forward_micro_batch_size_per_gpu,
            cfg.reward.model.micro_batch_size)


def error(overrides, path=None):
    with pytest.raises(ConfigError) as e:
        load_config(path, BASE + overrides)
    return str(e.value)


@pytest.mark.parametrize("layout, expected", [
    # one worker: a global size is the worker's
    (["trainer.n_gpus_per_node=1"], (16, 32, 8, 12, 20, 24)),
    # 2 workers: 16 // 2, 32 // 2, 8 // 2, 12 // 2, 20 // 2, and the reward model's 24 // 2
    (["trainer.n_gpus_per_node=2"], (8, 16, 4, 6, 10, 12)),
    # 2 nodes x 2: 4 workers, 4 data-parallel ones: 16 // 4, ..., 24 // 4
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=2"], (4, 8, 2, 3, 5, 6)),
    # 4 workers in Ulysses pairs: 2 data-parallel groups, 16 // 2, ...; the reward model has no Ulysses: 24 // 4
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     (8, 16, 4, 6, 10, 6)),
    # 8 workers (2 x 4) in Ulysses pairs: 4 groups: 16 // 4, 32 // 4, 8 // 4, 12 // 4, 20 // 4 and 24 // 8
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     (4, 8, 2, 3, 5, 3)),
])
def test_a_global_size_is_divided_over_the_data_parallel_workers(layout, expected):
    cfg = load_config(None, BASE + GLOBALS + layout)
    assert sizes(cfg) == expected
    # the run's config.yaml holds the per-worker sizes alone: read back on the same workers it is the same run
    saved = yaml.safe_load(config_to_yaml(cfg))
    assert "ppo_micro_batch_size_global" not in saved["actor"] and "ppo_micro_batch_size_global" not in saved["critic"]
    assert (saved["actor"]["ppo_micro_batch_size"], saved["critic"]["ppo_micro_batch_size_per_gpu"]) == expected[::3]


def test_the_dialect_divides_them_before_the_merge_over_the_runs_layers():
    """resolve() reads the run's layers together, a later one winning, over the presets and the schema's defaults:
    the global sizes (posttrain's former *_global keys, verl's spelling translated) leave the layers, and a layer
    of per-worker keys goes on top."""
    from posttrain.config.dialects.verl import global_sizes, resolve

    preset = {"trainer.n_gpus_per_node": 8}  # under the run's own layers
    file = {"trainer.n_gpus_per_node": 2, "actor.ppo_micro_batch_size_global": 16, "trainer.nnodes": 2}
    cli = {"critic.forward_micro_batch_size_global": 20, "actor.ulysses_sequence_parallel_size": 2}
    layers, unused = resolve([preset, file, cli], set(file) | set(cli))
    # 2 nodes x 2 workers in Ulysses pairs: 2 data-parallel groups, 16 // 2 and 20 // 2
    assert layers == [preset, {"trainer.n_gpus_per_node": 2, "trainer.nnodes": 2},
                      {"actor.ulysses_sequence_parallel_size": 2},
                      {"actor.ppo_micro_batch_size": 8, "critic.forward_micro_batch_size_per_gpu": 10}] and unused == []
    # the reward model's by the 4 workers alone: 24 // 4; posttrain's own per-worker key beside it is refused
    sizes = {"trainer.nnodes": 2, "trainer.n_gpus_per_node": 2, "actor.ulysses_sequence_parallel_size": 2,
             "reward.model.micro_batch_size": 64}
    assert global_sizes.per_worker({"reward.model.micro_batch_size_global": 24}, sizes.get, set()) == {
        "reward.model.micro_batch_size": 6}
    with pytest.raises(ConfigError, match=r"reward_model.micro_batch_size=24 \(reward.model.micro_batch_size_global\), "
                                          r"verl's deprecated global micro-batch, and the per-worker "
                                          r"reward_model.micro_batch_size_per_gpu=64 \(reward.model.micro_batch_size\)"):
        global_sizes.per_worker({"reward.model.micro_batch_size_global": 24}, sizes.get,
                                {"reward.model.micro_batch_size"})
    # a value the merge will refuse: no translation, the merge's own error
    assert resolve([{"trainer.nnodes": "two", "actor.ppo_micro_batch_size_global": 16}], set())[0][-1] == {}
    assert error(["trainer.nnodes=two", "actor_rollout_ref.actor.ppo_micro_batch_size=16"]) == (
        "config key 'trainer.nnodes' expects int, got 'two'; fix the value")
    assert error(["actor_rollout_ref.actor.ppo_micro_batch_size=x"]) == (
        "config key 'actor.ppo_micro_batch_size_global' expects Optional[int], got 'x'; fix the value")


def test_a_saved_config_read_again_is_not_divided_twice(tmp_path):
    cfg = load_config(None, BASE + GLOBALS + ["trainer.n_gpus_per_node=2"])
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    assert sizes(load_config(str(path), [])) == (8, 16, 4, 6, 10, 12)


def test_rounded_down_as_verl_does():
    # 2 workers: 7 // 2 = 3 sequences; 5 // 2 = 2 chats
    cfg = load_config(None, BASE + ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=7",
                                    "reward_model.micro_batch_size=5", "data.train_batch_size=48",
                                    "actor_rollout_ref.actor.ppo_mini_batch_size=48"])  # 384 sequences: 3 divides
    assert (cfg.actor.ppo_micro_batch_size, cfg.reward.model.micro_batch_size) == (3, 2)


def test_per_worker_sizes_are_not_divided():
    cfg = load_config(None, BASE + [
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=4",
        "critic.forward_micro_batch_size_per_gpu=20", "reward_model.micro_batch_size_per_gpu=24"])
    assert sizes(cfg) == (16, 32, 8, 4, 20, 24)
    cfg = load_config(None, BASE + ["trainer.n_gpus_per_node=2", "actor.ppo_micro_batch_size=16",
                                    "rollout.log_prob_micro_batch_size=32", "ref.log_prob_micro_batch_size=8"])
    assert sizes(cfg)[:3] == (16, 32, 8)


def test_posttrains_global_keys_and_a_verl_file():
    cfg = load_config(None, BASE + ["trainer.n_gpus_per_node=2", "actor.ppo_micro_batch_size_global=16",
                                    "critic.ppo_micro_batch_size_global=12"])
    assert (cfg.actor.ppo_micro_batch_size, cfg.critic.ppo_micro_batch_size_per_gpu) == (8, 6)


def test_a_verl_file_with_its_null_global_keys(tmp_path):
    # verl's own YAML lists the deprecated keys as null beside the per-GPU ones: not "both set"
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump({
        "actor_rollout_ref": {"actor": {"ppo_micro_batch_size": None, "ppo_micro_batch_size_per_gpu": 4},
                              "rollout": {"log_prob_micro_batch_size": None, "log_prob_micro_batch_size_per_gpu": 8}},
        "critic": {"ppo_micro_batch_size": None, "ppo_micro_batch_size_per_gpu": 2},
        "trainer": {"n_gpus_per_node": 2}}))
    cfg = load_config(str(path), BASE)
    assert (cfg.actor.ppo_micro_batch_size, cfg.rollout.log_prob_micro_batch_size,
            cfg.critic.ppo_micro_batch_size_per_gpu) == (4, 8, 2)
    # ... and its global key given in the file is divided by the workers the command line names
    path.write_text(yaml.safe_dump({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size": 16}}}))
    assert load_config(str(path), BASE + ["trainer.n_gpus_per_node=4"]).actor.ppo_micro_batch_size == 4


@pytest.mark.parametrize("both", [
    ["actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
    ["actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor.ppo_micro_batch_size=4"],
    ["actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"],
    ["actor_rollout_ref.ref.log_prob_micro_batch_size=8", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"],
    ["critic.ppo_micro_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=4"],
    ["critic.forward_micro_batch_size=8", "critic.forward_micro_batch_size_per_gpu=4"],
    ["reward_model.micro_batch_size=8", "reward_model.micro_batch_size_per_gpu=4"],
])
def test_a_global_and_a_per_worker_size_both_set_are_refused_as_verl_refuses_them(both):
    msg = error(["trainer.n_gpus_per_node=2", *both])
    assert f"{both[0]} (" in msg and "verl's deprecated global micro-batch" in msg
    assert "=4" in msg and "are both set; keep one (verl refuses both too)" in msg


def test_both_set_in_different_layers_is_refused_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size": 16}}}))
    msg = error(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], str(path))
    assert "actor_rollout_ref.actor.ppo_micro_batch_size=16 (actor.ppo_micro_batch_size_global)" in msg
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 (actor.ppo_micro_batch_size)" in msg


def test_less_than_one_per_worker_is_refused_naming_the_keys_and_the_fix():
    msg = error(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=1"])
    assert msg == ("actor_rollout_ref.actor.ppo_micro_batch_size=1 (actor.ppo_micro_batch_size_global) is verl's "
                   "global micro-batch over all workers: divided by the 2 data-parallel workers (trainer.nnodes=1 x "
                   "trainer.n_gpus_per_node=2) it is 0 per worker; give at least 2, or a per-worker size: "
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (actor.ppo_micro_batch_size)")
    # 8 workers in Ulysses pairs: 3 // 4 = 0
    pairs = ["trainer.nnodes=2", "trainer.n_gpus_per_node=4",
             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    msg = error([*pairs, "critic.forward_micro_batch_size=3"])
    assert ("critic.forward_micro_batch_size=3 (critic.forward_micro_batch_size_global) is verl's global micro-batch "
            "over all workers: divided by the 4 data-parallel workers (trainer.nnodes=2 x trainer.n_gpus_per_node=4 / "
            "actor.ulysses_sequence_parallel_size=2) it is 0 per worker; give at least 4, or a per-worker size: "
            "critic.forward_micro_batch_size_per_gpu") == msg
    # the reward model's: 7 // 8 = 0 (its workers are not in Ulysses groups)
    assert "divided by the 8 data-parallel workers (trainer.nnodes=2 x trainer.n_gpus_per_node=4) it is 0" in error(
        [*pairs, "reward_model.micro_batch_size=7"])


def test_help_config_says_how_a_global_size_is_divided():
    text = describe_keys()
    assert ("actor_rollout_ref.actor.ppo_micro_batch_size -> actor.ppo_micro_batch_size_global  [verl's global "
            "size: actor.ppo_micro_batch_size = it // (trainer.nnodes x trainer.n_gpus_per_node / the Ulysses "
            "size)]") in text
    assert ("critic.ppo_micro_batch_size -> critic.ppo_micro_batch_size_global  [verl's global size: "
            "critic.ppo_micro_batch_size_per_gpu = it // (trainer.nnodes x trainer.n_gpus_per_node / the Ulysses "
            "size)]") in text
    assert ("reward_model.micro_batch_size -> reward.model.micro_batch_size_global  [verl's global size: "
            "reward.model.micro_batch_size = it // (trainer.nnodes x trainer.n_gpus_per_node)]") in text
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu -> actor.ppo_micro_batch_size  [honoured]" in text
