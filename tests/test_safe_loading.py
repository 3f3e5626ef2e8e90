"""Loading is parsing: weights from safetensors or torch.load(weights_only=True),
a sharded index through an allow-list, configs with YAML's safe subset, a
model's own Python code only when asked. A crafted file is refused, not run."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from posttrain.driver.build import build_run
from posttrain.checkpoint.manifest import write_manifest
from posttrain.checkpoint.sharded import load_full_model, save_sharded
from posttrain.config import load_config
from posttrain.errors import CheckpointError, ModelError
from posttrain.driver.loop import train
from posttrain.models import load_model, load_tokenizer

from helpers import one_batch_overrides, write_prompts


class Payload:
    """Unpickling this runs a shell command (what a malicious checkpoint does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_sharded_index_is_refused_not_run(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    save_sharded(tmp_path / "dcp", model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    fresh = torch.nn.Linear(3, 2)
    load_full_model(tmp_path / "dcp", fresh)  # the genuine index loads
    assert torch.equal(fresh.weight, model.weight)

    marker = tmp_path / "ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="posix.system.*not checkpoint metadata"):
        load_full_model(tmp_path / "dcp", fresh)
    assert not marker.exists()
    # the file is really hostile: plain pickle (what the index reader would use) runs it
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(tmp_path / 'dcp' / '.metadata')!r}, 'rb'))"],
                   check=True)
    assert marker.exists()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_model_dir):
    """A one-step run with its checkpoint, and the overrides that resume it."""
    root = tmp_path_factory.mktemp("saved")
    write_prompts(root, 8)
    args = one_batch_overrides(tiny_model_dir, root, root / "run", 1, "trainer.save_freq=1")
    train(build_run(load_config(None, args)))
    return root / "run", [*args, "trainer.total_training_steps=2"]


def tampered(saved_run, tmp_path, name: str, content: bytes):
    """A copy of the saved run whose checkpoint file `name` holds `content`,
    with a manifest that matches it (as an attacker would write one)."""
    run_dir, args = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    ckpt = copy / "checkpoints" / "global_step_1"
    (ckpt / name).write_bytes(content)
    write_manifest(ckpt, 1, {})
    return load_config(None, [*args, f"trainer.run_dir={copy}"])


def test_a_crafted_optimizer_file_is_refused_not_run(saved_run, tmp_path):
    marker = tmp_path / "ran"
    cfg = tampered(saved_run, tmp_path, "optimizer.pt", pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="cannot read .*optimizer.pt .*resume_mode=disable"):
        build_run(cfg)
    assert not marker.exists()


def test_a_checkpoint_config_with_python_tags_is_parsed_not_run(saved_run, tmp_path):
    marker = tmp_path / "ran"
    cfg = tampered(saved_run, tmp_path, "config.yaml", f"!!python/object/apply:os.system ['touch {marker}']\n".encode())
    with pytest.raises(CheckpointError, match="cannot read .*config.yaml"):
        build_run(cfg)
    assert not marker.exists()


def test_a_model_directory_with_its_own_code_is_not_run_unless_asked(tmp_path, tiny_model_dir):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    marker = tmp_path / "ran"
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="posttrain_custom",
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (d / "config.json").write_text(json.dumps(config))
    for name in ("configuration_custom.py", "modeling_custom.py"):
        (d / name).write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    load_tokenizer(d)  # its tokenizer is plain data: it loads
    with pytest.raises(ModelError, match="ships its own Python code.*model.trust_remote_code=true"):
        load_model(d)
    assert not marker.exists()
