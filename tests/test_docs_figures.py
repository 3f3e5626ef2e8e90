"""The commands and figures the README, the manual (docs/*.md) and bench/README.md give in their prose.

- Bench commands: every `bench/NAME.py ARGS` (in a code span, a shell block or an indented block; `python ...`
  before it, or arguments after it, make it a command) parses with the script's own parser, which is taken from
  the script's main() at its parse_args call: nothing of the bench runs. A bare `bench/NAME.py` names a script
  that exists.
- posttrain commands in the prose (`posttrain train --help-config`, `posttrain export CKPT --output DIR`) parse
  with posttrain's parser (tests/test_guides.py runs the shell blocks' ones).
- Figures: the runs quoted on several pages (FIGURES) give the same numbers on each: every page that quotes a run
  holds its canonical text, and any text shaped as a quote of that run (the figure's `drift` pattern), on any
  page, is that text. The NeMo-RL counts are computed from tests/test_nemo_rl_config.py's EXAMPLE_OUTCOMES, the
  outcomes its tests hold for each of NeMo-RL's example files.
"""

import argparse
import contextlib
import functools
import importlib.util
import io
import re
import shlex
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from posttrain.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
BENCH = re.compile(r"(?P<python>(?:\S*/)?python3?\s+)?(?P<script>bench/[\w/]+\.(?:py|sh))(?P<args>(?:\s+[^\s#;&`]+)*)")


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def command_texts(page: Path) -> list[str]:
    """Where a page writes commands: its inline code spans, and the lines of its fenced and indented blocks
    (continuations joined, comments dropped)."""
    text = page.read_text()
    blocks = re.findall(r"^```[\w-]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    indented = re.findall(r"^(?: {4}|\t)(\S.*)$", prose, flags=re.M)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()] + indented
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    return spans + [re.sub(r"\s#\s.*$", "", line).strip() for line in lines]


def bench_commands(page: Path) -> list[tuple[str, list[str] | None]]:
    """(script, its arguments) of each bench command of the page; None for a script named, not run. `[--flag V]`
    (optional) counts as given, `$(...)` as one word, `...` as nothing."""
    out = []
    for text in command_texts(page):
        for m in BENCH.finditer(text):
            words = usage_words(re.sub(r"\$\([^)]*\)", "X", m["args"]))
            out.append((m["script"], words if m["python"] or words else None))
    return out


def usage_words(text: str) -> list[str]:
    """A command line as its usage writes it, as words to parse: `[...]` optional (given), `a|b` one of them
    (the first), `--flag ...` the flag with its values left out (dropped), `...` nothing."""
    try:
        words = shlex.split(text.replace("[", " ").replace("]", " "))
    except ValueError:  # a quote in prose
        words = text.split()
    out = []
    for w in words:
        if w == "...":
            if out and out[-1].startswith("-"):
                out.pop()
            continue
        out.append(w if w.startswith("-") else w.split("|")[0])
    return out


class _Parser(Exception):
    pass


@functools.cache
def bench_parser(script: str) -> argparse.ArgumentParser:
    """The script's own parser: its main() runs up to its parse_args call, which hands the parser back instead."""
    path = REPO / script
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    sys.path.insert(0, str(path.parent))  # the scripts import their neighbours (common.py)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))

    def hand_back(self, *args, **kwargs):
        raise _Parser(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", hand_back), mock.patch.object(sys, "argv", [script]):
        try:
            module.main()
        except _Parser as e:
            return e.args[0]
    raise AssertionError(f"{script}: main() returned without parsing its arguments")


def parse_error(parser: argparse.ArgumentParser, argv: list[str], named: bool = False) -> str | None:
    """The parser's complaint about `argv` (None: it parses). named: the words name a command, and may leave out
    what it requires (`posttrain eval`, `posttrain preprocess gsm8k --input`)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            error = err.getvalue().strip().splitlines()[-1] if e.code else None
            partial = named and re.search(r"arguments are required|expected (at least )?one argument", error or "")
            placeholder = re.search(r"invalid (int|float) value: '[A-Z_]+'", error or "")  # `--threads N`
            return None if partial or placeholder else error
    return None


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_bench_command_parses_with_its_scripts_arguments(page):
    wrong = []
    for script, argv in bench_commands(page):
        if not (REPO / script).is_file():
            wrong.append(f"{script}: no such script")
        elif argv is not None and script.endswith(".py") and (error := parse_error(bench_parser(script), argv)):
            wrong.append(f"`{script} {shlex.join(argv)}`: {error}")
    assert not wrong, f"{page_id(page)}:\n" + "\n".join(wrong)


def test_the_bench_command_reader():
    found = [c for p in PAGES for c in bench_commands(p)]
    assert ("bench/learning_spread.py", ["default"]) in found  # README, in a span
    assert ("bench/nemo_rl_configs.py", ["--nemo-rl", "~/RL", "--recipes"]) in found  # bench/README.md, a block
    assert ("bench/step_floor.py", ["--model", "DIR", "--steps", "4", "--threads", "2"]) in found  # [--flag V]
    assert ("bench/fast_paths.py", None) in found  # named, not run
    assert "required: --nemo-rl" in parse_error(bench_parser("bench/nemo_rl_configs.py"), [])
    assert "invalid choice" in parse_error(bench_parser("bench/rollout_mismatch.py"), ["--model", "gpt"])


def prose_posttrain_commands(page: Path) -> list[list[str]]:
    """The `posttrain COMMAND ...` (or `posttrain --option ...`) of the page's code spans as words: `[...]`
    optional, `a|b` one of them (the first), `...` nothing. (`posttrain is 3x faster`, printed output, is none.)"""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    commands = {a.dest: a for a in build_parser()._actions}["command"].choices
    out = []
    for span in (" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)):
        words = usage_words(span) if span.startswith("posttrain ") else []
        if len(words) > 1 and (words[1] in commands or words[1].startswith("-")):
            out.append(words[1:])
    return out


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_posttrain_command_in_the_prose_parses(page):
    wrong = [f"`posttrain {shlex.join(argv)}`: {error}" for argv in prose_posttrain_commands(page)
             if (error := parse_error(build_parser(), argv, named=True))]
    assert not wrong, f"{page_id(page)}:\n" + "\n".join(wrong)


# ---- figures: one run, the same numbers wherever it is quoted

@dataclass(frozen=True)
class Figure:
    command: str  # what reproduces it
    spellings: tuple[str, ...]  # its canonical text, as pages write it
    pages: tuple[str, ...]  # the pages (and tests) that quote it: each holds one spelling
    drift: str  # any text of this shape on any page quotes the run: one of the spellings (its group, else all)


def nemo_rl_counts() -> dict[str, int]:
    """Of NeMo-RL's example files (at the commit tests/data/nemo_rl holds): how many load, load with the FSDP2
    switch or are refused, all and the grpo_*.yaml ones."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from test_nemo_rl_config import EXAMPLE_OUTCOMES, LOADS, SWITCHED
    finally:
        sys.path.remove(str(REPO / "tests"))
    out = Counter()
    for name, outcome in EXAMPLE_OUTCOMES.items():
        kind = {LOADS: "loads", SWITCHED: "switched"}.get(outcome, "refused")
        out[kind] += 1
        out["all"] += 1
        if name.startswith("grpo_"):
            out[f"grpo {kind}"] += 1
            out["grpo all"] += 1
    return out


def figures() -> dict[str, Figure]:
    n = nemo_rl_counts()
    return {
        "the default run (make run), seed 0": Figure(
            "make run; bench/learning_spread.py default", ("0.547 -> 0.842 (+0.295)",), ("README.md",),
            r"0\.547 -> 0\.\d+ \([+-]\d\.\d+\)"),
        "the default run's gain over trainer.seed 0 to 4": Figure(
            "bench/learning_spread.py default", ("+0.295 to +0.348", "+0.295..+0.348"),
            ("README.md", "tests/test_end_to_end.py"),
            r"seeds?`? 0 ?(?:to|-) ?4[^.]*?([+-]\d\.\d+ ?(?:to|\.\.) ?[+-]\d\.\d+)"),
        "SmolLM2's example, GRPO, seeds 0 1 2": Figure(
            "bench/example_runs.py smollm2 --seeds 0 1 2", ("0.844 / 0.800 / 0.867", "0.844, 0.800, 0.867"),
            ("README.md", "docs/sft.md", "docs/lora.md", "bench/README.md", "tests/test_real_model.py"),
            r"(?<!\(lr 3e-4\) \| )(?:0\.333 ->|GRPO alone|GRPO runs without SFT,) (0\.\d+(?:,| /) 0\.\d+(?:,| /) 0\.\d+)"),
        "SmolLM2's example in the benches, on-policy, seeds 0 1 2": Figure(
            "bench/rollout_mismatch.py --model smollm2; bench/async_training.py --learn --model smollm2",
            ("+0.489 (+0.444..+0.533)",), ("docs/rollout-correction.md", "docs/async.md", "bench/README.md"),
            r"\| (?:on-policy \| none|sync) \| 3 \| 0\.333 \|[^|\n]*\| ([+-]\d\.\d+ \([^)]*\))"),
        "the tiny model on-policy, seeds 0 1 2": Figure(
            "bench/rollout_mismatch.py; bench/async_training.py --learn", ("+0.326 (+0.295..+0.348)", "+0.326"),
            ("docs/rollout-correction.md", "docs/async.md", "bench/README.md", "README.md"),
            r"\| (?:none \| none|sync) \| 3 \| 0\.547[^|\n]*\|[^|\n]*\| ([+-]\d\.\d+ \([^)]*\))"
            r"|on-policy: ([+-]\d\.\d+)"),
        "NeMo-RL's top-level example files": Figure(
            "bench/nemo_rl_configs.py --nemo-rl DIR",
            (f"of its {n['all']} top-level files {n['loads']} load, {n['switched']} load with the switch and "
             f"{n['refused']} are refused",), ("bench/README.md",),
            r"(of its \d+ top-level files \d+ load, \d+ load with the switch and \d+ are refused)"),
        "NeMo-RL's example files in the guide": Figure(
            "bench/nemo_rl_configs.py --nemo-rl DIR", (f"of its {n['all']} files:",), ("docs/coming-from-nemo-rl.md",),
            r"(of its \d+ files:)"),
        "NeMo-RL's example files in the guide's list": Figure(
            "bench/nemo_rl_configs.py --nemo-rl DIR",
            (f"load as they are ({n['loads']})", f"FSDP2 switch of section 2 ({n['switched']})",
             f"naming the key ({n['refused']})"), ("docs/coming-from-nemo-rl.md",),
            r"(load as they are \(\d+\)|FSDP2 switch of section 2 \(\d+\)|naming the key \(\d+\))"),
        "NeMo-RL's grpo_*.yaml": Figure(
            "bench/nemo_rl_configs.py --nemo-rl DIR",
            (f"{n['grpo all']} example `grpo_*.yaml` files (its commit 7ea279a), {n['grpo loads']} load as they "
             f"are, {n['grpo switched']} more",
             f"{n['grpo loads']} of its {n['grpo all']} example `grpo_*.yaml` as they are",
             f"of its {n['grpo all']} `grpo_*.yaml` among them, {n['grpo loads']} load, {n['grpo switched']} with "
             f"the switch, {n['grpo refused']} are refused"),
            ("README.md", "bench/README.md"),
            r"(\d+ example `grpo_\*\.yaml` files \(its commit 7ea279a\), \d+ load as they are, \d+ more"
            r"|\d+ of its \d+ example `grpo_\*\.yaml` as they are"
            r"|of its \d+ `grpo_\*\.yaml` among them, \d+ load, \d+ with the switch, \d+ are refused)"),
    }


def text_of(page: str) -> str:
    return " ".join((REPO / page).read_text().split())


@pytest.mark.parametrize("name", list(figures()))
def test_a_figure_is_quoted_alike_everywhere(name):
    figure = figures()[name]
    for page in figure.pages:
        assert any(s in text_of(page) for s in figure.spellings), f"{page} does not quote {name}: {figure.spellings}"
    for page in {*map(page_id, PAGES), *figure.pages}:
        for m in re.finditer(figure.drift, text_of(page)):
            quoted = next((g for g in m.groups() if g), m.group(0))
            assert quoted in figure.spellings, f"{page} quotes {name} as {quoted!r}, not {figure.spellings[0]!r}"


def test_a_figures_command_is_named_where_it_is_quoted_first():
    for name, figure in figures().items():
        scripts = re.findall(r"bench/[\w/]+\.py|make run", figure.command)
        assert any(s in text_of(figure.pages[0]) for s in scripts), f"{figure.pages[0]} quotes {name} without its command"


def test_a_drifted_figure_is_caught():
    drift = figures()["the default run (make run), seed 0"].drift
    assert [m.group(0) for m in re.finditer(drift, "validation 0.547 -> 0.855 (+0.309)")] == ["0.547 -> 0.855 (+0.309)"]
    smol = figures()["SmolLM2's example, GRPO, seeds 0 1 2"].drift
    assert re.search(smol, "score went 0.333 -> 0.844, 0.822, 0.867")[1] == "0.844, 0.822, 0.867"
    assert not re.search(smol, "| LoRA r16 (lr 3e-4) | 0.333 -> 0.911 / 0.800 / 0.867 |")
