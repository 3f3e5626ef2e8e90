"""Optional metric sinks: a few literal steps go in, and what TensorBoard, wandb
(offline) and MLflow (local SQLite) stored is read back with their own readers.
A failing sink warns once and the run goes on; a missing package or an unknown
logger name is a config error at start."""

import glob
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit

import pytest
import torch

from posttrain.metrics import sinks
from posttrain.errors import ConfigError
from posttrain.metrics.sinks import OPTIONAL_SINKS, make_sinks

from helpers import read_metrics
from listeners import non_loopback_listeners, process_tree

STEP1 = {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "timing_s/gen": 1.5, "actor/kl_loss": None,
         "response_length/mean": 3}
STEP2 = {"critic/score/mean": 0.75, "actor/pg_loss": float("nan"), "timing_s/gen": 1.25,
         "actor/entropy": torch.tensor(0.5)}  # a 0-d tensor left in by a caller
ROWS = [
    {"step": 2, "group": 0, "which": "best", "data_source": "arith", "prompt": "What is 2+3?", "response": "5",
     "ground_truth": "5", "score": 1.0, "reward": 1.0, "advantage": 0.7, "response_length": 1},
    {"step": 2, "group": 0, "which": "worst", "data_source": "arith", "prompt": "What is 2+3?",
     "response": "6 | or\nso", "ground_truth": "5", "score": 0.0, "reward": 0.0, "advantage": float("nan"),
     "response_length": 4},
]
CONFIG = {"trainer": {"project_name": "proj", "logger": ["console", "mlflow"], "total_training_steps": 2},
          "actor": {"optim": {"lr": 1e-6}}, "notes": "x" * 7000}


def log_two_steps(sink_list):
    for sink in sink_list:
        sink.log(STEP1, step=1)
        sink.log(STEP2, step=2)
        sink.log_samples(ROWS, step=2)


# --- TensorBoard ---------------------------------------------------------------------------------

def test_tensorboard_scalars_and_samples_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def events():
        acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        return acc

    [tb] = make_sinks(["console", "tensorboard"], tmp_path, "proj", "exp", CONFIG)
    tb.log(STEP1, step=1)
    # flushed at once: a crash after this line keeps step 1
    assert [(e.step, e.value) for e in events().Scalars("critic/score/mean")] == [(1, 0.25)]
    tb.log(STEP2, step=2)
    tb.log_samples(ROWS, step=2)
    tb.close()

    acc = events()
    assert {"critic/score/mean", "actor/pg_loss", "timing_s/gen", "response_length/mean"} <= set(acc.Tags()["scalars"])
    assert "actor/kl_loss" not in acc.Tags()["scalars"]  # None skipped
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("timing_s/gen")] == [(1, 1.5), (2, 1.25)]
    assert [(e.step, e.value) for e in acc.Scalars("actor/pg_loss")] == [(1, -0.5)]  # NaN at step 2 skipped
    assert [(e.step, e.value) for e in acc.Scalars("actor/entropy")] == [(2, 0.5)]
    [text] = acc.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2
    assert table.splitlines()[0].startswith("| step | group | which | data_source | prompt | response |")
    assert "| What is 2+3? | 5 | 5 | 1 | 1 | 0.7 | 1 |" in table
    assert "6 \\| or<br>so" in table  # a cell's pipe and newline cannot break the table


# --- Weights & Biases ------------------------------------------------------------------------------

