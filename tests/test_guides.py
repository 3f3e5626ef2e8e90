"""The README and the manual (docs/*.md) say what posttrain does today.

Every page: each `posttrain` command of its shell blocks is parsed by the
real CLI and each `train` command's config keys load; each `make` target it
names is the Makefile's; each relative link points at a file that exists
(and a `#anchor` at one of its headings).

The deployment guides, further: every `train` command's keys and values load
on their own; every `deploy` command renders; the names later commands use
(files, the RayCluster and its head service, the sbatch script) are those the
deploy commands render; every option the prose mentions in backticks exists.
"""

import re
import shlex
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.cli import build_parser, main
from posttrain.errors import DataError

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
GUIDES = {"deploy-gke.md": ("deploy kuberay", "submit"), "deploy-slurm.md": ("deploy slurm",)}
# values for what the guides compute rather than export
COMPUTED = {"PROJECT_NUMBER": "123456789012", "HF_TOKEN": "hf_example", "WANDB_API_KEY": "wandb_example"}


def shell_lines(text: str) -> list[str]:
    """The commands of the ```bash blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def variables(lines: list[str]) -> dict:
    """NAME -> value of the guide's `export NAME=value` lines (expanded in order)."""
    env = dict(COMPUTED)
    for line in lines:
        m = re.fullmatch(r"export (\w+)=(\S+)", line)
        if m and "$(" not in m.group(2):
            env[m.group(1)] = string.Template(m.group(2)).safe_substitute(env)
    return env


def commands(name: str) -> list[list[str]]:
    """Each shell command of a guide as words, variables expanded."""
    lines = shell_lines((DOCS / name).read_text())
    env = variables(lines)
    out = []
    for line in lines:
        words = shlex.split(string.Template(line).safe_substitute(env), comments=True)
        if words and words[-1] == "&":
            words = words[:-1]
        if words:
            out.append(words)
    return out


def posttrain_commands(name: str) -> list[list[str]]:
    return [words[1:] for words in commands(name) if words[0] == "posttrain"]


def the_command_after_dashes(argv: list[str]) -> list[str] | None:
    """`submit ... -- train ...` / `deploy X ... -- train ...` -> ['train', ...]."""
    if argv[0] == "train":
        return argv
    if "--" in argv:
        rest = argv[argv.index("--") + 1:]
        return rest[1:] if rest[:1] == ["posttrain"] else rest
    return None


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_every_posttrain_command_parses(guide):
    found = posttrain_commands(guide)
    assert found, f"{guide} has no posttrain command"
    for argv in found:
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{guide}: `posttrain {shlex.join(argv)}` does not parse (exit {e.code})")


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_every_train_command_loads_its_config(guide):
    from posttrain.config import load_config

    trains = [c for c in map(the_command_after_dashes, posttrain_commands(guide)) if c and c[0] == "train"]
    assert trains, f"{guide} trains nothing"
    for argv in trains:
        assert not any(a.endswith((".yaml", ".yml")) for a in argv[1:]), "a guide's train command is self-contained"
        cfg = load_config(None, argv[1:])
        assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node >= 1


def render_deploys(guide: str, tmp_path: Path) -> dict[str, str]:
    """Run each `posttrain deploy ... -o FILE` of the guide; -> FILE -> what it wrote."""
    out = {}
    for argv in posttrain_commands(guide):
        if argv[0] != "deploy":
            continue
        flag = "-o" if "-o" in argv else "--output"
        assert flag in argv, f"{guide}: `posttrain {shlex.join(argv)}` writes no file the guide then uses"
        i = argv.index(flag) + 1
        target = tmp_path / argv[i]
        assert main(argv[:i] + [str(target)] + argv[i + 1:]) == 0, shlex.join(argv)
        out[argv[i]] = target.read_text()
    return out


