"""One self-contained HTML page: plotly.js inlined once in <head>, every
figure a div that uses it, CSS inline; nothing is fetched when it is viewed.
Every text that comes from a run (names, config, prompts, responses) is escaped;
the config is shown with credentials redacted (runs.read_config).
"""

from __future__ import annotations

import json
from datetime import datetime
from html import escape

import plotly.io as pio
from plotly.offline import get_plotlyjs

from posttrain.report.plots import figures
from posttrain.report.runs import MISSING, Run, differing_config

MAX_SAMPLE_ROWS = 200
SAMPLE_COLUMNS = ("step", "which", "group", "data_source", "score", "reward", "advantage", "response_length",
                  "ground_truth", "prompt", "response")
TEXT_COLUMNS = {"ground_truth", "prompt", "response", "turns"}
# no "Produced with Plotly" link (the page links nowhere); the modebar's PNG download works offline
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1500px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; margin: 0.4em 0; }
.meta { color: #555; margin: 0.2em 0; } .warn { color: #a15c00; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1em; }
.plot { border: 1px solid #e3e3e3; border-radius: 6px; padding: 0.5em; }
.plot-body { height: 330px; }
.absent { color: #888; font-style: italic; height: 330px; display: flex; align-items: center;
          justify-content: center; text-align: center; background: #fafafa; }
table { border-collapse: collapse; font-size: 0.9em; width: 100%; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.5em; vertical-align: top; text-align: left; }
th { background: #f3f3f3; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; max-width: 40em; word-break: break-word; }
tr.best td { background: #f3faf3; } tr.worst td { background: #fcf3f3; }
pre.config { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 0.85em; }
"""


# Each figure is drawn while the page is still being parsed, at its card's width then; plotly
# follows window resizes only, so once everything is laid out each one is fitted to its card.
FIT_ON_LOAD = ('<script>window.addEventListener("load", () => '
               'document.querySelectorAll(".plotly-graph-div").forEach(d => Plotly.Plots.resize(d)));</script>')


def document(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"<style>{CSS}</style>\n<script>{get_plotlyjs()}</script>\n</head>\n<body>\n{body}\n{FIT_ON_LOAD}\n"
            "</body>\n</html>\n")


def plots_section(runs: list[Run]) -> str:
    absent = "this run" if len(runs) == 1 else "any of these runs"
    cards = []
    for i, (title, fig, metrics) in enumerate(figures(runs)):
        if fig is None:
            inner = f'<div class="absent">not logged in {absent} ({escape(metrics)})</div>'
        else:
            inner = '<div class="plot-body">' + pio.to_html(
                fig, include_plotlyjs=False, full_html=False, config=PLOTLY_CONFIG, div_id=f"plot-{i}",
                default_height="100%") + "</div>"
        cards.append(f'<div class="plot"><h3>{escape(title)}</h3>{inner}</div>')
    return '<h2>Metrics</h2>\n<div class="plots">\n' + "\n".join(cards) + "\n</div>"


def progress(run: Run) -> str:
    """'last step 3 of 10 (trainer.total_training_steps in config.yaml)'."""
    if run.last_step is None:
        return "no step logged yet"
    if run.config_text is None:
        return f"last step {run.last_step} (no config.yaml, so the planned total is unknown)"
    if run.total_steps is None:
        return f"last step {run.last_step} (trainer.total_training_steps is not set in config.yaml)"
    return f"last step {run.last_step} of {run.total_steps} (trainer.total_training_steps in config.yaml)"


def updated(run: Run) -> str:
    return datetime.fromtimestamp(run.updated).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def latest(run: Run, key: str) -> tuple[int, float] | None:
    """(step, value) of the newest finite value of `key`."""
    steps, values = run.series(key)
    found = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None]
    return found[-1] if found else None


def skipped_note(count: int, file: str) -> str:
    if not count:
        return ""
    lines = "line that does not parse was" if count == 1 else "lines that do not parse were"
    return (f'<p class="meta warn">{file}: {count} {lines} skipped (a run still being written, or one that '
            "crashed, can end mid-line)</p>")


def header(run: Run) -> str:
    scores = []
    for key, label in (("critic/score/mean", "train score"), ("val/score/mean", "validation score"),
                       ("train/loss", "training loss"), ("val/loss", "validation loss")):
        found = latest(run, key)
        if found:
            scores.append(f"{label} {found[1]:.3f} (step {found[0]})")
    return (f"<h1>posttrain report: {escape(run.name)}</h1>\n"
            f'<p class="meta">{escape(str(run.path.resolve()))}</p>\n'
            f'<p class="meta"><b>{escape(progress(run))}</b>; metrics.jsonl last written {escape(updated(run))}</p>\n'
            + (f'<p class="meta">latest {escape(", ".join(scores))}</p>\n' if scores else "")
            + skipped_note(run.bad_metric_lines, "metrics.jsonl"))


def cell(column: str, value) -> str:
    if value is None:
        return "<td></td>"
    if isinstance(value, float):
        return f'<td class="num">{value:.3f}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value}</td>'
    css = "text" if column in TEXT_COLUMNS else ""
    return f'<td class="{css}">{escape(str(value))}</td>'


def samples_section(run: Run) -> str:
    head = "<h2>Sample completions</h2>\n"
    if not run.samples:
        why = ("samples.jsonl has no readable rows" if run.samples_present else
               "this run has no samples.jsonl (trainer.log_samples_freq turns it on)")
        return head + f'<p class="meta">No samples: {why}.</p>' + skipped_note(run.bad_sample_lines, "samples.jsonl")
    # newest steps first; within a step, the order they were written (best before worst)
    rows = sorted(run.samples, key=lambda r: -r["step"] if isinstance(r.get("step"), int) else 0)
    shown = rows[:MAX_SAMPLE_ROWS]
    count = (f"the newest {len(shown)} of {len(rows)} rows" if len(rows) > len(shown) else f"{len(rows)} rows")
    columns = SAMPLE_COLUMNS + (("turns",) if any(r.get("turns") for r in shown) else ())  # multi-turn runs
    body = "".join(f'<tr class="{escape(str(r.get("which", "")))}">'
                   + "".join(cell(c, r.get(c)) for c in columns) + "</tr>\n" for r in shown)
    return (head + f'<p class="meta">{count}, newest step first</p>\n'
            + skipped_note(run.bad_sample_lines, "samples.jsonl")
            + "<table><thead><tr>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr></thead>\n<tbody>\n"
            + body + "</tbody></table>")


def config_section(run: Run) -> str:
    if run.config_text is None:
        return '<h2>Config</h2>\n<p class="meta">This run directory has no config.yaml.</p>'
    return f'<h2>Config</h2>\n<pre class="config">{escape(run.config_text)}</pre>'


def render_report(run: Run) -> str:
    body = "\n".join([header(run), plots_section([run]), samples_section(run), config_section(run)])
    return document(f"posttrain report: {run.name}", body)


def config_value(value) -> str:
    if value is MISSING:
        return "(absent)"
    return json.dumps(value) if isinstance(value, (list, bool, type(None))) else str(value)


def runs_table(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        val = latest(run, "val/score/mean")
        skipped = run.bad_metric_lines
        rows.append(f"<tr><td>{escape(run.name)}</td><td>{escape(str(run.path.resolve()))}</td>"
                    f"<td>{escape(progress(run))}</td><td>{escape(updated(run))}</td>"
                    f'<td class="num">{f"{val[1]:.3f} (step {val[0]})" if val else ""}</td>'
                    f'<td class="num">{skipped or ""}</td></tr>')
    return ("<table><thead><tr><th>run</th><th>directory</th><th>progress</th><th>metrics.jsonl last written</th>"
            "<th>latest validation score</th><th>unparseable lines skipped</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def config_diff_section(runs: list[Run]) -> str:
    head = "<h2>Config differences</h2>\n"
    no_config = [r.name for r in runs if r.config_text is None]
    note = (f'<p class="meta warn">No config.yaml in: {escape(", ".join(no_config))}.</p>\n' if no_config else "")
    diff = differing_config(runs)
    if not diff:
        return head + note + '<p class="meta">The runs\' config.yaml files hold the same values.</p>'
    rows = "".join(f'<tr><td class="text">{escape(key)}</td>'
                   + "".join(f'<td class="text">{escape(config_value(v))}</td>' for v in values) + "</tr>\n"
                   for key, values in diff)
    return (head + note + f'<p class="meta">{len(diff)} keys differ; every other key is the same.</p>\n'
            + "<table><thead><tr><th>key</th>" + "".join(f"<th>{escape(r.name)}</th>" for r in runs)
            + "</tr></thead><tbody>\n" + rows + "</tbody></table>")


def render_compare(runs: list[Run]) -> str:
    names = ", ".join(r.name for r in runs)
    body = "\n".join([f"<h1>posttrain compare: {escape(names)}</h1>", runs_table(runs), plots_section(runs),
                      config_diff_section(runs)])
    return document(f"posttrain compare: {names}", body)
