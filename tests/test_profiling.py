"""Step profiling (runtime/profiling.py): verl's profiler keys load, and each tool captures exactly the listed steps."""

import json
import warnings

import pytest
import torch

from posttrain.driver.placement import make_profiler
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.runtime.profiling import StepProfiler, phase

NPU = ["global_profiler.tool=npu", "global_profiler.steps=[2,4]", "global_profiler.save_path=/home/u/profile_data",
       *[f"actor_rollout_ref.{role}.profiler.{key}" for role in ("actor", "ref") for key in (
           "enable=True", "ranks=[1,2]", "all_ranks=False", "tool_config.npu.discrete=True",
           "tool_config.npu.contents=[npu,cpu]", "tool_config.npu.level=level0", "tool_config.npu.analysis=True")]]
NSYS = ["global_profiler.tool=nsys", "global_profiler.steps=[1,2,5]", "global_profiler.profile_continuous_steps=True",
        "global_profiler.global_tool_config.nsys.discrete=True"]
CRITIC = ["critic.profiler.enable=True", "critic.profiler.ranks=[0,4]", "critic.profiler.all_ranks=False"]
TORCH_MEMORY = ["global_profiler.tool=torch_memory", "global_profiler.save_path=./mem_snapshots",
                "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000",
                "global_profiler.global_tool_config.torch_memory.stack_depth=32"]


