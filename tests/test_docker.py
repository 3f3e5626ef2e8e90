"""The container images (docker/): what they copy, what they pin, their install
script, and the CPU image's install steps run for real in a fresh virtual
environment (these machines have no container engine).

The Dockerfiles are read with a small parser of their own (instructions,
continuation lines, comments; no heredocs, which they do not use) and the
build context is filtered with .dockerignore's rules as Docker applies them:
patterns in order, the last one that matches a path or one of its parent
directories decides, `!` lets a path back in.
"""

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import NO_SHELLCHECK, read_metrics, shellcheck

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
INSTALL_SH = REPO / "docker" / "install.sh"
IMAGES = {"cpu": REPO / "docker" / "Dockerfile.cpu", "gpu": REPO / "docker" / "Dockerfile.gpu"}


# --- reading a Dockerfile ---------------------------------------------------------------------


@dataclass
class Instruction:
    name: str  # upper case: FROM, ARG, ENV, COPY, RUN, ...
    args: str  # the rest, continuation lines joined with a space
    line: int  # where it starts


def parse_dockerfile(text: str) -> list[Instruction]:
    """-> the instructions in order. Comment lines (parser directives included)
    and blank lines are skipped, also inside a continued instruction, as Docker does."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not parts:
            start = number
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        parts.append(line)
        name, _, args = " ".join(p for p in parts if p).partition(" ")
        out.append(Instruction(name.upper(), args.strip(), start))
        parts = []
    assert not parts, f"the instruction at line {start} ends with a continuation"
    return out


def instructions(image: str) -> list[Instruction]:
    return parse_dockerfile(IMAGES[image].read_text())


def build_args(image: str) -> dict[str, str]:
    """ARG defaults (an ARG without one is left out)."""
    args = {}
    for ins in instructions(image):
        if ins.name == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            args[name.strip()] = shlex.split(value)[0] if value else ""
    return args


def env_values(image: str) -> dict[str, str]:
    """ENV settings (`ENV K=V K2=V2` form), values as written (no $ expansion)."""
    env = {}
    for ins in instructions(image):
        if ins.name == "ENV":
            for token in shlex.split(ins.args):
                name, sep, value = token.partition("=")
                assert sep, f"ENV at line {ins.line}: use the K=V form"
                env[name] = value
    return env


def copies(image: str) -> list[tuple[Instruction, list[str], str]]:
    """COPY/ADD from the build context -> (instruction, sources, destination)."""
    out = []
    for ins in instructions(image):
        if ins.name not in ("COPY", "ADD"):
            continue
        if ins.args.startswith("["):
            words = json.loads(ins.args)
        else:
            words = shlex.split(ins.args)
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        out.append((ins, words[:-1], words[-1]))
    return out


# --- .dockerignore ----------------------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern:
    """Docker's pattern syntax (Go's filepath.Match plus `**`) as a regular expression."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        c = pattern[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.index("]", i + 1)
            body = pattern[i + 1 : j]
            out.append("[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]")
            i = j
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("^" + "".join(out) + "$")


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """-> (lets back in, pattern) in file order."""
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        back_in = line.startswith("!")
        line = posixpath.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((back_in, _glob_regex(line)))
    return rules


def ignored(rel: str, rules) -> bool:
    """Whether the path (relative to the context, with /) stays out of the build context."""
    parts = rel.split("/")
    candidates = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    out = False
    for back_in, rx in rules:
        if any(rx.match(c) for c in candidates):
            out = not back_in
    return out


def context_files(source: str, rules) -> list[str]:
    """The files under `source` (a path in the repository) that reach the build context."""
    path = REPO / source
    if path.is_file():
        return [] if ignored(source, rules) else [source]
    rels = (p.relative_to(REPO).as_posix() for p in sorted(path.rglob("*")) if p.is_file())
    return [r for r in rels if not ignored(r, rules)]


def _junk(rel: str) -> bool:
    parts = rel.split("/")
    return any(p == "__pycache__" or p.endswith(".egg-info") or p.startswith(".") for p in parts) or rel.endswith(
        (".pyc", ".pyo"))


