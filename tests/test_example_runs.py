"""bench/example_runs.py, which reruns the examples' published figures: one step of its cheapest group
end to end (the real runs take minutes to an hour), and its overrides against the commands the docs print."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_the_tools_group_runs_and_prints_the_docs_table_then_its_commands(tmp_path):
    out = tmp_path / "runs.jsonl"
    done = subprocess.run([sys.executable, "bench/example_runs.py", "tools", "--seeds", "0", "--steps", "1",
                           "--num-test", "20", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (run,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert run["steps"] == 1 and set(run["val"]) == set(run["tool_correct"]) == {"0", "1"}
    assert run["val"]["0"] == 0.55  # the shipped model's greedy score on the first 20 held-out pairs
    assert run["seconds"] is not None and run["peak_rss_gb"] > 0 and run["gen_s"] and run["update_s"]
    assert (tmp_path / "work" / "runs" / "tools-tiny-tools-seed0" / "train.log").read_text().count("done: ") == 1
    lines = done.stdout.splitlines()
    assert "| seed | held-out score, steps 0 / 1 | held-out `tool_correct`, steps 0 / 1 | time, peak RSS |" in lines
    assert lines[-1] == run["command"] and "examples/tiny_tools.yaml" in lines[-1] and "trainer.seed=0" in lines[-1]


def documented(doc: str) -> list[set[str]]:
    """The key=value overrides of each `posttrain train examples/smollm2_addition.yaml` command in `doc`
    (continued lines joined), model.path left out."""
    text = (ROOT / doc).read_text().replace("\\\n", " ")
    commands = [line.split("posttrain train", 1)[1] for line in text.splitlines()
                if "posttrain train examples/smollm2_addition.yaml" in line]
    words = [shlex.split(c.split("#")[0])[1:] for c in commands]
    return [{a for a in w if "=" in a and not a.startswith("model.path=")} for w in words]


@pytest.mark.parametrize("group, variant, doc, index", [
    ("lora", "LoRA r16 (lr 3e-4)", "docs/lora.md", 0),  # the page's first command: the table's run
    ("lora", "LoRA r16 (lr 3e-4)", "docs/lora.md", 1),
    ("lora-memory", "LoRA r16, `rollout.lora_sync=adapter` (default)", "docs/lora.md", 2),
    ("smollm2", "full fine-tuning (lr 1e-5)", "README.md", 0),
])
def test_the_scripts_overrides_are_the_documented_commands(group, variant, doc, index, tmp_path):
    from example_runs import GROUPS, train_command

    g = GROUPS[group]
    cmd = train_command(g, g.variants[variant], 0, tmp_path, tmp_path, tmp_path, None)
    ours = {a for a in cmd[cmd.index("train") + 2:]
            if not a.startswith(("model.path=", "data.train_files=", "data.val_files=", "trainer.run_dir=",
                                 "trainer.save_freq="))}
    want = documented(doc)[index]
    assert ours - {"trainer.seed=0"} == want - {"trainer.seed=0"}, (ours, want)