def test_the_gke_guide_uses_what_it_renders(tmp_path, capsys):
    rendered = render_deploys("deploy-gke.md", tmp_path)
    manifests = {f: yaml.safe_load(text) for f, text in rendered.items()}
    clusters = {m["metadata"]["name"] for m in manifests.values() if m["kind"] == "RayCluster"}
    jobs = {m["metadata"]["name"] for m in manifests.values() if m["kind"] == "RayJob"}
    assert clusters and jobs
    for words in commands("deploy-gke.md"):
        line = shlex.join(words)
        if words[:2] in (["kubectl", "apply"], ["kubectl", "delete"]) and "-f" in words:
            assert words[words.index("-f") + 1] in rendered, line
        for svc in re.findall(r"svc/([\w-]+)", line):  # KubeRay names the head service NAME-head-svc
            assert svc in {f"{c}-head-svc" for c in clusters}, line
        for cluster in re.findall(r"ray\.io/cluster=([\w-]+)", line) + re.findall(r"get raycluster ([\w-]+)", line):
            assert cluster in clusters, line
        for job in re.findall(r"get rayjob ([\w-]+)", line) + re.findall(r"job/([\w-]+)", line):
            assert job in jobs, line  # KubeRay's submitter Job is named after the RayJob
        if words[:2] == ["posttrain", "submit"] and "--address" in words:
            assert words[words.index("--address") + 1] == "http://127.0.0.1:8265", line  # the port-forward's
    # the data, model and run paths the jobs read are on the storage the manifests mount
    job = next(m for m in manifests.values() if m["kind"] == "RayJob")
    mounts = {m["mountPath"] for c in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
              for m in c.get("volumeMounts", [])}
    for path in re.findall(r"=(/\w+)/", job["spec"]["entrypoint"]):
        assert path in mounts, path


def test_the_slurm_guide_uses_what_it_renders(tmp_path):
    rendered = render_deploys("deploy-slurm.md", tmp_path)
    assert rendered
    for words in commands("deploy-slurm.md"):
        if words[0] == "sbatch":
            assert words[-1] in rendered, shlex.join(words)
    for name, text in rendered.items():
        script = tmp_path / name
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, name