# --- fast checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copy_sources_exist_and_reach_the_context(image):
    rules = dockerignore_rules()
    found = copies(image)
    assert found, "no COPY from the build context"
    copied = set()
    for ins, sources, dest in found:
        assert not posixpath.isabs(dest), f"line {ins.line}: a COPY destination relative to WORKDIR, please"
        for source in sources:
            rel = posixpath.normpath(source)
            assert (REPO / rel).exists(), f"line {ins.line}: {source} is not in the repository"
            assert not ignored(rel, rules), f"line {ins.line}: .dockerignore leaves {source} out"
            files = context_files(rel, rules)
            assert files, f"line {ins.line}: nothing of {source} reaches the context"
            if (REPO / rel).is_dir():
                # every real source file goes in; only caches and build left-overs stay out
                everything = [p.relative_to(REPO).as_posix() for p in (REPO / rel).rglob("*") if p.is_file()]
                lost = sorted(set(everything) - set(files) - {r for r in everything if _junk(r)})
                assert not lost, f".dockerignore drops source files under {source}: {lost[:5]}"
            copied.add(rel)
    # what `pip install .` and the RUN lines read is all there
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], "docker/install.sh",
              *project["tool"]["setuptools"]["packages"]["find"]["where"]}
    assert needed <= copied, f"not copied: {sorted(needed - copied)}"
    assert (REPO / "src" / "posttrain" / "configs" / "tiny_arith.yaml").relative_to(REPO).as_posix() in \
        context_files("src", rules)


def test_context_leaves_out_what_the_images_do_not_need():
    rules = dockerignore_rules()
    out = [".git/HEAD", ".venv/bin/python", "bench/.venv-trl/bin/python", "bench/trl_peer.py",
           "runs/posttrain/run-1/metrics.jsonl", "tests/test_docker.py", "tests/data/gsm8k_sample.jsonl",
           "src/posttrain/__pycache__/cli.cpython-312.pyc", "src/posttrain.egg-info/PKG-INFO", "build/lib/x.py",
           "models/tiny/model.safetensors", "data/gsm8k/train.parquet", ".pytest_cache/v/cache/nodeids",
           ".hypothesis/examples/x", "docker/Dockerfile.gpu", "Makefile"]
    kept = ["pyproject.toml", "README.md", "docker/install.sh", "src/posttrain/cli.py",
            "src/posttrain/configs/tiny_arith.yaml", "src/posttrain/py.typed"]
    assert [p for p in out if not ignored(p, rules)] == []
    assert [p for p in kept if ignored(p, rules)] == []