def wandb_records(path):
    """The records of a `.wandb` file: wandb's LevelDB-style log (7-byte file header, 32 KiB
    blocks, records of crc32/length/type + payload, long ones split FIRST..LAST) of protobufs.
    wandb 0.31 keeps no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            break  # the end, or a record still being written
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


def wandb_history(run_dir, last_step=None, wait_s=30.0):
    """[(step, {key: value})] of every offline run saved under run_dir/wandb, oldest first.

    last_step: read again (up to wait_s) until the newest record is that step: wandb-core,
    a process of its own, can still be writing the file when `finish()` returns (seen
    rarely with wandb 0.31); what it writes then is what `wandb sync` uploads."""
    deadline = time.monotonic() + wait_s
    while True:
        history = _wandb_history(run_dir)
        if last_step is None or (history and history[-1][0] == last_step) or time.monotonic() > deadline:
            return history
        time.sleep(0.2)


def _wandb_history(run_dir):
    history = []
    def started(path):  # offline-run-<time>-<id>[-N]: a run started in the same second gets -N, sorted after
        parts = Path(path).parent.name.split("-")
        return parts[2], int(parts[4]) if len(parts) > 4 else 0

    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")), key=started):
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "history":
                items = {}
                for item in rec.history.item:  # a table's fields come as nested keys ["samples", "path"]
                    keys = [item.key] if item.key else list(item.nested_key)
                    node = items
                    for key in keys[:-1]:
                        node = node.setdefault(key, {})
                    node[keys[-1]] = json.loads(item.value_json)
                history.append((rec.history.step.num, items))
    return history


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb with no key, every directory it writes under tmp, and no WANDB_MODE: the sink
    itself must choose offline."""
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_RUN_ID",
                "WANDB_ERROR_REPORTING", "WANDB_DISABLE_WEAVE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("machine example.org login user password secret\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # a netrc with no wandb entry
    for var, sub in (("WANDB_DIR", "dir"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_DATA_DIR", "data")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    yield tmp_path
    wandb.teardown()  # the wandb-core service outlives finished runs until exit: not through the other tests


def test_wandb_offline_history_samples_and_resume(wandb_env, monkeypatch, capsys):
    run_dir = wandb_env / "run"
    pytest.importorskip("openai")  # an LLM client loaded (a reward may use one): wandb's Weave hint stays out too
    [wb] = make_sinks(["console", "wandb"], run_dir, "proj", "exp", CONFIG)
    err = capsys.readouterr().err
    assert "saved offline under" in err and "wandb sync" in err and len(err.strip().splitlines()) == 1, err
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"  # offline: no crash reports either
    assert os.environ["WANDB_DISABLE_WEAVE"] == "true"
    # wandb-core talks over a unix socket; checked with `ss` (iproute2) where there is one, always in CI
    if os.environ.get("CI") == "true" or (shutil.which("ss") and sys.platform == "linux"):
        assert non_loopback_listeners(process_tree()) == []
    log_two_steps([wb])
    wb.close()
    assert capsys.readouterr().err == ""  # silent: no wandb banner, summary or sync hint

    run_id = (run_dir / "wandb" / "run_id").read_text()
    [(s1, h1), (s2, h2)] = wandb_history(run_dir, last_step=2)
    assert (s1, h1["_step"], h1["critic/score/mean"], h1["timing_s/gen"], h1["response_length/mean"]) \
        == (1, 1, 0.25, 1.5, 3)
    assert "actor/kl_loss" not in h1  # None is not sent
    assert (s2, h2["_step"], h2["critic/score/mean"], h2["actor/entropy"]) == (2, 2, 0.75, 0.5)
    assert math.isnan(h2["actor/pg_loss"])  # NaN goes to wandb as is
    assert h2["samples"]["_type"] == "table-file" and h2["samples"]["nrows"] == 2
    [table_file] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "files" / h2["samples"]["path"]))
    table = json.loads(Path(table_file).read_text())
    assert table["columns"][:5] == ["step", "group", "which", "data_source", "prompt"]
    assert table["data"][0][5] == "5" and table["data"][1][5] == "6 | or\nso"

    # the same run directory again (a resumed training run): the same wandb run id, steps go on
    monkeypatch.setenv("WANDB_MODE", "offline")
    [wb] = make_sinks(["wandb"], run_dir, "proj", "exp", CONFIG)
    assert capsys.readouterr().err == ""  # WANDB_MODE chosen by the user: no note
    wb.log({"critic/score/mean": 1.0}, step=3)
    wb.close()
    assert (run_dir / "wandb" / "run_id").read_text() == run_id
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    # wandb adds "-1" to the second directory's name when both started within the same second
    assert len(runs) == 2 and all(re.search(rf"-{run_id}(-\d+)?$", r) for r in runs), runs
    assert [step for step, _ in wandb_history(run_dir, last_step=3)][-1] == 3


