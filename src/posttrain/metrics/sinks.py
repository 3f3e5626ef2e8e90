"""Optional metric sinks: TensorBoard, Weights & Biases, MLflow.

`logger.py` writes `metrics.jsonl` and the console line itself; the sinks
here mirror each step's metrics (and a table of sample completions) into the
tools users already watch, picked by verl's `trainer.logger` names. A sink
never stops a run: the first exception it raises prints one warning and the
sink is dropped, because losing a dashboard is better than losing a training
run. A missing package is different: it is a config error at start, before
any compute is spent.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import netrc
import os
import posixpath
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from posttrain.config import LOGGERS, flatten
from posttrain.errors import ConfigError
from posttrain.text.redact import redact_mapping, redact_text

HANDLED_ELSEWHERE = ("console", "jsonl")  # logger.py writes these
OPTIONAL_SINKS = tuple(name for name in LOGGERS if name not in HANDLED_ELSEWHERE)

# the modules each sink imports; find_spec looks for them without importing
# (importing mlflow starts its telemetry client, importing wandb takes a second)
_MODULES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow",)}
# the default local MLflow store is SQLite, which full mlflow brings and mlflow-skinny does not
_MLFLOW_LOCAL_MODULES = ("sqlalchemy", "alembic")


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_samples(self, rows: list[dict], step: int) -> None: ...  # a table of sample completions

    def close(self) -> None: ...


def make_sinks(names: list[str], run_dir: Path, project_name: str, experiment_name: str,
               config: dict) -> list[Sink]:
    """The optional sinks named in `trainer.logger`, each wrapped so it cannot fail the run.

    Every package is checked before any sink starts, so a missing one fails
    fast without leaving a half-started wandb run behind.
    """
    wanted = check_sinks(names)
    run_dir = Path(run_dir)
    # wandb and MLflow keep (and upload) these: no credentials in them
    config = redact_mapping(config)
    project_name, experiment_name = redact_text(project_name), redact_text(experiment_name)
    starters = {
        "tensorboard": lambda: TensorBoardSink(run_dir / "tensorboard"),
        "wandb": lambda: WandbSink(run_dir, project_name, experiment_name, config),
        "mlflow": lambda: MlflowSink(run_dir, project_name, experiment_name, config),
    }
    sinks: list[Sink] = []
    for name in wanted:
        try:
            sinks.append(_Guarded(name, starters[name]()))
        except Exception as e:  # noqa: BLE001 (a dashboard that cannot start is not worth a failed run)
            _warn(f"the {name} logger could not start ({_brief(e)}); the run continues without it")
    return sinks


def check_sinks(names: list[str]) -> list[str]:
    """The optional sink names in `names`, once each, in order; ConfigError for an unknown
    name or a missing package. Cheap (imports nothing), so a CLI can call it while it
    validates the config, before any model is loaded."""
    wanted = []
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.logger '{name}' is not a known logger (valid: {', '.join(LOGGERS)})")
        if name in OPTIONAL_SINKS and name not in wanted:
            wanted.append(name)
    for name in wanted:
        _require(name)
    return wanted


def _require(name: str) -> None:
    modules = _MODULES[name]
    if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
        modules = modules + _MLFLOW_LOCAL_MODULES
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"trainer.logger includes '{name}' but the {' and '.join(missing)} package"
                          f"{'s are' if len(missing) > 1 else ' is'} not installed: pip install "
                          f"'posttrain[{name}]' (or remove '{name}' from trainer.logger)")


class _Guarded:
    """Forwards to a sink until its first exception, then warns once and drops it.

    The failed sink is not closed: a sink that has just failed may fail again
    or hang in close (a wandb run whose service died), and its own exit hooks
    release what they can.
    """

    def __init__(self, name: str, sink: Sink):
        self.name = name
        self.sink: Sink | None = sink

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._call("log", metrics, step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        self._call("log_samples", rows, step)

    def close(self) -> None:
        self._call("close")
        self.sink = None

    def _call(self, method: str, *args) -> None:
        if self.sink is None:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as e:  # noqa: BLE001 (whatever the library raises, the run goes on)
            self.sink = None
            _warn(f"the {self.name} logger failed ({_brief(e)}); the run continues without it")


def _warn(msg: str) -> None:
    # a library's exception may quote a tracking URI with its password, or an API key
    print(redact_text(f"posttrain: warning: {msg}"), file=sys.stderr)


def _brief(e: Exception) -> str:
    text = " ".join(str(e).split())  # one line, whatever the library put in it
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _finite(metrics: dict) -> dict[str, float]:
    """Only finite numbers: TensorBoard and MLflow have no use for None/NaN."""
    out = {}
    for key, value in metrics.items():
        if value is None or isinstance(value, (str, bytes)):
            continue
        try:
            x = float(value)  # also 0-d tensors and numpy scalars
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):
            out[key] = x
    return out


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for row in rows for k in row))  # first-seen order across rows


def _jsonable(value):
    """JSON has no NaN: a non-finite float becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (TensorBoard's text tab renders Markdown)."""

    def cell(v) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
        return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardSink:
    """Scalars and a Markdown sample table in `run_dir/tensorboard`."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in _finite(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crash must not lose the steps already logged

    def log_samples(self, rows: list[dict], step: int) -> None:
        self.writer.add_text("samples", markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode() -> tuple[str, bool]:
    """(mode, chosen here): WANDB_MODE if set; otherwise online only when credentials exist.

    Looks at the places wandb reads a key from, without asking any server.
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], False
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online", True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        found = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    return ("online" if found and found[2] else "offline"), True


