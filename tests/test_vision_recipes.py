"""verl's Qwen2.5-VL GRPO scripts and NeMo-RL's vlm_grpo_3B.yaml, as their users run them: every key loads
(translated, named unused, or refused in one line), and two GRPO steps run on the shipped tiny vision model (a
Qwen2.5-VL, `posttrain tiny-model --task vision`) with local rows in the recipes' layouts (verl's geo3k rows under $HOME/data/geo3k, NeMo-RL's clevr-cogent under
$POSTTRAIN_DATA), the CPU's engine (hf) in place of vLLM and the batch sizes scaled down by overrides after the
script's own, as `$@` would pass them.

verl's scripts: tests/data/verl/qwen2_5_vl_grpo_b178a3c.json (their arguments, from volcengine/verl at b178a3c);
NeMo-RL's files: tests/data/nemo_rl/examples_7ea279a.json (as test_nemo_rl_config.py reads them)."""

import functools
import io
import json
import math
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

from posttrain.config import load_config
from posttrain.data.preprocess import clevr, geo3k
from posttrain.data.schema import write_rows
from posttrain.errors import ConfigError
from posttrain.rewards import vlm

from helpers import read_metrics

Image = pytest.importorskip("PIL.Image")

DATA = Path(__file__).parent / "data"
VERL = DATA / "verl" / "qwen2_5_vl_grpo_b178a3c.json"
NEMO_RL = DATA / "nemo_rl" / "examples_7ea279a.json"


@functools.cache
def verl_scripts() -> dict:
    return json.loads(VERL.read_text())


def script_args(name: str, home: Path | str = "/home/u", engine: str = "vllm") -> list[str]:
    """A script's arguments as bash expands them: $HOME, and $ENGINE (its first argument, default vllm)."""
    return [a.replace("$HOME", str(home)).replace("$ENGINE", engine) for a in verl_scripts()["scripts"][name]]


def loaded(args) -> tuple[object, list[str]]:
    """load_config(None, args) -> (the config, its warnings' lines)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, args)
    return cfg, [str(w.message) for w in caught]


def png(seed: int, size=(56, 56)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def test_verls_scripts_are_stored_with_their_source():
    about, scripts = verl_scripts()["about"], verl_scripts()["scripts"]
    assert about["source"] == "https://github.com/volcengine/verl" and VERL.stem.endswith(about["commit"][:7])
    assert "Apache License, Version 2.0" in about["attribution"] and "Bytedance" in about["attribution"]
    assert sorted(scripts) == ["run_qwen2_5_vl-7b.sh", "run_qwen2_5_vl-7b_freeze_vision.sh",
                               "run_qwen2_5_vl-7b_lora.sh", "run_qwen2_5_vl-7b_seq_balance.sh",
                               "run_qwen2_5_vl_32b_npu.sh", "run_qwen2_5_vl_3b_npu.sh", "run_qwen2_5_vl_7b_npu.sh"]
    assert all("data.image_key=images" in args and "$@" not in args for args in scripts.values())


@pytest.mark.parametrize("name", sorted(json.loads(VERL.read_text())["scripts"]))
def test_verls_qwen2_5_vl_scripts_load_as_verl_means_them(name):
    """Each script's keys, as the script passes them (vLLM, verl's batch sizes): translated, or named unused in
    the run's one warning line (the NPU 3B script's worker switch)."""
    cfg, said = loaded(script_args(name))
    args = dict(a.lstrip("+").split("=", 1) for a in script_args(name))
    assert cfg.model.path == args["actor_rollout_ref.model.path"] and cfg.model.path.startswith("Qwen/Qwen2.5-VL-")
    assert (cfg.data.train_files, cfg.data.val_files) == (["/home/u/data/geo3k/train.parquet"],
                                                          ["/home/u/data/geo3k/test.parquet"])
    assert (cfg.data.image_key, cfg.data.truncation, cfg.data.filter_overlong_prompts) == ("images", "error", True)
    assert (cfg.rollout.name, cfg.rollout.n, cfg.algorithm.adv_estimator) == ("vllm", 5, "grpo")
    assert cfg.actor.use_kl_loss and (cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (0.01, "low_var_kl")
    assert cfg.ref.param_offload and cfg.model.enable_gradient_checkpointing and cfg.model.use_remove_padding
    # vLLM's former argument, in its current spelling (verl's conversion for vLLM >= 0.13)
    old = args.get("actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache")
    cache = {"mm_processor_cache_gb": 0} if old == "True" else {}
    assert cfg.rollout.engine_kwargs == {"vllm": cache}
    assert cfg.actor.freeze_vision_tower == name.endswith("freeze_vision.sh")
    if name.endswith("_lora.sh"):  # adapters on the language model: the vision tower left out by verl's pattern
        assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.exclude_modules) == (64, 32, ".*visual.*")
    if name.endswith("seq_balance.sh"):
        assert cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu == 6144
    unused = ["trainer.use_legacy_worker_impl: verl's settings"] if name == "run_qwen2_5_vl_3b_npu.sh" else []
    assert [w.split(" for what")[0] for w in said] == unused, said


def geo3k_rows(count: int, split: str) -> list[dict]:
    """verl's geo3k rows (examples/data_preprocess/geo3k.py's layout, as posttrain preprocess geo3k writes them):
    a `<image>` placeholder in the prompt, the image's PNG bytes, data_source hiyouga/geometry3k."""
    return [geo3k.make_row({"images": [{"bytes": png(i), "path": None}], "problem": f"<image>Find x if x = {i} + 1.",
                            "answer": str(i + 1)}, split, i) for i in range(count)]