def load(overrides):
    """-> (config, the warning lines its loading gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, overrides)
    return cfg, [str(w.message) for w in caught]


def test_verl_npu_keys_load_with_one_warning_naming_what_is_unused():
    cfg, warned = load(NPU)
    p = cfg.profiler
    assert (p.tool, p.steps, p.save_path) == ("npu", [2, 4], "/home/u/profile_data")
    assert p.actor.enable and p.actor.ranks == [1, 2] and p.actor.tool_config["npu"]["contents"] == ["npu", "cpu"]
    assert p.rollout.enable and p.rollout.ranks == [1, 2]  # verl: the rollout follows the actor
    assert not p.critic.enable and p.critic.ranks == []
    assert len(warned) == 1 and "torch's profiler" in warned[0]
    assert "profiler.actor.tool_config.npu.level" in warned[0] and "profiler.ref.tool_config.npu.analysis" in warned[0]
    assert "npu.discrete" not in warned[0] and "npu.contents" not in warned[0]  # read: a capture per phase


def test_verl_nsys_and_critic_keys_load_and_warn_once_without_cuda(tmp_path, capsys):
    cfg, warned = load(NSYS + CRITIC)
    p = cfg.profiler
    assert (p.tool, p.steps, p.continuous_steps, p.discrete) == ("nsys", [1, 2, 5], True, True)
    assert p.critic.enable and p.critic.ranks == [0, 4] and not p.critic.all_ranks
    assert warned == []
    profiler = make_profiler(cfg, tmp_path, "cpu", distributed=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not on CUDA" in err[0] and "nsys profile --capture-range=cudaProfilerApi" in err[0]
    ran = []
    with profiler.step(1), phase("values"):
        ran.append(1)
    assert ran == [1] and not profiler.enabled


def test_verl_torch_memory_keys_load_and_warn_once_without_cuda(tmp_path, capsys):
    cfg, warned = load(TORCH_MEMORY)
    tm = cfg.profiler.torch_memory
    assert (cfg.profiler.tool, cfg.profiler.save_path, tm.trace_alloc_max_entries, tm.stack_depth) == (
        "torch_memory", "./mem_snapshots", 100000, 32)
    assert warned == []
    make_profiler(cfg, tmp_path, "cpu", distributed=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA memory snapshots" in err[0]


def test_unknown_tool_and_keys_are_refused():
    with pytest.raises(ConfigError, match="profiler.tool=nvprof .* not one of: torch, nsys, torch_memory, npu"):
        load_config(None, ["global_profiler.tool=nvprof"])
    with pytest.raises(ConfigError, match="not supported yet"):
        load_config(None, ["global_profiler.frequency=3"])
    with pytest.raises(ConfigError, match="contents"):
        load_config(None, ["profiler.tool=torch", "profiler.actor.tool_config.torch.contents=[gpu]"])
    with pytest.raises(ConfigError, match="counted from 1"):
        load_config(None, ["profiler.steps=[0]"])


def fake_steps(profiler, steps=range(1, 6)):
    """Each step: a generation and an update phase (as loop.py's timed() blocks mark them), a little work in each."""
    x = torch.ones(8, 8)
    for n in steps:
        with profiler.step(n):
            with phase("gen"):
                x = x @ x / 8
            with phase("update_actor"):
                x = x + 1


def trace_names(path):
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_torch_tool_writes_a_trace_per_listed_step_with_its_phases(tmp_path):
    profiler = StepProfiler("torch", [2, 4], tmp_path, cuda=False)
    fake_steps(profiler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step2.json", "step4.json"]
    names = trace_names(tmp_path / "step4.json")
    assert {"step4", "gen", "update_actor"} <= names and "step2" not in names
    assert any("matmul" in str(n) or "mm" == n for n in names)  # the ops inside the phases are traced too


def test_continuous_steps_share_a_trace(tmp_path):
    profiler = StepProfiler("torch", [1, 2, 3, 5], tmp_path, continuous=True, cuda=False)
    fake_steps(profiler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step5.json", "steps1-3.json"]
    assert {"step1", "step2", "step3"} <= trace_names(tmp_path / "steps1-3.json")


def test_discrete_captures_only_the_enabled_roles_phases(tmp_path):
    profiler = StepProfiler("torch", [3], tmp_path, discrete=True, phases={"gen", "gen_max"}, cuda=False)
    fake_steps(profiler)
    assert [p.name for p in tmp_path.iterdir()] == ["step3_gen.json"]
    names = trace_names(tmp_path / "step3_gen.json")
    assert "gen" in names and "update_actor" not in names


def test_a_continuous_capture_the_run_stops_inside_is_written_on_close(tmp_path):
    profiler = StepProfiler("torch", [1, 2], tmp_path, continuous=True, cuda=False)
    fake_steps(profiler, [1])
    assert list(tmp_path.iterdir()) == []
    profiler.close()
    assert [p.name for p in tmp_path.iterdir()] == ["step1.json"]


def test_nsys_brackets_the_listed_steps_with_cuda_profiler_calls(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    fake_steps(StepProfiler("nsys", [2, 3, 5], tmp_path, continuous=True, cuda=True))
    assert calls == ["start", "step2", "gen", "pop", "update_actor", "pop", "pop",
                     "step3", "gen", "pop", "update_actor", "pop", "pop", "stop",
                     "start", "step5", "gen", "pop", "update_actor", "pop", "pop", "stop"]
    calls.clear()
    fake_steps(StepProfiler("nsys", [2], tmp_path, discrete=True, phases={"update_actor"}, cuda=True))
    assert calls == ["step2", "gen", "pop", "start", "update_actor", "pop", "stop", "pop"]


def test_torch_memory_records_and_dumps_a_snapshot_per_step(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("record", enabled, kw.get("max_entries"))))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    profiler = StepProfiler("torch_memory", None, tmp_path, memory_max_entries=1000, cuda=True)  # null: every step
    fake_steps(profiler, [1, 2])
    assert calls == [("record", "all", 1000), ("dump", str(tmp_path / "step1.pickle")), ("record", None, None),
                     ("record", "all", 1000), ("dump", str(tmp_path / "step2.pickle")), ("record", None, None)]


def test_a_short_run_writes_the_listed_steps_trace(tmp_path, tiny_model_dir):
    from posttrain.driver.build import build_run
    from posttrain.driver.loop import train

    from helpers import run_overrides, write_prompts

    write_prompts(tmp_path, 4)
    cfg = load_config(None, run_overrides(
        tiny_model_dir, tmp_path, tmp_path / "run", "data.train_batch_size=4", "data.max_response_length=4",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "rollout.n=2", "reward.num_workers=0",
        "trainer.total_training_steps=2", "trainer.device=cpu", "global_profiler.tool=torch",
        "global_profiler.steps=[2]", "actor_rollout_ref.actor.profiler.enable=True"))
    assert train(build_run(cfg))["steps"] == 2
    profile = tmp_path / "run" / "profile"
    assert [p.name for p in profile.iterdir()] == ["step2.json"]
    assert {"step2", "gen", "update_actor", "update_weights"} <= trace_names(profile / "step2.json")


def test_a_checkpoint_resumes_with_other_profiler_settings(tmp_path):
    """Resuming to profile a later step (or a checkpoint written before profiler.* existed) is no config change."""
    import yaml

    from posttrain.checkpoint.resume import check_compatible
    from posttrain.config import config_to_dict

    saved = config_to_dict(load_config(None, []))
    del saved["profiler"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"model_dir": "m"}))
    now = load_config(None, ["global_profiler.tool=torch", "global_profiler.steps=[7]",
                             "actor_rollout_ref.actor.profiler.enable=True"])
    check_compatible(tmp_path, config_to_dict(now), "m")
