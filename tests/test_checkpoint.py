"""Checkpoints: exact resume, kills mid-save, SIGTERM, corruption, retention, export."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from posttrain.driver.build import build_run
from posttrain.checkpoint import CheckpointWriter, list_checkpoints, take_snapshot
from posttrain.cli import main
from posttrain.config import load_config
from posttrain.errors import CheckpointError, ConfigError
from posttrain.driver.loop import train

from helpers import POSTTRAIN, comparable, read_metrics, resume_overrides


def run(args):
    return train(build_run(load_config(None, args)))


def final_weights(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "model.safetensors")


@pytest.mark.parametrize("stop_at", [3, 2])  # 2: the stop falls on an epoch boundary
def test_stop_and_resume_is_exact(tmp_path, data, tiny_model_dir, stop_at):
    run(resume_overrides(tiny_model_dir, data, tmp_path / "whole", 6, "trainer.save_freq=6"))
    run(resume_overrides(tiny_model_dir, data, tmp_path / "split", stop_at, f"trainer.save_freq={stop_at}"))
    summary = run(resume_overrides(tiny_model_dir, data, tmp_path / "split", 6, "trainer.save_freq=6"))
    assert summary["steps"] == 6 and "val_before" not in summary
    a, b = final_weights(tmp_path / "whole", 6), final_weights(tmp_path / "split", 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    whole, split = comparable(tmp_path / "whole"), comparable(tmp_path / "split")
    # The first half validated at its last step (every run does; at step 2 so did the whole run, test_freq=2);
    # otherwise the lines are the same.
    assert any(k.startswith("val/") for k in split[stop_at])
    if not any(k.startswith("val/") for k in whole[stop_at]):
        split[stop_at] = {k: v for k, v in split[stop_at].items() if not k.startswith("val/")}
    assert whole == split


def test_resume_refuses_another_config(tmp_path, data, tiny_model_dir):
    run(resume_overrides(tiny_model_dir, data, tmp_path / "r", 1, "trainer.save_freq=1"))
    with pytest.raises(ConfigError, match=r"actor.lr: 0.001 -> 0.002"):
        run(resume_overrides(tiny_model_dir, data, tmp_path / "r", 2, "actor.lr=2e-3"))
    with pytest.raises(ConfigError, match="already holds an earlier run"):
        run(resume_overrides(tiny_model_dir, data, tmp_path / "r", 2, "trainer.resume_mode=disable"))


def test_resume_compares_the_new_training_keys_and_tolerates_older_checkpoints(tmp_path):
    """algorithm.overlong_filtering and actor.* change training: they must match; trainer.max_epochs and
    trainer.val_at_end may change. A checkpoint written before a key existed (not in its config.yaml) resumes
    while the key is at its default."""
    import yaml

    from posttrain.checkpoint.resume import check_compatible
    from posttrain.config import config_to_dict

    def checkpoint(cfg: dict, drop=()):
        ckpt = tmp_path / f"ck{len(list(tmp_path.iterdir()))}"
        ckpt.mkdir()
        saved = json.loads(json.dumps(cfg))
        for key in drop:
            section, leaf = key.split(".")
            del saved[section][leaf]
        (ckpt / "config.yaml").write_text(yaml.safe_dump(saved))
        (ckpt / "trainer_state.json").write_text(json.dumps({"model_dir": "m"}))
        return ckpt

    base = config_to_dict(load_config())
    ck = checkpoint(base)
    check_compatible(ck, config_to_dict(load_config(None, ["trainer.max_epochs=3", "trainer.val_at_end=false"])), "m")
    for key, value in (("algorithm.overlong_filtering", "true"), ("actor.clip_ratio_c", "null"),
                       ("actor.lr_warmup_start_factor", "0.5"), ("algorithm.adv_estimator", "grpo_loo")):
        with pytest.raises(ConfigError, match=f"{key}: "):
            check_compatible(ck, config_to_dict(load_config(None, [f"{key}={value}"])), "m")
    older = checkpoint(base, drop=("algorithm.overlong_filtering", "actor.lr_warmup_start_factor"))
    check_compatible(older, base, "m")  # the keys at their defaults: what the older run did
    with pytest.raises(ConfigError, match="algorithm.overlong_filtering: None -> True"):
        check_compatible(older, config_to_dict(load_config(None, ["algorithm.overlong_filtering=true"])), "m")


def test_an_older_config_yaml_holding_verls_unused_keys_loads_and_resumes(tmp_path):
    """An older posttrain saved verl's unused keys (data.return_raw_chat, rollout.trace, ...), the ones it takes at
    one value only (actor.fsdp_size, ...), and its global sizes and fully asynchronous keys (null: already
    translated) in a run's config.yaml; they are verl's dialect's now: the
    file loads as --config, and the checkpoint holding it resumes unchanged."""
    import yaml

    from posttrain.checkpoint.resume import check_compatible
    from posttrain.config import config_to_dict, config_to_yaml

    cfg = load_config()
    older = yaml.safe_load(config_to_yaml(cfg))
    older["data"].update(return_raw_chat=False, gen_batch_size=None)
    older["trainer"]["use_legacy_worker_impl"] = "auto"
    older["rollout"].update(layered_summon=False, trace={})
    older["reward"]["model"].update(use_reward_loop=False, rollout={})
    older["async_training"].update(use_trainer_do_validate=False, checkpoint_engine={}, staleness_threshold=None,
                                   trigger_parameter_sync_step=None, total_rollout_prompts=None)
    older["actor"]["ppo_micro_batch_size_global"] = older["critic"]["forward_micro_batch_size_global"] = None
    # and the keys posttrain takes at one value only (as an older posttrain saved them: the null sizes filled in)
    older["data"]["custom_cls"] = {"path": None, "name": None}
    older["model"]["fused_kernel_options"] = {"impl_backend": None}
    older["actor"].update(strategy="fsdp2", fsdp_size=-1)
    older["actor"]["mixed_precision"]["buffer_dtype"] = "float32"
    older["ref"].update(strategy="fsdp2", fsdp_size=-1, ulysses_sequence_parallel_size=1)
    older["critic"]["model"]["fsdp_size"] = -1
    older["critic"]["ulysses_sequence_parallel_size"] = 1
    older["trainer"]["max_critic_ckpt_to_keep"] = None
    older["reward"]["reward_manager"] = "naive"
    older["reward"]["model"]["input_tokenizer"] = None
    ckpt = tmp_path / "global_step_1"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(yaml.safe_dump(older, sort_keys=False))
    (ckpt / "trainer_state.json").write_text(json.dumps({"model_dir": "m"}))
    assert config_to_dict(load_config(str(ckpt / "config.yaml"))) == config_to_dict(cfg)
    check_compatible(ckpt, config_to_dict(cfg), "m")
    older["model"]["use_shm"] = True  # set by the older run: unused then as now
    (ckpt / "config.yaml").write_text(yaml.safe_dump(older, sort_keys=False))
    with pytest.warns(UserWarning, match="^model.use_shm: verl's settings"):
        assert config_to_dict(load_config(str(ckpt / "config.yaml"))) == config_to_dict(cfg)
    check_compatible(ckpt, config_to_dict(cfg), "m")


def spawn(args, **env):
    return subprocess.Popen([POSTTRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})


def wait_for(predicate, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_sigkill_in_the_middle_of_a_save(tmp_path, data, tiny_model_dir):
    run_dir = tmp_path / "r"
    args = ["train", *resume_overrides(tiny_model_dir, data, run_dir, 3, "trainer.save_freq=1")]
    proc = spawn(args, POSTTRAIN_TEST_CHECKPOINT_DELAY_S="1.5")
    ckpts = run_dir / "checkpoints"
    wait_for(lambda: (ckpts / "global_step_1" / "manifest.json").exists() and list(ckpts.glob(".global_step_2.tmp-*")))
    proc.kill()
    proc.wait()
    assert not (ckpts / "global_step_2").exists()  # the half-written save never took the real name
    result = subprocess.run([POSTTRAIN, *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resuming from {ckpts / 'global_step_1'}" in result.stderr
    assert [i.step for i in list_checkpoints(run_dir) if i.valid] == [1, 2, 3]
    assert [x["step"] for x in read_metrics(run_dir)] == [0, 1, 2, 3]


def test_sigterm_saves_and_exits_75_then_resumes(tmp_path, data, tiny_model_dir):
    run_dir = tmp_path / "r"
    proc = spawn(["train", *resume_overrides(tiny_model_dir, data, run_dir, 500)])
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    saved = [i for i in list_checkpoints(run_dir) if i.valid]
    assert len(saved) == 1 and "run the same command again to resume" in err
    stopped_at = saved[0].step
    assert read_metrics(run_dir)[-1]["step"] == stopped_at
    result = subprocess.run([POSTTRAIN, "train", *resume_overrides(tiny_model_dir, data, run_dir, stopped_at + 2)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [x["step"] for x in read_metrics(run_dir)]
    assert steps[-3:] == [stopped_at, stopped_at + 1, stopped_at + 2]


def test_corrupt_checkpoints_are_never_loaded(tmp_path, data, tiny_model_dir, capsys):
    run_dir = tmp_path / "r"
    run(resume_overrides(tiny_model_dir, data, run_dir, 4, "trainer.save_freq=1"))
    ck = run_dir / "checkpoints"
    weights = ck / "global_step_4" / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])                       # truncated
    opt = ck / "global_step_3" / "optimizer.pt"
    raw = bytearray(opt.read_bytes())
    raw[-10] ^= 0xFF
    opt.write_bytes(bytes(raw))                                            # same size, bad checksum
    (ck / "global_step_2" / "manifest.json").unlink()                      # never finished
    infos = {i.step: i for i in list_checkpoints(run_dir)}
    assert "truncated" in infos[4].problem and "checksum" in infos[3].problem and "manifest" in infos[2].problem
    assert infos[1].valid
    assert main(["checkpoints", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("INVALID") == 3 and "valid" in out
    summary = run(resume_overrides(tiny_model_dir, data, run_dir, 5, "trainer.save_freq=1"))
    assert f"resuming from {ck / 'global_step_1'}" in capsys.readouterr().err and summary["steps"] == 5
    assert [i.step for i in list_checkpoints(run_dir) if i.valid] == [1, 2, 3, 4, 5]  # re-saved on the new timeline
    opt = ck / "global_step_5" / "optimizer.pt"
    raw = bytearray(opt.read_bytes())
    raw[-10] ^= 0xFF
    opt.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="global_step_5.*checksum"):
        run(resume_overrides(tiny_model_dir, data, run_dir, 6, f"trainer.resume_mode={ck / 'global_step_5'}"))


def test_retention_keeps_newest_and_best(tmp_path, data, tiny_model_dir):
    run_dir = tmp_path / "r"
    run(resume_overrides(tiny_model_dir, data, run_dir, 5, "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2",
                         "trainer.keep_top_k=1", "trainer.keep_top_k_metric=critic/score/mean"))
    infos = list_checkpoints(run_dir)
    scores = {i.step: i.metrics["critic/score/mean"] for i in infos}
    assert {4, 5} <= set(scores)
    best_kept = max(scores, key=lambda step: (scores[step], step))  # a tie: the newer step
    assert len(infos) == (2 if best_kept in (4, 5) else 3)


def fake_checkpoints(run_dir, metrics: dict, metric="val/score/mean", **retention):
    """Valid checkpoints global_step_<step> (a file and a manifest each) saved with `metric` = value (None: not
    saved with it), then pruned as after a save. -> the steps kept."""
    from posttrain.checkpoint.manifest import write_manifest

    for step, value in metrics.items():
        d = run_dir / "checkpoints" / f"global_step_{step}"
        d.mkdir(parents=True)
        (d / "rng.pt").write_bytes(b"x")
        write_manifest(d, step, {"training/global_step": float(step)} | ({} if value is None else {metric: value}))
    CheckpointWriter(run_dir, {}, "", async_save=False, metric=metric, **retention)._prune()
    return [i.step for i in list_checkpoints(run_dir) if i.valid]


def test_keep_top_k_ranks_unscored_checkpoints_last_and_ties_by_the_newer_step(tmp_path):
    from posttrain.checkpoint.writer import ranked

    # top-2 of {2: 0.5, 4: 0.7, 6: none}: 4 and 2; 6 stays as the newest
    assert fake_checkpoints(tmp_path / "a", {2: 0.5, 4: 0.7, 6: None}, keep_top_k=2) == [2, 4, 6]
    # ... and once 8 (none) is newer, 6 goes: unscored ones rank after every scored one
    assert fake_checkpoints(tmp_path / "b", {2: 0.5, 4: 0.7, 6: None, 8: None}, keep_top_k=2) == [2, 4, 8]
    # a tie keeps the newer step: {2: 0.7, 4: 0.7, 6: 0.5, 8: 0.1}, top 1 -> 4 (and 8, the newest)
    assert fake_checkpoints(tmp_path / "c", {2: 0.7, 4: 0.7, 6: 0.5, 8: 0.1}, keep_top_k=1) == [4, 8]
    # mode min: the lowest first, a tie the newer: {2: 0.1, 4: 0.1, 6: 0.3, 8: 0.9} top 2 -> 4, 2 (8 newest)
    assert fake_checkpoints(tmp_path / "d", {2: 0.1, 4: 0.1, 6: 0.3, 8: 0.9}, keep_top_k=2, mode="min") == [2, 4, 8]
    # fewer scored checkpoints than k: the newest unscored ones fill the rest (k = 3: 4 scored, then 8 and 6)
    assert fake_checkpoints(tmp_path / "e", {2: None, 4: 0.5, 6: None, 8: None, 10: None},
                            keep_top_k=3) == [4, 8, 10]
    # with max_to_keep too: the union (newest 2: 8, 10; best 1: 4)
    assert fake_checkpoints(tmp_path / "f", {2: 0.9, 4: 1.0, 6: 0.2, 8: None, 10: None},
                            keep_top_k=1, max_to_keep=2) == [4, 8, 10]
    # a NaN or non-numeric value counts as missing; the order itself, best first
    info = [i for i in list_checkpoints(tmp_path / "a")]
    assert [i.step for i in ranked(info, "val/score/mean", "max")] == [4, 2, 6]
    assert [i.step for i in ranked(info, "val/score/mean", "min")] == [2, 4, 6]
    assert fake_checkpoints(tmp_path / "g", {2: float("nan"), 4: "x", 6: 0.0, 8: 0.0}, keep_top_k=1) == [8]


def test_async_write_errors_surface(tmp_path, tiny_model_dir):
    from posttrain.models import load_model

    model = load_model(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    (tmp_path / "file").write_text("a file where the run directory should be")
    writer = CheckpointWriter(tmp_path / "file", {}, "", async_save=True)
    writer.save(take_snapshot(1, model, opt, sched, {}, {}, {}))  # returns at once
    with pytest.raises(CheckpointError, match="writing a checkpoint failed"):
        writer.wait()
    writer.wait()  # reported once


def test_export_loads_in_transformers_and_generates_the_same(tmp_path, data, trained_tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models import load_model
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine

    run_dir = tmp_path / "r"
    run(resume_overrides(trained_tiny_model_dir, data, run_dir, 2, "trainer.save_freq=2", "actor.lr=1e-4"))
    assert main(["export", str(run_dir), "--output", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.chat_template and (tmp_path / "hf" / "model.safetensors").exists()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{a}+{a + 7}="}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for a in (12, 35, 58, 81)]
    ours = HFRolloutEngine(load_model(run_dir / "checkpoints" / "global_step_2" / "actor"), [tok.eos_token_id],
                           tok.pad_token_id, progress=False).generate(prompts, SamplingParams(6, do_sample=False))
    for i, p in enumerate(prompts):
        hf = exported.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):]
        assert hf.tolist() == ours.response_ids[i][ours.response_mask[i].bool()].tolist()
    with pytest.raises(CheckpointError, match="not empty"):
        from posttrain.checkpoint.export import export_checkpoint

        export_checkpoint(run_dir, tmp_path / "hf")


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_run_directory_on_an_fsspec_file_system(tmp_path, data, tiny_model_dir, monkeypatch, scheme):
    import fsspec

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))  # the local staging area
    url = f"memory://bucket/{tmp_path.name}/run" if scheme == "memory" else f"file://{tmp_path / 'remote' / 'run'}"
    fs, root = fsspec.core.url_to_fs(url)
    run(resume_overrides(tiny_model_dir, data, url, 2, "trainer.save_freq=1", "trainer.max_ckpt_to_keep=1"))
    assert fs.exists(f"{root}/checkpoints/global_step_2/manifest.json")
    assert not fs.exists(f"{root}/checkpoints/global_step_1")   # pruned remotely too
    assert len(fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()) == 3
    # An upload cut short (no manifest) is never used: resume takes global_step_2.
    fs.makedirs(f"{root}/checkpoints/global_step_3/actor", exist_ok=True)
    fs.pipe_file(f"{root}/checkpoints/global_step_3/actor/model.safetensors", b"partial")
    summary = run(resume_overrides(tiny_model_dir, data, url, 3, "trainer.save_freq=1", "trainer.max_ckpt_to_keep=1"))
    assert summary["steps"] == 3
    assert fs.exists(f"{root}/checkpoints/global_step_3/manifest.json")
    steps = [json.loads(x)["step"] for x in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
    assert steps == [0, 1, 2, 3]


def test_a_run_killed_before_its_first_checkpoint_starts_afresh(tmp_path, data, tiny_model_dir, capsys):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / ".global_step_1.tmp-999" / "actor").mkdir(parents=True)  # a save cut short
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "val/score/mean": 0.5}\n{"step": 1, "critic/sco')
    summary = run(resume_overrides(tiny_model_dir, data, run_dir, 1))
    assert summary["steps"] == 1 and "val_before" in summary
    assert (run_dir / "metrics.discarded.jsonl").read_text().count("\n") == 2  # the old timeline, kept aside
    assert [x["step"] for x in read_metrics(run_dir)] == [0, 1]
    said = [line for line in capsys.readouterr().err.splitlines() if "no valid checkpoint" in line]
    assert said == [f"posttrain: warning: {run_dir} holds an earlier run's metrics (2 lines, step 0) but no valid "
                    f"checkpoint to resume from: starting over at step 0, the old metrics appended to "
                    f"{run_dir / 'metrics.discarded.jsonl'} (another trainer.experiment_name keeps runs apart)"]


def test_a_run_keeps_its_last_step_unless_told_not_to(tmp_path, data, tiny_model_dir, capsys):
    """No trainer.save_freq: the last step is saved (trainer.save_last); save_last=false saves nothing, and the
    next run in that directory says it starts over and keeps the old metrics aside."""
    kept = tmp_path / "kept"
    run(resume_overrides(tiny_model_dir, data, kept, 2))
    assert [(i.step, i.valid) for i in list_checkpoints(kept)] == [(2, True)]
    again = run(resume_overrides(tiny_model_dir, data, kept, 2))  # the same command: the run is finished
    assert again["steps"] == 2 and again["start_step"] == 2
    assert "is finished (step 2 of 2): nothing to train" in capsys.readouterr().err
    gone = tmp_path / "gone"
    run(resume_overrides(tiny_model_dir, data, gone, 2, "trainer.save_last=false"))
    assert list_checkpoints(gone) == [] and not (gone / "checkpoints").exists()
    first = (gone / "metrics.jsonl").read_text()
    capsys.readouterr()
    summary = run(resume_overrides(tiny_model_dir, data, gone, 2, "trainer.save_last=false"))
    assert (summary["start_step"], summary["steps"]) == (0, 2)
    assert (gone / "metrics.discarded.jsonl").read_text() == first  # the first run's metrics, all of them
    assert [x["step"] for x in read_metrics(gone)] == [0, 1, 2]
    err = [line for line in capsys.readouterr().err.splitlines() if "no valid checkpoint" in line]
    assert len(err) == 1 and "metrics (3 lines, steps 0-2)" in err[0], err
