"""`posttrain report` / `posttrain compare`: one self-contained HTML file per
call, every plot titled, run text escaped, a half-written metrics line
tolerated; and a real run's report renders in a real browser with no error
and no network request."""

import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import flatten
from posttrain.report import write_report
from posttrain.report.runs import differing_config, load_run, unique_names

TITLES = ["Score", "KL", "Entropy", "Response length", "Time per phase", "Throughput", "MFU"]
CONFIG = """\
actor:
  lr: 0.0001
  use_kl_loss: true
rollout:
  n: 8
trainer:
  total_training_steps: 10
  run_dir: {run_dir}
"""


def train_line(step, **extra):
    return {"step": step, "critic/score/mean": 0.1 * step, "actor/pg_loss": 0.01, "actor/kl_loss": 0.001 * step,
            "actor/entropy": 1.0 - 0.1 * step, "response_length/mean": 3.5, "response_length/min": 1.0,
            "response_length/max": 6.0, "timing_s/gen": 0.5, "timing_s/reward": 0.01, "timing_s/update_actor": 1.0,
            "timing_s/step": 1.6, "perf/throughput": 900.0 + step, "perf/mfu/actor": 0.012, **extra}


METRICS = [
    {"step": 0, "val/score/mean": 0.5, "timing_s/testing": 0.2},
    train_line(1),
    train_line(2, **{"val/score/mean": 0.6, "timing_s/testing": 0.2}),
    train_line(3, **{"actor/entropy": None}),  # a non-finite value is logged as null
]


def sample(step, which, response, group=0):
    return {"step": step, "group": group, "which": which, "data_source": "arith", "prompt": "2+3=",
            "response": response, "ground_truth": "5", "score": 1.0 if which == "best" else 0.0,
            "reward": 1.0, "advantage": 0.7, "response_length": 1}