def test_torch_pin_is_the_makefiles():
    """Both images run the torch the tests run: the CPU build from PyTorch's CPU index,
    and on GPUs the CUDA build that vLLM pins (install.sh resolves TORCH_SPEC with vLLM,
    so a vLLM that pins another torch fails the build)."""
    makefile = (REPO / "Makefile").read_text()
    spec = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)\s*$", makefile, re.MULTILINE).group(1)
    cpu, gpu = build_args("cpu"), build_args("gpu")
    assert cpu["TORCH_SPEC"] == spec and gpu["TORCH_SPEC"] == spec
    assert cpu["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert cpu.get("TORCH_SOURCE", "index") == "index"
    assert "TORCH_INDEX" not in gpu  # vLLM's torch comes from PyPI, the CUDA build


def _pinned(spec: str, name: str) -> str:
    req = Requirement(spec)
    assert req.name == name and len(req.specifier) == 1, spec
    (pin,) = req.specifier
    assert pin.operator == "==", spec
    return pin.version


def test_ray_and_vllm_pins_agree_with_pyproject():
    """Both images run the same Ray (KubeRay's rayVersion names one version for the
    whole cluster), with the dashboard (`ray[default]`), inside posttrain's own ranges."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    ray_range = Requirement(extras["ray"][0]).specifier
    cpu, gpu = build_args("cpu"), build_args("gpu")
    assert cpu["RAY_SPEC"] == gpu["RAY_SPEC"]
    # the KubeRay manifests' default spec.rayVersion says which Ray the image runs
    from posttrain.deploy.kuberay import RAY_VERSION
    assert _pinned(cpu["RAY_SPEC"], "ray") == RAY_VERSION
    assert "default" in Requirement(cpu["RAY_SPEC"]).extras
    assert ray_range.contains(_pinned(cpu["RAY_SPEC"], "ray"))
    vllm_range = Requirement(extras["vllm"][0]).specifier
    assert vllm_range.contains(_pinned(gpu["VLLM_SPEC"], "vllm"))
    assert gpu["TORCH_SOURCE"] == "vllm"
    assert set(gpu["POSTTRAIN_EXTRAS"].split(",")) == {"ray", "vllm"}
    assert cpu["POSTTRAIN_EXTRAS"].split(",") == ["ray"]


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_base_layer_comes_before_the_code(image):
    """The install runs twice: --base-only (torch, or vLLM and Ray) before the code is
    copied, so that a change to posttrain does not download the base again."""
    steps = instructions(image)
    runs = [i for i, ins in enumerate(steps) if ins.name == "RUN" and "docker/install.sh" in ins.args]
    code = [i for i, ins in enumerate(steps) if ins.name == "COPY" and "src/" in ins.args]
    assert len(runs) == 2 and len(code) == 1
    assert "--base-only" in steps[runs[0]].args and runs[0] < code[0] < runs[1]
    assert "--base-only" not in steps[runs[1]].args


def test_install_script_passes_bash_n_and_shellcheck():
    subprocess.run(["bash", "-n", str(INSTALL_SH)], check=True)
    linter = shellcheck()
    if linter is None:
        pytest.skip(NO_SHELLCHECK)
    proc = subprocess.run([linter, str(INSTALL_SH)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("settings, message", [
    ({"TORCH_SOURCE": "keep"}, "torch does not import"),
    ({"TORCH_SOURCE": "conda"}, "TORCH_SOURCE must be index, vllm or keep"),
    ({"TORCH_SOURCE": "index", "TORCH_SPEC": ""}, "needs TORCH_SPEC"),
    ({"TORCH_SOURCE": "vllm", "VLLM_SPEC": ""}, "needs VLLM_SPEC"),
])
def test_install_script_refuses_a_base_it_cannot_use(tmp_path, settings, message):
    """Mistakes stop the install with one line, before pip runs (a venv without pip shows it)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           **settings}
    proc = subprocess.run(["bash", str(INSTALL_SH)], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


# --- the CPU image's build, without a container engine ----------------------------------------


def _copy_context(image: str, ctx: Path) -> None:
    """Lay out in `ctx` (the image's WORKDIR) what the image's COPY lines put there,
    each file taken from the build context as .dockerignore filters it."""
    rules = dockerignore_rules()
    for _, sources, dest in copies(image):
        for source in sources:
            rel = posixpath.normpath(source)
            for f in context_files(rel, rules):
                if (REPO / rel).is_dir():
                    target = ctx / dest / Path(f).relative_to(rel)
                elif dest.endswith("/") or posixpath.normpath(dest) == "." or len(sources) > 1:
                    target = ctx / dest / Path(f).name
                else:
                    target = ctx / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / f, target)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cpu_image_build_steps_then_one_training_step(tmp_path):
    """docker/Dockerfile.cpu's install steps, run as its RUN lines run them, in a fresh
    virtual environment on a copy of what the image copies; then its CMD, shortened
    to one step. Differences from a real build, for the machine this runs on: torch
    comes from pip's configured index (TORCH_INDEX empty, as the Makefile allows)
    rather than download.pytorch.org, pip keeps its cache (the image sets
    PIP_NO_CACHE_DIR). POSTTRAIN_CACHE starts empty, as in the image: the embedded
    model comes from the installed package (a wheel, not this checkout)."""
    image = "cpu"
    steps = instructions(image)
    ctx, home, venv = tmp_path / "context", tmp_path / "home", tmp_path / "venv"
    home.mkdir()
    _copy_context(image, ctx)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(build_args(image))
    env.update(env_values(image))
    env.pop("PIP_NO_CACHE_DIR", None)
    env.update({
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "TORCH_INDEX": "",
        "POSTTRAIN_CACHE": str(tmp_path / "cache"),
        "HOME": os.environ.get("HOME", str(home)),  # pip's cache lives under the real home
    })

    # Every RUN line from the first COPY on (those before it set up the system: packages,
    # the user, the virtual environment, made here by `python -m venv`), in order, each in
    # its WORKDIR: the directory the image copies into is `ctx` here, any other `home`.
    source_dir = None
    workdir = "/"
    timings = {}
    start = time.monotonic()
    for ins in steps:
        if ins.name == "WORKDIR":
            workdir = ins.args
        if ins.name == "COPY" and source_dir is None:
            source_dir = workdir
        if ins.name == "RUN" and source_dir is not None:
            cwd = ctx if workdir == source_dir else home
            proc = subprocess.run(["/bin/sh", "-c", ins.args], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=900, check=False)
            assert proc.returncode == 0, (
                f"RUN at line {ins.line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    timings["install"] = time.monotonic() - start

    # the fresh environment's posttrain and torch, not the ones running this test
    code = "import posttrain, torch; print(posttrain.__file__); print(torch.__version__)"
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=home, env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert Path(probe[0]).resolve().is_relative_to(venv.resolve()), probe[0]
    torch_pin = _pinned(build_args(image)["TORCH_SPEC"], "torch")
    assert probe[1].split("+")[0] == torch_pin, probe[1]

    cmd = json.loads(next(ins.args for ins in steps if ins.name == "CMD"))
    assert cmd[0] == "posttrain"
    run_dir = tmp_path / "run"
    overrides = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
                 "trainer.save_last=false", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                 "actor.ppo_micro_batch_size=32", "data.val_max_samples=16", f"trainer.run_dir={run_dir}"]
    start = time.monotonic()
    proc = subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:], *overrides], cwd=home, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    timings["one step"] = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = read_metrics(run_dir)
    assert [x["step"] for x in lines] == [1]
    assert "critic/score/mean" in lines[0] and "actor/pg_loss" in lines[0]
    assert not (tmp_path / "cache" / "models").exists()  # the shipped model, not one built on the spot
    print("test_docker: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