class WandbSink:
    """One wandb run per run directory; a resumed run directory continues the same wandb run."""

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        mode, chosen = wandb_mode()
        if mode == "offline":
            # offline means nothing leaves the machine, crash reports included
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        # no Weave: wandb suggests its LLM-call tracing, in three lines past `silent`, whenever an LLM client
        # (openai, an agent library: a reward or an environment may import one) is loaded; set it to false to have it
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        import wandb

        id_file = Path(run_dir) / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        self.run = wandb.init(
            project=project_name, name=experiment_name, config=config, dir=str(run_dir), mode=mode,
            id=run_id, resume="allow",
            # silent: our console line is the progress report; console="off": no stdout/stderr
            # wrapping under tqdm (nor a copy of the console, errors with credentials in them included,
            # in output.log); create_new: never adopt or finish a run the user's own code holds.
            # No metadata (wandb-metadata.json: the command line, whose overrides may carry a URL
            # password), no git remote URL (it may embed a token), no copy of the code.
            settings=wandb.Settings(silent=True, console="off", reinit="create_new", x_disable_meta=True,
                                    disable_git=True, save_code=False),
        )
        id_file.write_text(self.run.id)
        if mode == "offline" and chosen:
            where = Path(run_dir) / "wandb"
            _note(f"no wandb API key (WANDB_API_KEY or `wandb login`): the wandb run is saved offline under "
                  f"{where}; upload it later with `wandb sync {where}/offline-run-*`")
        elif mode == "online" and getattr(self.run, "url", None):
            _note(f"wandb run: {self.run.url}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # NaN goes as is (wandb charts gaps); a 0-d tensor as its number, not as a histogram
        plain = {k: v.item() if getattr(v, "ndim", None) == 0 else v for k, v in metrics.items()}
        self.run.log({k: v for k, v in plain.items() if v is not None}, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        import wandb

        cols = _columns(rows)
        # mixed types: a column may hold a float in one row and None in the next
        table = wandb.Table(columns=cols, data=[[row.get(c) for c in cols] for row in rows],
                            allow_mixed_types=True)
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def _note(msg: str) -> None:
    print(redact_text(f"posttrain: {msg}"), file=sys.stderr)


_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- ]")  # what MLflow accepts in names (colon only off Windows)


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts: other characters become '_'.

    MLflow also refuses names that change under path normalisation
    ('a//b', '/a', '../a'), since it may store them as file paths.
    """
    key = _MLFLOW_BAD_CHARS.sub("_", key)[:250]
    if not key or posixpath.normpath(key) != key or key.startswith(("/", "..")):
        key = key.replace("/", "_").replace("..", "__") or "_"
    return key


def param_values(config: dict) -> dict[str, str]:
    """{'actor': {'lr': 1e-6}} -> {'actor.lr': '1e-06'}: MLflow params are strings; lists and dicts as JSON."""
    return {k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else str(v) for k, v in flatten(config).items()}


class MlflowSink:
    """An MLflow run through an explicit `MlflowClient` (no global active run, so two runs in
    one process do not clash). Local default: a SQLite store `run_dir/mlflow.db` with artifacts
    in `run_dir/mlartifacts`; MLFLOW_TRACKING_URI, when set, is used instead.

    MLflow 3.x refuses its old `./mlruns` file store unless MLFLOW_ALLOW_FILE_STORE=true and
    made SQLite its own default, so SQLite is what `mlflow ui` opens without extra settings:
    `mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`.
    """

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        # MLflow's usage telemetry reports to MLflow's servers from `import mlflow` on; a training
        # run talks to no server it was not pointed at (set it to false to opt back in)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            uri = f"sqlite:///{run_dir / 'mlflow.db'}"
            artifacts = (run_dir / "mlartifacts").as_uri()
        # a new SQLite store logs two INFO lines while it creates its tables: not news to a user
        db_log = logging.getLogger("mlflow.store.db.utils")
        level = db_log.level
        db_log.setLevel(logging.WARNING)
        try:
            self.client = MlflowClient(tracking_uri=uri)
        finally:
            db_log.setLevel(level)
        experiment = self.client.get_experiment_by_name(project_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(project_name, artifact_location=artifacts))
        id_file = run_dir / "mlflow_run_id"
        self.run_id = self._resume(id_file, experiment_id)
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=experiment_name).info.run_id
            self._log_params(config)  # params are write-once in MLflow: only for a new run
            id_file.write_text(self.run_id)

    def _resume(self, id_file: Path, experiment_id: str) -> str | None:
        if not id_file.exists():
            return None
        try:
            run = self.client.get_run(id_file.read_text().strip())
        except Exception:  # noqa: BLE001 (deleted, or another tracking server now: start a new run)
            return None
        if run.info.experiment_id != experiment_id:
            return None
        self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import (
                MAX_PARAM_VAL_LENGTH,
                MAX_PARAMS_TAGS_PER_BATCH,
            )
        except ImportError:  # private names: fall back to the oldest limits
            MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH = 500, 100
        params = []
        for key, value in param_values(config).items():
            if len(value) > MAX_PARAM_VAL_LENGTH:
                value = value[: MAX_PARAM_VAL_LENGTH - 3] + "..."
            params.append(Param(mlflow_key(key), value))
        params = list({p.key: p for p in params}.values())  # two keys sanitised alike: keep one
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in _finite(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow's per-request limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_samples(self, rows: list[dict], step: int) -> None:
        text = json.dumps(_jsonable(rows), indent=1, default=str)
        self.client.log_text(self.run_id, text, f"samples/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