# verl's batch sizes scaled down, after the script's own keys (as `$@` passes them), and where the run writes
SMALL_VERL = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
              "data.max_response_length=6", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
              "trainer.test_freq=2", "trainer.logger=console", "reward_model.num_workers=0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["run_qwen2_5_vl-7b.sh", "run_qwen2_5_vl-7b_lora.sh"])
def test_verls_qwen2_5_vl_script_runs_two_steps_on_the_tiny_vision_model(name, tmp_path):
    """The script with $HOME a folder holding geo3k rows, its model the tiny vision model, `hf` as its engine
    argument (the test environment has no vLLM; tests/test_vllm_vision.py runs that path), the sizes scaled
    down."""
    from posttrain.driver.build import build_run
    from posttrain.driver.loop import train
    from posttrain.models.shipped import vision_model

    home = tmp_path / "home"
    write_rows(geo3k_rows(4, "train"), home / "data" / "geo3k" / "train.parquet")
    write_rows(geo3k_rows(2, "test"), home / "data" / "geo3k" / "test.parquet")
    model = vision_model()
    run_dir = tmp_path / "run"
    args = [*script_args(name, home, engine="hf"), *SMALL_VERL, f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={run_dir}"]
    cfg, said = loaded(args)
    assert cfg.rollout.name == "hf" and cfg.model.path == str(model)
    assert any(w.startswith("rollout.engine_kwargs.vllm, rollout.enable_chunked_prefill") for w in said), said
    assert train(build_run(cfg))["steps"] == 2
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "actor/pg_loss" in m]
    # low_var_kl is >= 0 up to float32 rounding (-5e-9 seen where the adapters have not moved yet)
    assert len(steps) == 2 and all(math.isfinite(m["actor/pg_loss"]) and m["actor/kl_loss"] >= -1e-6 for m in steps)
    assert any("val/score/mean" in m for m in metrics)  # verl's geo3k reward, by the rows' data_source


# ---------------------------------------------------------------- NeMo-RL's vlm_grpo_3B.yaml


@functools.cache
def nemo_rl_configs() -> dict:
    return json.loads(NEMO_RL.read_text())["configs"]


