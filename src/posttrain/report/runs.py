"""Read a run directory (config.yaml, metrics.jsonl, samples.jsonl) for a report.

A run may still be writing, or may have crashed mid-line: a line that does not
parse is skipped and counted, never fatal. `metrics.discarded.jsonl` (the
timeline abandoned by a resume) is not read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from posttrain.config import flatten
from posttrain.errors import PosttrainError
from posttrain.text.redact import redact_mapping, redact_text

RUN_DIR_CONTENTS = "config.yaml and metrics.jsonl, often samples.jsonl and checkpoints/"


class ReportError(PosttrainError):
    """A run directory cannot be reported on."""


@dataclass
class Run:
    """One run directory, as read for a report."""

    name: str  # shown in titles and legends; unique among the runs of one page
    path: Path
    steps: list[dict]  # one merged record per step, ascending: {"step": N, metric: value | None}
    bad_metric_lines: int = 0
    config_text: str | None = None  # config.yaml verbatim but for credentials (read_config); None when absent
    config: dict = field(default_factory=dict)  # parsed and redacted; {} when absent or unreadable
    samples: list[dict] = field(default_factory=list)
    bad_sample_lines: int = 0
    samples_present: bool = False
    updated: float = 0.0  # mtime of metrics.jsonl (seconds since the epoch)

    @property
    def last_step(self) -> int | None:
        return self.steps[-1]["step"] if self.steps else None

    @property
    def total_steps(self):
        """trainer.total_training_steps from config.yaml, or None when unknown."""
        trainer = self.config.get("trainer")
        return trainer.get("total_training_steps") if isinstance(trainer, dict) else None

    def has(self, key: str) -> bool:
        return any(finite(r.get(key)) is not None for r in self.steps)

    def series(self, key: str) -> tuple[list[int], list[float | None]]:
        """(steps, values) of the steps that logged `key`; a null value stays None (a gap in a plot)."""
        rows = [r for r in self.steps if key in r]
        return [r["step"] for r in rows], [finite(r[key]) for r in rows]


def finite(v) -> float | None:
    """A plottable number, or None for null, NaN, inf and non-numbers."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """-> (the objects of the lines that parse, number of non-blank lines that do not)."""
    records, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(obj, dict):
                records.append(obj)
            else:
                bad += 1
    return records, bad


def merge_steps(records: list[dict]) -> tuple[list[dict], int]:
    """Records -> one dict per step, ascending. Lines of the same step are merged,
    later keys winning (a step logged twice, e.g. around a crash, shows its last values).
    -> (steps, number of records without an integer "step")."""
    by_step: dict[int, dict] = {}
    bad = 0
    for r in records:
        step = r.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            bad += 1
            continue
        by_step.setdefault(step, {}).update(r)
    return [by_step[s] for s in sorted(by_step)], bad


def load_run(path, name: str | None = None) -> Run:
    """Read a run directory; ReportError when it is missing or has no metrics.jsonl."""
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise ReportError(f"run directory '{path}' {what}; pass a run's trainer.run_dir, "
                          f"a directory holding {RUN_DIR_CONTENTS}")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"'{path}' has no metrics.jsonl, so it is not a run directory (one holds "
                          f"{RUN_DIR_CONTENTS}); pass the trainer.run_dir of a run that has begun")
    records, bad = read_jsonl(metrics)
    steps, no_step = merge_steps(records)
    run = Run(name=name or path.resolve().name, path=path, steps=steps, bad_metric_lines=bad + no_step,
              updated=metrics.stat().st_mtime)
    config = path / "config.yaml"
    if config.is_file():
        run.config_text, run.config = read_config(config)
    samples = path / "samples.jsonl"
    if samples.is_file():
        run.samples_present = True
        run.samples, run.bad_sample_lines = read_jsonl(samples)
    return run


def read_config(path: Path) -> tuple[str, dict]:
    """config.yaml -> (its text, parsed; {} when not a mapping), credentials redacted: a run
    directory written before posttrain redacted its config, or by hand, may hold some."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        parsed = None
    if not isinstance(parsed, dict):
        return redact_text(text), {}
    redacted = redact_mapping(parsed)
    if redacted != parsed:  # re-written, not patched: YAML may have folded a secret across lines
        text = yaml.safe_dump(redacted, sort_keys=False, allow_unicode=True)
    return text, redacted


def unique_names(paths) -> list[str]:
    """Each directory's own name; names that collide get their parent's name in front
    (`a/run`, `b/run`), then a number if they still collide."""
    paths = [Path(p).resolve() for p in paths]
    names = [p.name for p in paths]
    names = [f"{p.parent.name}/{p.name}" if names.count(n) > 1 else n for p, n in zip(paths, names, strict=True)]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if names.count(n) == 1 else f"{n} ({seen[n]})")
    return out


MISSING = object()  # a key one run's config.yaml does not have


def differing_config(runs: list[Run]) -> list[tuple[str, list]]:
    """The flattened config keys whose values are not the same in every run,
    in config order: [(key, [value per run, or MISSING])]."""
    flat = [flatten(r.config) for r in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    rows = []
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        if any(v is not values[0] and v != values[0] for v in values[1:]):
            rows.append((key, values))
    return rows
