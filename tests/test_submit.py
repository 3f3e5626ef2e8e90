"""`posttrain submit`: argument plumbing, and real jobs on the session's local Ray cluster."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from posttrain.cli import main
from posttrain.distributed import jobs
from posttrain.errors import ConfigError
from posttrain.files.cache import cache_root

from helpers import read_metrics

pytestmark = pytest.mark.ray


# --- plumbing, no cluster ---------------------------------------------------------------------

def test_runtime_env_file_then_command_line(tmp_path):
    (tmp_path / "wd").mkdir()
    (tmp_path / "env.yaml").write_text("working_dir: elsewhere\npip: [numpy]\nenv_vars: {A: 1, B: file}\n")
    env = jobs.build_runtime_env(str(tmp_path / "env.yaml"), str(tmp_path / "wd"), ["B=cli", "C=x=y"])
    assert env == {"working_dir": str(tmp_path / "wd"), "pip": ["numpy"],
                   "env_vars": {"A": "1", "B": "cli", "C": "x=y", "RAY_JOB_STOP_WAIT_TIME_S": "120"}}


def test_runtime_env_json_and_defaults(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "5"}}))
    assert jobs.build_runtime_env(str(tmp_path / "env.json"), None, []) == {
        "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "5"}}
    assert jobs.build_runtime_env(None, None, []) == {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}}


def test_runtime_env_must_be_a_mapping(tmp_path):
    (tmp_path / "env.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        jobs.build_runtime_env(str(tmp_path / "env.yaml"), None, [])
    with pytest.raises(ConfigError, match="cannot read"):
        jobs.build_runtime_env(str(tmp_path / "missing.yaml"), None, [])


def test_entrypoint_is_shell_quoted():
    assert jobs.entrypoint(["train", "c.yaml", "trainer.experiment_name=my run"]) == \
        "posttrain train c.yaml 'trainer.experiment_name=my run'"
    assert jobs.entrypoint(["posttrain", "train"]) == "posttrain train"


@pytest.mark.parametrize("given, expected", [
    ("127.0.0.1:8265", "http://127.0.0.1:8265"),
    ("http://head:8265/", "http://head:8265"),
    ("https://head.example", "https://head.example"),
])
def test_address_normalised(given, expected, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert jobs.resolve_address(given) == expected


def test_address_from_ray_address_only_when_http(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert jobs.resolve_address(None) == "http://head:8265"
    assert jobs.resolve_address("other:8265") == "http://other:8265"
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # the cluster's own port, not the Jobs API
    with pytest.raises(ConfigError, match="pass --address http://HEAD:8265"):
        jobs.resolve_address(None)
    with pytest.raises(ConfigError, match="head's dashboard"):
        jobs.resolve_address("ray://head:10001")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["--", "train"], "no Ray cluster given: pass --address http://HEAD:8265 (the head's dashboard) or set RAY_ADDRESS"),
    (["--address", "127.0.0.1:1", "--env", "FOO", "--", "train"], "--env FOO: expected KEY=VALUE"),
    (["--address", "127.0.0.1:1", "--working-dir", "/no/such/dir", "--", "train"],
     "--working-dir /no/such/dir: no such directory"),
    (["--address", "127.0.0.1:1"], "nothing to run: put the posttrain command after --"),
    (["--address", "127.0.0.1:1", "--follow"], "--follow goes with --logs JOB_ID"),
])
def test_errors_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["submit", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_unreachable_address_names_it(capsys):
    address = f"http://127.0.0.1:{_free_port()}"
    assert main(["submit", "--address", address, "--", "train"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"cannot reach the Ray Jobs API at {address}" in err and "8265" in err and "ssh -N -L 8265:127.0.0.1:8265" in err


def test_token_authentication_asked_for(capsys, monkeypatch):
    import ray.exceptions
    import ray.job_submission

    def refuse(address):
        raise ray.exceptions.AuthenticationError("Authentication required: Unauthorized")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", refuse)
    assert main(["submit", "--address", "127.0.0.1:1", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "requires token authentication: set RAY_AUTH_MODE=token" in err


def test_ray_not_installed(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.job_submission", None)  # import fails as if absent
    assert main(["submit", "--address", "127.0.0.1:1", "--list"]) == 2
    assert "pip install 'posttrain[ray]'" in capsys.readouterr().err


# --- real jobs on the local cluster -----------------------------------------------------------
# Through `python -m posttrain` in a child process: the exit status is the one a shell sees, and
# RAY_AUTH_MODE (below) is read by Ray once per process.

@pytest.fixture(scope="module")
def cluster_env(ray_cluster):
    """The environment for a client of the fixture cluster. Should it run with token authentication
    (`ray start` turns it on when ~/.ray/auth_token exists), the client has to ask for it."""
    import urllib.error
    import urllib.request

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        urllib.request.urlopen(f"{ray_cluster['dashboard']}/api/version", timeout=10).close()
    except urllib.error.HTTPError as e:
        assert e.code == 401, e
        env["RAY_AUTH_MODE"] = "token"  # read once per process by Ray: one more reason for child processes
    return env


def posttrain(env, *args, timeout=240):
    """`posttrain ARGS` -> (exit status, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "posttrain", *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def train_args(model_dir, run_dir, steps=2):
    return ["train", f"model.path={model_dir}", f"trainer.total_training_steps={steps}", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "rollout.n=2", "data.val_max_samples=8",
            "trainer.device=cpu", "trainer.n_gpus_per_node=2", f"trainer.run_dir={run_dir}", "trainer.save_last=false"]


def submit_args(ray_cluster):
    return ["submit", "--address", ray_cluster["dashboard"], "--env", f"POSTTRAIN_CACHE={cache_root()}"]


def job_id_in(err):
    return re.search(r"posttrain: submitted job (\S+) to ", err).group(1)


@pytest.mark.timeout(300)
def test_submit_trains_and_returns_the_jobs_status(ray_cluster, cluster_env, tiny_model_dir, tmp_path):
    rc, out, err = posttrain(cluster_env, *submit_args(ray_cluster), "--",
                             *train_args(tiny_model_dir, tmp_path / "run"))
    assert rc == 0, out + err
    assert re.search(r"^done: ", out, re.M), out  # the job's summary line, streamed
    job_id = job_id_in(err)
    assert f"posttrain: job {job_id} SUCCEEDED" in err
    assert (tmp_path / "run" / "metrics.jsonl").is_file()

    address = ["submit", "--address", ray_cluster["dashboard"]]
    rc, out, err = posttrain(cluster_env, *address, "--status", job_id)
    assert rc == 0 and f"job {job_id} SUCCEEDED" in out, out + err
    rc, out, err = posttrain(cluster_env, *address, "--logs", job_id)
    assert rc == 0 and re.search(r"^done: ", out, re.M), out + err
    rc, out, err = posttrain(cluster_env, *address, "--list")
    assert rc == 0 and re.search(rf"^{job_id}  SUCCEEDED  posttrain train model.path=", out, re.M), out + err


@pytest.mark.timeout(300)
def test_failed_job_returns_the_drivers_exit_code(ray_cluster, cluster_env):
    rc, out, err = posttrain(cluster_env, *submit_args(ray_cluster), "--no-wait", "--", "train", "not_a_key=2")
    assert rc == 0 and out == f"{job_id_in(err)}\n", out + err  # the id alone on stdout, at once
    no_wait_id = out.strip()

    rc, out, err = posttrain(cluster_env, *submit_args(ray_cluster), "--", "train", "not_a_key=1")
    assert rc == 2, out + err
    assert re.search(r"^posttrain: error: .*not_a_key", out, re.M), out  # the job's one-line error, streamed
    assert re.search(r"job \S+ FAILED \(Job entrypoint command failed with exit code 2\)", err), err

    rc, out, err = posttrain(cluster_env, "submit", "--address", ray_cluster["dashboard"], "--logs", no_wait_id,
                             "--follow")
    assert rc == 2 and "not_a_key" in out and f"job {no_wait_id} FAILED" in err, out + err


def test_unknown_job_id(ray_cluster, cluster_env):
    for action in ("--status", "--logs"):
        rc, out, err = posttrain(cluster_env, "submit", "--address", ray_cluster["dashboard"], action,
                                 "raysubmit_nosuchjob", *(["--follow"] if action == "--logs" else []))
        assert rc == 2 and err.count("\n") == 1 and "no job 'raysubmit_nosuchjob'" in err, out + err


@pytest.mark.timeout(300)
def test_ctrl_c_stops_following_and_stop_stops_the_job(ray_cluster, cluster_env, tiny_model_dir, tmp_path):
    log = tmp_path / "streamed.log"
    with open(log, "w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "posttrain", *submit_args(ray_cluster), "--",
             *train_args(tiny_model_dir, tmp_path / "run", steps=100_000)],
            stdout=stdout, stderr=subprocess.PIPE, text=True, env=cluster_env,
            # Ctrl-C at its default: a test run started in the background (`make test &`, nohup) ignores SIGINT,
            # and a child inherits that, so Python would install no KeyboardInterrupt handler
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        while not lines or "submitted job" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1], "".join(lines)  # EOF before the job was submitted
        job_id = job_id_in(lines[-1])
        deadline = time.monotonic() + 120
        while not re.search(r"^step 1/", log.read_text(), re.M):  # training, with its SIGTERM handler in place
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        # The job trains for 100000 steps: returning shows that following stopped without waiting for it
        # (measured: 1-3 s idle, about 10 s beside 4 busy processes; the limit guards against a hang)
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert f"--logs {job_id} --follow" in err and f"--stop {job_id}" in err, err

    address = ["submit", "--address", ray_cluster["dashboard"]]
    rc, out, err = posttrain(cluster_env, *address, "--status", job_id)
    assert rc == 0 and f"job {job_id} RUNNING" in out, out + err  # following stopped, the job did not
    rc, out, err = posttrain(cluster_env, *address, "--stop", job_id)
    assert rc == 0 and f"job {job_id} STOPPED" in out, out + err
    saved = list((tmp_path / "run" / "checkpoints").glob("global_step_*"))
    rc, logs, err = posttrain(cluster_env, *address, "--logs", job_id, "--follow")
    # the job's own words on a failure: what it did between the SIGTERM and its end
    assert saved, f"no checkpoint saved on --stop; the job's log ends:\n{logs[-3000:]}{err[-1000:]}"
    assert rc == 130 and re.search(r"^step 1/", logs, re.M), logs + err  # a stopped job's status



