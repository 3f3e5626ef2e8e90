"""The report's plots as plotly figures, for one run or overlaid for several.

Every builder returns None when none of the runs logged any of its metrics,
so that the page says "not logged" instead of drawing empty axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.colors import hex_to_rgb, qualitative

from posttrain.report.runs import Run, finite

COLORS = qualitative.Plotly
DASHES = ("solid", "dot", "dash", "dashdot")


@dataclass(frozen=True)
class LinePlot:
    title: str
    metrics: tuple[tuple[str, str], ...]  # (metric key, legend label)
    yaxis: str
    band: tuple[str, str] | None = None  # (min key, max key) shaded around the first metric
    tickformat: str | None = None


LINE_PLOTS = (
    LinePlot("Score", (("critic/score/mean", "train"), ("val/score/mean", "validation")), "mean score"),
    LinePlot("KL", (("actor/kl_loss", "kl_loss"), ("actor/ppo_kl", "ppo_kl")), "KL"),
    LinePlot("Entropy", (("actor/entropy", "entropy"),), "entropy (nats/token)"),
    LinePlot("Response length", (("response_length/mean", "mean"),), "tokens",
             band=("response_length/min", "response_length/max")),
    LinePlot("Throughput", (("perf/throughput", "throughput"),), "tokens/s per device"),
    LinePlot("MFU", (("perf/mfu/actor", "actor update"), ("perf/mfu/rollout", "rollout")), "MFU",
             tickformat=".1%"),
)
# drawn only in the runs that log them (no "not logged" note elsewhere): posttrain sft's, distillation's
OPTIONAL_PLOTS = (
    LinePlot("Loss", (("train/loss", "train"), ("val/loss", "validation")), "loss (nats/token)"),
    LinePlot("Distillation", (("distillation/reverse_kl", "reverse KL to the teacher"),), "KL (nats/token)"),
)
PHASES_TITLE = "Time per phase"
# The loop's phases in the order they run; any other timing_s/* key follows, sorted.
PHASE_ORDER = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
               "update_weights", "testing", "save_checkpoint")


def _layout(fig: go.Figure, xaxis: str, yaxis: str, **extra) -> go.Figure:
    fig.update_layout(template="plotly_white", margin={"l": 60, "r": 20, "t": 10, "b": 40}, xaxis_title=xaxis,
                      yaxis_title=yaxis, legend={"orientation": "h", "y": -0.2}, hovermode="x unified", **extra)
    if xaxis == "step" and max((max(t.x, default=0) for t in fig.data), default=0) <= 10:
        fig.update_xaxes(dtick=1)  # steps are whole: no "step 1.5" ticks on a short run
    return fig


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = hex_to_rgb(hex_color)
    return f"rgba({r},{g},{b},{alpha})"


def line_figure(plot: LinePlot, runs: list[Run]) -> go.Figure | None:
    """One trace per (run, metric): one run is coloured by metric; several
    runs by run, the metrics told apart by dash."""
    keys = [k for k, _ in plot.metrics if any(r.has(k) for r in runs)]
    if not keys:
        return None
    fig = go.Figure()
    for ri, run in enumerate(runs):
        for key, label in plot.metrics:
            if key not in keys:
                continue
            ki = keys.index(key)
            color = COLORS[(ri if len(runs) > 1 else ki) % len(COLORS)]
            name = label if len(runs) == 1 else run.name if len(keys) == 1 else f"{run.name}: {label}"
            if plot.band and ki == 0:
                _add_band(fig, run, plot.band, color, "min-max" if len(runs) == 1 else f"{run.name} min-max")
            x, y = run.series(key)
            fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines+markers",
                                     line={"color": color, "dash": DASHES[ki % len(DASHES)] if len(runs) > 1
                                               else "solid"}))
    return _layout(fig, "step", plot.yaxis, yaxis_tickformat=plot.tickformat)


def _add_band(fig: go.Figure, run: Run, band: tuple[str, str], color: str, name: str) -> None:
    """A shaded band from the min to the max of each step."""
    lo_key, hi_key = band
    if not (run.has(lo_key) and run.has(hi_key)):
        return
    rows = [r for r in run.steps if lo_key in r and hi_key in r]
    x = [r["step"] for r in rows]
    # the max line first, then the min line filled up to it ("tonexty")
    fig.add_trace(go.Scatter(x=x, y=[finite(r[hi_key]) for r in rows], mode="lines", line={"width": 0},
                             hoverinfo="skip", showlegend=False, legendgroup=name))
    fig.add_trace(go.Scatter(x=x, y=[finite(r[lo_key]) for r in rows], mode="lines", line={"width": 0},
                             fill="tonexty", fillcolor=_rgba(color, 0.18), name=name,
                             hoverinfo="skip", legendgroup=name))


def phases(runs: list[Run]) -> list[str]:
    """The timing_s/* phases (without the prefix) that any run logged, `step` (the total) left out."""
    seen = {k[len("timing_s/"):] for r in runs for s in r.steps for k in s
            if k.startswith("timing_s/") and k != "timing_s/step"}
    return [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))


def phase_figure(run: Run) -> go.Figure | None:
    """Seconds per phase, stacked per step, with the step's own total as a line:
    the bars add up to about the line (the step's timer also holds its validation and checkpoint)."""
    names = phases([run])
    if not names:
        return None
    fig = go.Figure()
    for i, phase in enumerate(names):
        x, y = run.series(f"timing_s/{phase}")
        fig.add_trace(go.Bar(x=x, y=y, name=phase, marker_color=COLORS[i % len(COLORS)]))
    if run.has("timing_s/step"):
        x, y = run.series("timing_s/step")
        fig.add_trace(go.Scatter(x=x, y=y, name="step (total)", mode="lines+markers",
                                 line={"color": "black", "width": 1.5}))
    return _layout(fig, "step", "seconds", barmode="stack")


def mean_phase_seconds(run: Run, names: list[str]) -> list[float]:
    """Mean seconds per training step of each phase (and of `step` last); a
    phase a step did not run counts 0, so that validation every k steps shows its amortised cost."""
    rows = [s for s in run.steps if "timing_s/step" in s] or [
        s for s in run.steps if any(k.startswith("timing_s/") for k in s)]
    if not rows:
        return [0.0] * (len(names) + 1)
    return [sum(finite(s.get(f"timing_s/{p}")) or 0.0 for s in rows) / len(rows) for p in [*names, "step"]]


def phase_compare_figure(runs: list[Run]) -> go.Figure | None:
    """Mean seconds per training step, per phase, one bar per run."""
    names = phases(runs)
    if not names:
        return None
    fig = go.Figure()
    for i, run in enumerate(runs):
        fig.add_trace(go.Bar(x=[*names, "step (total)"], y=mean_phase_seconds(run, names), name=run.name,
                             marker_color=COLORS[i % len(COLORS)]))
    return _layout(fig, "phase", "mean seconds per training step", barmode="group")


def figures(runs: list[Run]) -> list[tuple[str, go.Figure | None, str]]:
    """[(title, figure or None, the metrics it draws)] in page order."""
    out = [(p.title, line_figure(p, runs), ", ".join(k for k, _ in p.metrics)) for p in LINE_PLOTS]
    phase = phase_figure(runs[0]) if len(runs) == 1 else phase_compare_figure(runs)
    out.insert(4, (PHASES_TITLE, phase, "timing_s/*"))
    extra = [(p.title, fig, ", ".join(k for k, _ in p.metrics)) for p in OPTIONAL_PLOTS
             if (fig := line_figure(p, runs)) is not None]
    return extra + out