def options_of(command: list[str]) -> set[str]:
    """The long options of `posttrain COMMAND...` (['deploy', 'kuberay'], ['submit', '--list'])."""
    parser = build_parser()
    for word in command:
        sub = next((a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_options_the_prose_names_exist(guide):
    """`--flag` alone is an option of the guide's commands; `posttrain X ... --flag` one of X's;
    another program's (`docker run --network host`) is not posttrain's to check."""
    unknown = unknown_options(guide, set().union(*(options_of(c.split()) for c in GUIDES[guide])))
    assert not unknown, f"{guide} names options posttrain does not have: {sorted(unknown)}"


def unknown_options(guide: str, default: set[str]) -> set[str]:
    """The options the guide's prose names in backticks that do not exist (`--flag` alone: not in `default`)."""
    prose = re.sub(r"```.*?```", "", (DOCS / guide).read_text(), flags=re.S)
    unknown = set()
    for span in re.findall(r"`([^`]+)`", prose):
        words = span.split()
        if words[0] == "posttrain":
            known = options_of(words[1:])
        elif re.match(r"--[a-z]", words[0]):
            known = default
        else:
            continue
        unknown |= {w.split("=")[0] for w in words if re.match(r"--[a-z]", w)} - known
    return unknown


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def page_commands(page: Path) -> list[list[str]]:
    """The page's commands as words: a `$(...)` is replaced by a word and its inside counted as a
    command too, and leading `NAME=value` environment settings are dropped."""
    out = []
    for line in shell_lines(page.read_text()):
        inner = re.findall(r"\$\(([^()]*)\)", line)
        for text in [re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line), *inner]:
            words = shlex.split(text, comments=True)
            while words and re.fullmatch(r"\w+=\S*", words[0]):
                words = words[1:]
            if words:
                out.append(words)
    return out


def test_every_page_has_its_commands_found():
    """The pages whose shell blocks hold posttrain commands: if the block parsing below stopped
    finding them, the tests that read them would pass on nothing."""
    with_commands = {page_id(p) for p in PAGES if any(w[0] == "posttrain" for w in page_commands(p))}
    assert {"README.md", "docs/configuration.md", "docs/data-and-rewards.md", "docs/multi-turn-tools.md",
            "docs/checkpoints.md", "docs/lora.md", "docs/distributed.md", "docs/coming-from-nemo-rl.md",
            "docs/deploy-gke.md", "docs/deploy-slurm.md"} <= with_commands


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_posttrain_command_of_a_page_parses_and_its_keys_load(page):
    from posttrain.config import load_config

    for words in page_commands(page):
        if words[0] != "posttrain":
            continue
        argv = words[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{page_id(page)}: `posttrain {shlex.join(argv)}` does not parse (exit {e.code})")
        train = the_command_after_dashes(argv)
        if not train or train[0] not in ("train", "sft"):
            continue
        # a config file of this repository (examples/) is read with the keys; a user's own file or
        # NeMo-RL's (not here) is left out and the keys given on the line load on their own
        named = [a for a in train[1:] if a.endswith((".yaml", ".yml"))]
        config = next((str(REPO / a) for a in named if (REPO / a).is_file()), None)
        keys = [a for a in train[1:] if re.match(r"[+~]*[A-Za-z_][\w.]*=", a)]
        try:
            load_config(config, keys, command=train[0])
        except Exception as e:  # noqa: BLE001 - the message is the finding
            pytest.fail(f"{page_id(page)}: `posttrain {shlex.join(argv)}`: {e}")


def test_the_make_targets_the_pages_name_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    named = {(page_id(p), w[1]) for p in PAGES for w in page_commands(p) if w[0] == "make" and len(w) > 1}
    assert ("README.md", "run") in named and ("README.md", "test") in named
    assert {t for _, t in named if "=" not in t} <= targets, named


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def relative_links(page: Path) -> list[str]:
    """The targets of the page's markdown links, outside code, that are not URLs."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_a_link_check_finds_links_and_headings():
    assert slug("On a GPU: bench/gpu/") == "on-a-gpu-benchgpu"
    assert slug("`make test`") == "make-test"
    assert "a-real-model-on-your-laptop" in anchors(REPO / "README.md")
    assert "docs/README.md" in relative_links(REPO / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_points_at_a_file_and_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page_id(page)}: {broken}"


# ---- docs/debugging.md: nothing in it may start a run that waits at a breakpoint, or a Ray cluster

def split_env(words: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words[0].partition("=")
        env[key], words = value, words[1:]
    return env, words


def test_the_debugging_guides_commands_parse_load_or_run(tmp_path, monkeypatch):
    """posttrain commands parse and their configs load; those showing a traceback run (they fail at once) and
    raise instead of printing one line; Ray's commands parse with Ray's own CLI (nothing starts); `export`s
    set only Ray's debugger variables."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # `train --debug` installs the post-mortem hook
    found = set()
    for words in commands("debugging.md"):
        env, words = split_env(words)
        line = shlex.join(words)
        if words[0] == "export":
            assert re.fullmatch(r"RAY_DEBUG(_POST_MORTEM)?=\w+", words[1]), line
            found.add("export")
        elif words[0] == "posttrain":
            args = build_parser().parse_args(words[1:])
            assert args.command == "train", line
            from posttrain.config import load_config

            load_config(None, args.args)
            if any(a.startswith("data.train_files=missing") for a in args.args):  # section 3: shows a traceback
                with monkeypatch.context() as m:
                    for key, value in env.items():
                        m.setenv(key, value)
                    with pytest.raises(DataError, match="missing.parquet"):
                        main(words[1:])
                found.add("traceback")
            found.add("posttrain")
        elif words[0] == "ray":
            pytest.importorskip("ray")
            from ray.scripts.scripts import cli

            command = cli.get_command(None, words[1])
            assert command is not None, line
            command.make_context(words[1], words[2:])  # parses (unknown options raise); runs nothing
            found.add(f"ray {words[1]}")
        else:
            pytest.fail(f"docs/debugging.md: a command no test checks: {line}")
    assert found == {"export", "posttrain", "traceback", "ray start", "ray debug"}, found


def test_the_debugging_guides_reward_file_scores(monkeypatch):
    text = (DOCS / "debugging.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    namespace = {}
    exec(compile(blocks[0], "my_reward.py", "exec"), namespace)
    stops = []
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: stops.append(1))
    assert namespace["compute_score"]("arith", " 68", "68") == 1.0 and stops == [1]


def test_the_debugging_guides_options_exist():
    unknown = unknown_options("debugging.md", options_of(["train"]) | {"--ray-debugger-external"})  # Ray's: above
    assert not unknown, f"docs/debugging.md names options posttrain does not have: {sorted(unknown)}"