# --- a NeMo-RL user's job: its config layout, override keys and runtime-env JSON -----------------

def nemo_rl_job(tiny_model_dir, ckpt_dir, steps):
    """The seed's NeMo-RL command line, its model swapped for the tiny one, its sizes for this machine's,
    Megatron swapped for FSDP2 (and the learning rate FSDP2's optimizer needs, which the file leaves out)."""
    return ["train", "--config", "grpo_seed.yaml", f"policy.model_name={tiny_model_dir}",
            "policy.megatron_cfg.converter_type=Qwen2ForCausalLM", "policy.megatron_cfg.enabled=false",
            "policy.dtensor_cfg.enabled=true", "++policy.optimizer.kwargs.lr=1e-6",
            "logger.wandb_enabled=False", "cluster.num_nodes=1", "cluster.gpus_per_node=2",
            "logger.wandb.name=nemo-rl-grpo-test1", f"grpo.max_num_steps={steps}",
            "grpo.num_generations_per_prompt=4", "grpo.num_prompts_per_step=4", "policy.train_global_batch_size=16",
            "checkpointing.enabled=True", "checkpointing.save_period=2", "checkpointing.keep_top_k=2",
            "checkpointing.metric_name=null", f"checkpointing.checkpoint_dir={ckpt_dir}", "data.dataset_name=DeepScaler",
            "policy.max_total_sequence_length=160", "policy.generation.max_new_tokens=16", "trainer.device=cpu"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nemo_rl_job_with_a_runtime_env_json_saves_every_2_keeps_2_and_resumes(
        ray_cluster, cluster_env, tiny_model_dir, tmp_path):
    import shutil
    from pathlib import Path

    data = Path(__file__).parent / "data" / "nemo_rl"
    work = tmp_path / "nemo-rl"  # the job's working directory: its config files, as in a NeMo-RL checkout
    work.mkdir()
    for f in ("grpo_base.yaml", "grpo_seed.yaml"):
        shutil.copy(data / f, work / f)
    raw = tmp_path / "raw"  # DeepScaleR's layout: problem / answer / solution
    raw.mkdir()
    (raw / "deepscaler.json").write_text(json.dumps(
        [{"problem": f"What is {a} + {b}?", "answer": str(a + b), "solution": f"\\boxed{{{a + b}}}"}
         for a in range(1, 7) for b in range(1, 7)]))  # 36 prompts: 9 steps in grpo.max_num_epochs=1
    data_dir = tmp_path / "posttrain-data"
    assert main(["preprocess", "math", "--input", str(raw / "deepscaler.json"), "--split", "train",
                 "--output-dir", str(data_dir / "deepscaler")]) == 0
    runtime_env = tmp_path / "ray_runtime_env_nemo.json"
    runtime_env.write_text(json.dumps({"env_vars": {
        "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_notarealtoken", "WANDB_API_KEY": "notarealkey",
        "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "POSTTRAIN_DATA": str(data_dir)}}))
    ckpt = tmp_path / "nemo_rl_ckpt" / "nemo-rl-grpo-test1"
    submit = [*submit_args(ray_cluster), "--working-dir", str(work), "--runtime-env", str(runtime_env), "--"]

    rc, out, err = posttrain(cluster_env, *submit, *nemo_rl_job(tiny_model_dir, ckpt, 4), timeout=540)
    assert rc == 0, out + err
    assert "hf_notarealtoken" not in out + err
    assert sorted(p.name for p in (ckpt / "checkpoints").glob("global_step_*")) == ["global_step_2", "global_step_4"]
    steps = read_metrics(ckpt)
    assert [s["step"] for s in steps if "step" in s and "actor/pg_loss" in s] == [1, 2, 3, 4]
    import yaml

    saved = yaml.safe_load((ckpt / "checkpoints" / "global_step_4" / "config.yaml").read_text())
    assert saved["rollout"]["n"] == 4 and saved["data"]["train_batch_size"] == 4
    assert saved["actor"]["ppo_mini_batch_size"] == 16 // 4  # train_global_batch_size counts samples
    assert saved["algorithm"]["adv_estimator"] == "grpo_loo" and saved["trainer"]["max_ckpt_to_keep"] == 2
    assert saved["trainer"]["n_gpus_per_node"] == 2 and saved["actor"]["lr"] == 1e-6

    # the node is taken away; the same command with a larger step count resumes from step 4, keeps the newest 2
    rc, out, err = posttrain(cluster_env, *submit, *nemo_rl_job(tiny_model_dir, ckpt, 6), timeout=540)
    assert rc == 0, out + err
    assert sorted(p.name for p in (ckpt / "checkpoints").glob("global_step_*")) == ["global_step_4", "global_step_6"]
    steps = read_metrics(ckpt)
    assert [s["step"] for s in steps if "step" in s and "actor/pg_loss" in s] == [1, 2, 3, 4, 5, 6]