def test_wandb_mode_needs_a_key_to_go_online(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "absent"))
    assert sinks.wandb_mode() == ("offline", True)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert sinks.wandb_mode() == ("online", True)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # a key for another host does not count
    assert sinks.wandb_mode() == ("offline", True)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert sinks.wandb_mode() == ("online", True)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert sinks.wandb_mode() == ("disabled", False)


# --- MLflow ----------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # inside mlflow's store
def test_mlflow_metrics_params_samples_and_resume(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    [ml] = make_sinks(["mlflow"], tmp_path, "proj", "exp", CONFIG)
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"  # no usage reports to MLflow's servers
    log_two_steps([ml])
    ml.log({"val/arith(2+digit)/score/mean": 0.5}, step=2)  # '(' and '+' are not allowed in MLflow names
    ml.close()
    assert "warning" not in capsys.readouterr().err

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (tmp_path / "mlflow_run_id").read_text()
    run = client.get_run(run_id)
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"

    def history(key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    assert history("critic/score/mean") == [(1, 0.25), (2, 0.75)]
    assert history("timing_s/gen") == [(1, 1.5), (2, 1.25)]
    assert history("actor/pg_loss") == [(1, -0.5)]  # NaN skipped
    assert history("actor/kl_loss") == []  # None skipped
    assert history("actor/entropy") == [(2, 0.5)]
    assert history("val/arith_2_digit_/score/mean") == [(2, 0.5)]
    params = run.data.params
    assert params["trainer.total_training_steps"] == "2" and params["actor.optim.lr"] == "1e-06"
    assert json.loads(params["trainer.logger"]) == ["console", "mlflow"]
    assert len(params["notes"]) == 6000 and params["notes"].endswith("...")  # MLflow's value limit
    [artifact] = client.list_artifacts(run_id, "samples")
    assert artifact.path == "samples/step_2.json"
    artifacts = Path(urlsplit(run.info.artifact_uri).path)
    assert artifacts.is_relative_to(tmp_path / "mlartifacts")  # artifacts stay inside the run directory
    rows = json.loads((artifacts / artifact.path).read_text())
    assert rows[0] == ROWS[0] and rows[1]["advantage"] is None  # NaN is not JSON: null

    # the same run directory again: the same MLflow run, running again, steps go on
    [ml] = make_sinks(["mlflow"], tmp_path, "proj", "exp", {**CONFIG, "notes": "changed"})
    assert client.get_run(run_id).info.status == "RUNNING"
    ml.log({"critic/score/mean": 1.0}, step=3)
    ml.close()
    assert (tmp_path / "mlflow_run_id").read_text() == run_id
    assert history("critic/score/mean")[-1] == (3, 1.0)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert capsys.readouterr().err == ""


def test_mlflow_key_sanitising():
    assert sinks.mlflow_key("critic/score/mean") == "critic/score/mean"
    assert sinks.mlflow_key("perf/mfu@actor") == "perf/mfu_actor"
    assert sinks.mlflow_key("/a//b") == "_a__b"  # names must not change as a path
    assert sinks.mlflow_key("../x") == "___x"


# --- failures ------------------------------------------------------------------------------------

class Boom:
    """A sink whose log raises; counts the calls that reach it."""

    calls: ClassVar[list[str]] = []

    def __init__(self, *args):
        pass

    def log(self, metrics, step):
        Boom.calls.append("log")
        raise RuntimeError("disk full\nsecond line")

    def log_samples(self, rows, step):
        Boom.calls.append("log_samples")

    def close(self):
        Boom.calls.append("close")


def test_a_failing_sink_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sinks._MODULES, "tensorboard", ("json",))  # no tensorboard needed for this
    monkeypatch.setattr(sinks, "TensorBoardSink", Boom)
    Boom.calls = []
    [sink] = make_sinks(["tensorboard"], tmp_path, "proj", "exp", CONFIG)
    sink.log(STEP1, step=1)
    assert capsys.readouterr().err == ("posttrain: warning: the tensorboard logger failed (RuntimeError: disk full "
                                       "second line); the run continues without it\n")
    log_two_steps([sink])
    sink.close()
    assert Boom.calls == ["log"]  # nothing reaches it after its failure
    assert capsys.readouterr().err == ""


def test_a_sink_that_cannot_start_is_left_out_with_a_warning(tmp_path, monkeypatch, capsys):
    def refuse(*args):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sinks._MODULES, "wandb", ("json",))
    monkeypatch.setattr(sinks, "WandbSink", refuse)
    assert make_sinks(["console", "wandb"], tmp_path, "proj", "exp", CONFIG) == []
    assert capsys.readouterr().err == ("posttrain: warning: the wandb logger could not start (ConnectionError: "
                                       "no route to host); the run continues without it\n")