def write_run(path: Path, metrics=METRICS, samples=None, config=CONFIG, tail="") -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + tail)
    if config is not None:
        (path / "config.yaml").write_text(config.format(run_dir=path))
    if samples is not None:
        (path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


class Page(HTMLParser):
    """The tags' attributes and the length of each <script>'s text."""

    def __init__(self, text: str):
        super().__init__()
        self.attrs: list[tuple[str, str, str]] = []
        self.scripts: list[int] = []
        self._in_script = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.attrs += [(tag, k, v or "") for k, v in attrs]
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append(0)

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += len(data)


def assert_self_contained(text: str):
    page = Page(text)
    remote = [(t, k, v) for t, k, v in page.attrs
              if k in ("src", "href", "srcset", "action", "data", "poster") and re.match(r"\s*(https?:)?//", v)]
    assert not remote, remote
    assert not [a for a in page.attrs if a[0] == "link"]  # no external stylesheet
    assert sum(n > 1_000_000 for n in page.scripts) == 1  # plotly.js inlined exactly once
    assert "<script src" not in text


def test_report_is_one_self_contained_file_with_every_plot(tmp_path):
    run = write_run(tmp_path / "run", samples=[sample(1, "best", "5")])
    out = write_report(run)
    assert out == run / "report.html"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl", "report.html", "samples.jsonl"]
    text = out.read_text()
    assert_self_contained(text)
    for title in TITLES:
        assert f"<h3>{title}</h3>" in text
    assert text.count("Plotly.newPlot(") == len(TITLES)  # every metric group was logged: no notes
    assert "not logged" not in text
    assert "last step 3 of 10" in text and "run</h1>" in text
    assert "validation score 0.600 (step 2)" in text
    assert "use_kl_loss: true" in text  # the config, verbatim


def test_a_group_not_logged_is_a_note_not_an_empty_chart(tmp_path):
    metrics = [{k: v for k, v in m.items() if not k.startswith(("perf/mfu", "actor/kl"))} for m in METRICS]
    text = write_report(write_run(tmp_path / "run", metrics=metrics)).read_text()
    assert text.count("Plotly.newPlot(") == len(TITLES) - 2
    assert "not logged in this run (actor/kl_loss, actor/ppo_kl)" in text
    assert "not logged in this run (perf/mfu/actor, perf/mfu/rollout)" in text


def test_samples_are_escaped_newest_first_and_capped(tmp_path):
    hostile = "<script>alert(1)</script>\nline two & more"
    samples = [sample(s, w, f"answer at step {s}", g)
               for s in range(1, 31) for g in range(4) for w in ("best", "worst")]
    samples.append(sample(31, "best", hostile))
    text = write_report(write_run(tmp_path / "run", samples=samples)).read_text()
    assert "<script>alert(1)" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;\nline two &amp; more" in text  # the newline kept (pre-wrap)
    assert text.index("alert(1)") < text.index("answer at step 30") < text.index("answer at step 29")
    assert "the newest 200 of 241 rows" in text
    assert "answer at step 6<" in text and "answer at step 5<" not in text  # the oldest fell past the cap


def test_no_samples_is_a_note(tmp_path):
    text = write_report(write_run(tmp_path / "run")).read_text()
    assert "No samples: this run has no samples.jsonl" in text


def test_a_half_written_last_line_is_skipped_and_counted(tmp_path):
    run = write_run(tmp_path / "run", tail='{"step": 4, "critic/score/me', config=None)
    text = write_report(run, tmp_path / "out" / "r.html").read_text()
    assert "last step 3 (no config.yaml" in text
    assert "1 line that does not parse was skipped" in text
    assert load_run(run).bad_metric_lines == 1


def test_a_step_logged_twice_is_merged_later_values_winning(tmp_path):
    run = load_run(write_run(tmp_path / "run", metrics=[*METRICS, {"step": 3, "critic/score/mean": 0.9}]))
    assert [s["step"] for s in run.steps] == [0, 1, 2, 3]
    assert run.series("critic/score/mean") == ([1, 2, 3], [0.1, 0.2, 0.9])
    assert run.series("actor/pg_loss") == ([1, 2, 3], [0.01, 0.01, 0.01])  # the first line's other keys stay
    assert run.series("actor/entropy")[1][-1] is None  # null: a gap in the plot


def cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, [x for x in captured.err.splitlines() if x.startswith("posttrain: error:")]


def test_cli_report_writes_and_prints_the_path(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    code, out, err = cli(["report", str(run)], capsys)
    assert code == 0 and not err and out.strip() == f"wrote {run / 'report.html'}"


def test_cli_errors_name_the_problem(tmp_path, capsys):
    code, _, err = cli(["report", str(tmp_path / "nope")], capsys)
    assert code == 2 and len(err) == 1 and "nope" in err[0] and "does not exist" in err[0]
    (tmp_path / "empty").mkdir()
    code, _, err = cli(["report", str(tmp_path / "empty")], capsys)
    assert code == 2 and len(err) == 1 and "no metrics.jsonl" in err[0] and "config.yaml" in err[0]
    code, _, err = cli(["compare", str(write_run(tmp_path / "run"))], capsys)
    assert code == 2 and len(err) == 1 and "at least two" in err[0]
    code, _, err = cli(["compare", str(tmp_path / "run"), str(tmp_path / "empty")], capsys)
    assert code == 2 and "empty" in err[0]
    assert not (tmp_path / "empty" / "report.html").exists()


def test_compare_overlays_runs_and_shows_only_differing_keys(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "a" / "run")
    b = write_run(tmp_path / "b" / "run", metrics=METRICS[:3], config=CONFIG.replace("lr: 0.0001", "lr: 0.0003"))
    monkeypatch.chdir(tmp_path)
    code, out, _ = cli(["compare", str(a), str(b)], capsys)
    assert code == 0 and out.strip() == "wrote compare.html"
    text = (tmp_path / "compare.html").read_text()
    assert_self_contained(text)
    for title in TITLES:
        assert f"<h3>{title}</h3>" in text
    assert text.count("Plotly.newPlot(") == len(TITLES)
    assert '"name":"a\\u002frun"' in text and '"name":"b\\u002frun"' in text  # one trace per run, named apart
    assert "<th>a/run</th><th>b/run</th>" in text
    assert '<td class="text">actor.lr</td><td class="text">0.0001</td><td class="text">0.0003</td>' in text
    assert '<td class="text">trainer.run_dir</td>' in text  # it differs too
    assert '<td class="text">rollout.n</td>' not in text  # the same in both
    assert "Sample completions" not in text


def test_names_and_config_helpers(tmp_path):
    assert unique_names([tmp_path / "a" / "x", tmp_path / "b" / "x", tmp_path / "y"]) == ["a/x", "b/x", "y"]
    assert unique_names([tmp_path / "x", tmp_path / "x"]) == [f"{tmp_path.name}/x (1)", f"{tmp_path.name}/x (2)"]
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": 1, "a.c": [1, 2], "d": {}}
    one = write_run(tmp_path / "one", config="a:\n  b: 1\n  c: 2\n")
    two = write_run(tmp_path / "two", config="a:\n  b: 1\n  d: 3\n")
    rows = differing_config([load_run(one), load_run(two)])
    assert [k for k, _ in rows] == ["a.c", "a.d"]


# ---- a real run in a real browser ------------------------------------------------------------

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# every plotly div, with how many of its trace paths (lines, markers, bars) have a non-empty `d`
TRACE_PATHS_JS = """() => Array.from(document.querySelectorAll('.plotly-graph-div')).map(div => ({
    id: div.id,
    svg: div.querySelectorAll('svg.main-svg').length,
    // drawn inside its card, not at a width the grid had before the page was laid out
    fits: div.querySelector('svg.main-svg').getBoundingClientRect().width
        <= div.closest('.plot').getBoundingClientRect().width,
    paths: Array.from(div.querySelectorAll('svg.main-svg g.trace path'))
        .filter(p => (p.getAttribute('d') || '').trim().length > 0).length,
}))"""
ALL_DRAWN_JS = f"() => {{ const r = ({TRACE_PATHS_JS})(); return r.length && r.every(d => d.paths > 0 && d.fits); }}"


def find_chromium() -> str | None:
    return os.environ.get("POSTTRAIN_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def real_run(tmp_path: Path) -> Path:
    from posttrain.driver.build import build_run
    from posttrain.config import load_config
    from posttrain.driver.loop import train
    from posttrain.help_config import describe_keys

    run_dir = tmp_path / "real-run"
    extra = [o for o in ("trainer.log_samples_freq=1", "trainer.log_val_generations=4")
             if f"{o.split('=')[0]}:" in describe_keys()]
    cfg = load_config(None, ["trainer.total_training_steps=3", "trainer.test_freq=2", "data.val_max_samples=64",
                             "trainer.logger=[]",
                             f"trainer.run_dir={run_dir}", *extra])
    train(build_run(cfg))
    samples = run_dir / "samples.jsonl"
    if not samples.exists():
        samples.write_text("".join(json.dumps(sample(s, w, f"{s + 3}")) + "\n" for s in (1, 2, 3)
                                   for w in ("best", "worst")))
    with open(samples, "a") as fh:  # what a browser must show as text, never run or fetch
        fh.write(json.dumps(sample(3, "worst", "<script>alert(1)</script><img src=x onerror=alert(2)>\n9")) + "\n")
    return run_dir


def test_a_real_runs_report_renders_in_a_browser(tmp_path, trained_tiny_model_dir):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium: `apt-get install chromium` (or set POSTTRAIN_CHROMIUM to a Chromium binary)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="`pip install playwright` (no browser download "
                                                                  "needed: the test drives the system chromium)")
    out = write_report(real_run(tmp_path))
    problems: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else 0)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
            # anything but the file itself would be a fetch from the network: refuse and record it
            page.route(re.compile(r"^(https?|wss?|ftp):"), lambda route: (
                problems.append(f"network request: {route.request.url}"), route.abort()))
            page.goto(out.as_uri(), wait_until="load")
            try:
                page.wait_for_function(ALL_DRAWN_JS, timeout=30_000)
            except sync_api.TimeoutError:
                pass  # the assertion below says which plot is empty
            drawn = page.evaluate(TRACE_PATHS_JS)
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot), full_page=True)
            hostile = page.locator("td.text", has_text="alert(1)").first.inner_text()
        finally:
            browser.close()
    if os.environ.get("POSTTRAIN_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["POSTTRAIN_REPORT_SCREENSHOT"])
    assert not problems, problems
    text = out.read_text()
    assert len(drawn) == text.count("Plotly.newPlot(") >= 5, drawn  # score, entropy, length, phases, throughput
    assert all(d["svg"] and d["paths"] > 0 and d["fits"] for d in drawn), drawn
    assert hostile == "<script>alert(1)</script><img src=x onerror=alert(2)>\n9"  # shown as text
    assert shot.stat().st_size > 20_000


def test_an_sft_run_gets_its_loss_plot_and_a_distillation_run_its_kl(tmp_path):
    sft = [{"step": 0, "val/loss": 0.9}, {"step": 1, "train/loss": 0.8, "timing_s/step": 0.1},
           {"step": 2, "train/loss": 0.6, "val/loss": 0.7, "timing_s/step": 0.1}]
    text = write_report(write_run(tmp_path / "sft", metrics=sft)).read_text()
    assert "<h3>Loss</h3>" in text and "validation loss 0.700 (step 2)" in text
    assert "<h3>Distillation</h3>" not in text  # an optional plot is left out, not noted
    distill = [{**m, "distillation/reverse_kl": 0.2 / m["step"]} for m in METRICS if m.get("step")]
    assert "<h3>Distillation</h3>" in write_report(write_run(tmp_path / "d", metrics=distill)).read_text()