def nemo_rl_file(tmp_path, name="vlm_grpo_3B.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(nemo_rl_configs()[name]))  # JSON is YAML
    return path


def test_nemo_rls_vlm_files_score_with_the_environment_their_data_names(tmp_path):
    """The environment data.*.env_name names scores every row: its reward_functions are reward.functions, its
    num_workers reward.num_workers; the file's other environments (geometry3k, refcoco) are not created, by NeMo-RL
    either. clevr-cogent's valA is its named test split; vLLM's processor cache setting reaches vLLM."""
    path = nemo_rl_file(tmp_path)
    cfg = load_config(str(path), [])
    assert cfg.reward.functions == {"format": 0.2, "exact_alnum": 0.8} and cfg.reward.num_workers == 8
    assert (cfg.data.dataset_name, cfg.data.val_dataset_name) == ("clevr-cogent", "clevr-cogent")
    assert cfg.data.prompt_file == "examples/prompts/clevr_cogent_cot.txt"
    assert cfg.rollout.engine_kwargs == {"vllm": {"mm_processor_cache_gb": 0}} and cfg.rollout.name == "vllm"
    assert (cfg.algorithm.adv_estimator, cfg.model.path) == ("grpo_loo", "Qwen/Qwen2.5-VL-3B-Instruct")
    geo = load_config(str(path), ["data.default.env_name=geometry3k", "data.train.dataset_name=geometry3k",
                                  "data.validation.dataset_name=geometry3k", "data.validation.split=test"])
    assert geo.reward.functions == {"format": 0.1, "math_expr": 0.9}
    ref = load_config(str(path), ["data.default.env_name=refcoco", "data.train.dataset_name=refcoco",
                                  "data.validation.dataset_name=refcoco", "data.validation.split=validation"])
    assert ref.reward.functions == {"format": 0.1, "bbox_giou": {"weight": 0.9, "kwargs": {"giou_penalty_thres": 0.5}}}
    # the file's functions and weights are the run's, not the built-in ones of the data_source
    own = load_config(str(path), ["env.clevr-cogent.reward_functions=[{name: exact_alnum, weight: 1}]"])
    assert own.reward.functions == {"exact_alnum": 1}
    images = load_config(str(path), ["++policy.generation.vllm_cfg.limit_mm_per_prompt.image=2"])
    assert images.rollout.engine_kwargs == {"vllm": {"mm_processor_cache_gb": 0, "limit_mm_per_prompt": {"image": 2}}}
    megatron = load_config(str(nemo_rl_file(tmp_path, "vlm_grpo_3B_megatron.yaml")),
                           ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"])
    assert megatron.reward.functions == cfg.reward.functions and megatron.actor.lr == 5e-7


@pytest.mark.parametrize("override, said", [
    ("data.validation.split=valB", r"^data\.validation\.split=valB .*clevr-cogent's is NeMo-RL's valA or test\)"),
    ("policy.dtensor_cfg.context_parallel_size=2", r"^policy\.dtensor_cfg\.context_parallel_size=2 .*context "
                                                   r"parallelism does not take images .*set it to 1"),
    ("++data.validation.env_name=geometry3k", r"^data\.train\.env_name=clevr-cogent and data\.validation\.env_name="
                                              r"geometry3k .*one reward"),
    ("env.clevr-cogent.reward_functions=[{name: iou, weight: 1}]", r"^env\.clevr-cogent\.reward_functions .*no VLM "
                                                                   r"reward function 'iou'"),
    ("env.clevr-cogent.reward_functions=[{name: format, weight: 0}]", r"^env\.clevr-cogent\.reward_functions .*no "
                                                                      r"weight"),
    ("++env.clevr-cogent.stop_strings=[</answer>]", r"^env\.clevr-cogent\.stop_strings=\['</answer>'\] .*set it to "
                                                    r"null"),
    ("++env.refcoco.cfg=1", r"'env\.refcoco\.cfg' .*VLM environment reads num_workers, reward_functions"),
    ("++policy.generation.vllm_cfg.limit_mm_per_prompt.video=1", r"^policy\.generation\.vllm_cfg\.limit_mm_per_"
                                                                 r"prompt\.video=1 .*video inputs are not supported"),
])
def test_what_a_vlm_file_cannot_do_is_refused_in_one_line(override, said, tmp_path):
    with pytest.raises(ConfigError, match=said) as e:
        load_config(str(nemo_rl_file(tmp_path)), [override])
    assert "\n" not in str(e.value)


def test_the_weighted_reward_is_nemo_rls_and_its_loader_pickles():
    """reward.functions' scorer: the weighted sum of rewards.vlm's functions, whatever the row's data_source (the
    built-in clevr-cogent reward when the weights are its own); the reward workers' loader pickles."""
    from posttrain.rewards.pool import RewardPool, reward_loader

    score = vlm.scorer({"format": 0.2, "exact_alnum": 0.8})
    for text in ("<think>3 cubes</think> <answer> 3 </answer>", "<answer>4</answer>", "3"):
        assert score("any", text, "3") == vlm.compute_score_clevr(text, "3")
    loader = reward_loader(None, None, {"format": 1, "bbox_giou": {"weight": 3, "kwargs": {"giou_penalty_thres": 0.5}}})
    pickle.dumps(loader)
    with RewardPool(loader, 0, timeout_s=5) as pool:
        result = pool.score_batch(["arith"], ["<answer>[0, 0, 2, 2]</answer>"], ["[0, 0, 2, 2]"], [{}])
    assert result.scores == [pytest.approx(0.25 * 0.75 + 0.75 * 1.0)]
    with pytest.raises(ConfigError, match=r"^reward\.functions and reward\.custom_fn=x\.py"):
        load_config(None, ["model.path=m", "reward.functions.format=1", "reward.custom_fn=x.py"])
    with pytest.raises(ConfigError, match=r"^reward\.functions: format: kwargs \{'x': 1\} do not fit it"):
        load_config(None, ["model.path=m", "reward.functions.format.weight=1", "reward.functions.format.kwargs.x=1"])


def clevr_rows(count: int, split: str) -> list[dict]:
    """NeMo-RL's clevr-cogent rows as `posttrain preprocess clevr` writes them (its prompt, the image first)."""
    return [clevr.make_row({"image": {"bytes": png(10 + i), "path": None}, "problem": f"How many cubes? ({i})",
                            "solution": f"<answer> {i % 3} </answer>"}, split, i) for i in range(count)]


@pytest.mark.slow
def test_nemo_rls_vlm_grpo_3B_runs_two_steps_on_the_tiny_vision_model(tmp_path, monkeypatch):
    """vlm_grpo_3B.yaml as its user runs it from a NeMo-RL checkout (its prompt file examples/prompts/
    clevr_cogent_cot.txt), the clevr-cogent named dataset under $POSTTRAIN_DATA, the tiny vision model as
    policy.model_name, hf generation, sizes scaled down: two steps scored by the file's reward functions, one
    reward worker (the weighted sum loaded there)."""
    from posttrain.driver.build import build_run
    from posttrain.driver.loop import train
    from posttrain.models.shipped import vision_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTRAIN_DATA", str(tmp_path / "data"))
    write_rows(clevr_rows(4, "train"), tmp_path / "data" / "clevr-cogent" / "train.parquet")
    write_rows(clevr_rows(2, "test"), tmp_path / "data" / "clevr-cogent" / "test.parquet")
    prompts = tmp_path / "examples" / "prompts"
    prompts.mkdir(parents=True)
    (prompts / "clevr_cogent_cot.txt").write_text(clevr.PROMPT)  # NeMo-RL's file's text
    model = vision_model()
    small = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=2",
             "grpo.val_period=2", "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
             "policy.logprob_batch_size=4", "policy.generation.max_new_tokens=6", "policy.generation.backend=hf",
             "policy.precision=float32", f"policy.model_name={model}", "checkpointing.enabled=false",
             f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=false", "reward.num_workers=1",
             "cluster.gpus_per_node=1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(str(nemo_rl_file(tmp_path)), small)
    assert any("rollout.engine_kwargs.vllm" in str(w.message) for w in caught)  # vLLM's setting, unused on hf
    assert cfg.reward.functions == {"format": 0.2, "exact_alnum": 0.8} and cfg.reward.num_workers == 1
    assert train(build_run(cfg))["steps"] == 2
    metrics = read_metrics(tmp_path / "logs")
    steps = [m for m in metrics if "critic/score/mean" in m]
    assert len(steps) == 2 and all(math.isfinite(m["actor/pg_loss"]) for m in steps)
    assert all("reward/format/mean" in m and "reward/exact_alnum/mean" in m for m in steps)
    assert any("val/score/mean" in m for m in metrics)