def test_a_missing_package_is_a_config_error_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails, as if not installed
    with pytest.raises(ConfigError) as err:
        make_sinks(["console", "tensorboard", "wandb"], tmp_path, "proj", "exp", CONFIG)
    assert str(err.value) == ("trainer.logger includes 'wandb' but the wandb package is not installed: "
                              "pip install 'posttrain[wandb]' (or remove 'wandb' from trainer.logger)")
    assert not (tmp_path / "tensorboard").exists()  # the tensorboard sink was not started either


def test_an_unknown_logger_names_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="trainer.logger 'wandbb' is not a known logger") as err:
        make_sinks(["console", "wandbb"], tmp_path, "proj", "exp", CONFIG)
    for name in ("console", "jsonl") + OPTIONAL_SINKS:
        assert name in str(err.value)


def test_console_and_jsonl_alone_make_no_sinks(tmp_path):
    assert make_sinks(["console", "jsonl"], tmp_path, "proj", "exp", CONFIG) == []
    assert list(tmp_path.iterdir()) == []


# --- a real short run through every logger -----------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_a_short_run_reaches_every_logger_with_its_steps(wandb_env, monkeypatch, trained_tiny_model_dir):
    """3 training steps with validation before, at step 2 and at the end: the same metric names and
    step numbers in metrics.jsonl, TensorBoard's event files, wandb's offline run and MLflow's store."""
    for package in ("tensorboard", "wandb", "mlflow", "sqlalchemy"):
        pytest.importorskip(package)
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from posttrain.driver.build import build_run
    from posttrain.config import load_config
    from posttrain.driver.loop import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = wandb_env / "run"
    train(build_run(load_config(None, [
        "trainer.total_training_steps=3", "trainer.test_freq=2", "data.val_max_samples=32",
        "trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]", f"trainer.run_dir={run_dir}"])))

    lines = read_metrics(run_dir)
    watched = ["critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean", "timing_s/gen",
               "timing_s/update_actor", "timing_s/step", "perf/throughput", "perf/mfu/actor", "perf/mfu/rollout"]
    jsonl = {k: [(x["step"], x[k]) for x in lines if x.get(k) is not None] for k in watched + ["val/score/mean"]}
    assert [s for s, _ in jsonl["val/score/mean"]] == [0, 2, 3]
    assert all([s for s, _ in jsonl[k]] == [1, 2, 3] for k in watched), {k: v for k, v in jsonl.items()}

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for key, points in jsonl.items():
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(key)] == points, key

    history = dict(wandb_history(run_dir, last_step=3))
    assert sorted(history) == [0, 1, 2, 3]
    for key, points in jsonl.items():
        assert [(s, history[s][key]) for s in sorted(history) if key in history[s]] == \
            [(s, pytest.approx(v, rel=1e-9)) for s, v in points], key
    assert "samples" in history[1]  # the first step's samples table

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text()
    for key, points in jsonl.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], key
    assert client.get_run(run_id).data.params["trainer.test_freq"] == "2"
