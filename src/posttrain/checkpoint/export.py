"""A checkpoint's policy as a stand-alone Hugging Face model directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from posttrain.checkpoint.manifest import STEP_DIR, latest_valid, verify
from posttrain.errors import CheckpointError
from posttrain.files.cache import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # a LoRA checkpoint's actor/ holds these only


def resolve(path: str | Path) -> Path:
    """A global_step_N directory, or a run directory (its newest valid checkpoint)."""
    p = Path(path)
    if STEP_DIR.match(p.name):
        return p
    found = latest_valid(p)
    if found is None:
        raise CheckpointError(f"'{p}' is neither a global_step_N checkpoint nor a run directory with a valid one")
    return found.path


def export_checkpoint(checkpoint: str | Path, output: str | Path, adapter: bool = False) -> Path:
    """Verify the checkpoint, then write its actor/ (config, safetensors,
    tokenizer with its chat template, generation config) to `output`. A LoRA
    checkpoint's adapters are merged into its base model (the run's
    model.path), or with `adapter` written as a peft adapter directory."""
    ckpt = resolve(checkpoint)
    problem = verify(ckpt) if ckpt.is_dir() else "not a directory"
    if problem:
        raise CheckpointError(f"cannot export '{ckpt}': {problem}; pick a valid one (`posttrain checkpoints RUN_DIR`)")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"output directory '{out}' is not empty; choose a new --output")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lora = (ckpt / "actor" / ADAPTER_CONFIG).is_file() or trained_adapters(ckpt)
    if adapter and not lora:
        raise CheckpointError(f"'{ckpt}' holds no LoRA adapters (it trained every weight); export it without --adapter")
    shutil.copytree(ckpt / "actor", tmp)
    if lora and (ckpt / "actor_dcp").is_dir():
        gather_adapters(ckpt, tmp, merge=not adapter)
    elif (ckpt / "actor_dcp").is_dir():
        gather_shards(ckpt, tmp)
    elif lora and not adapter:
        merge_adapters(ckpt, tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def trained_adapters(ckpt: Path) -> bool:
    """Whether the run that wrote `ckpt` trained LoRA adapters (its saved config says)."""
    from posttrain.files.yamlfile import UnreadableYaml, load_yaml

    try:
        model = (load_yaml(ckpt / "config.yaml") or {}).get("model") or {}
    except UnreadableYaml:
        return False
    return bool(model.get("lora_rank")) or bool(model.get("lora_adapter_path"))


def gather_shards(ckpt: Path, out: Path) -> None:
    """A sharded checkpoint's policy as one safetensors file in `out` (which
    holds the model's config): the model is built on the config, filled from
    the shards in this one process, and saved like `save_pretrained` does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from posttrain.checkpoint.sharded import load_full_model
    from posttrain.checkpoint.state import model_tensors

    config = AutoConfig.from_pretrained(str(out))
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
    load_full_model(ckpt / "actor_dcp", model)
    from safetensors.torch import save_file

    save_file(model_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})


def gather_adapters(ckpt: Path, out: Path, merge: bool) -> None:
    """A sharded LoRA checkpoint (its actor_dcp/ holds the whole adapted model's shards) -> in `out`, the
    peft adapter files, or with `merge` the base with the adapters merged in (model.safetensors): the
    run's base model is built with the run's adapters, filled from the shards in this one process."""
    from safetensors.torch import save_file

    from posttrain.checkpoint.sharded import load_full_model
    from posttrain.checkpoint.state import model_tensors
    from posttrain.models.loader import load_model
    from posttrain.models.lora import LoraSettings, adapter_config_json, add_adapters, adapter_tensors
    from posttrain.files.yamlfile import load_yaml

    m = (load_yaml(ckpt / "config.yaml") or {}).get("model") or {}
    settings = LoraSettings(rank=m.get("lora_rank") or 8, alpha=m.get("lora_alpha", 16),
                            target_modules=m.get("target_modules", "all-linear"),
                            exclude_modules=m.get("exclude_modules"),
                            adapter_path=None if m.get("lora_rank") else m.get("lora_adapter_path"))  # the shapes
    model = add_adapters(load_model(base_model_dir(ckpt)), settings)
    load_full_model(ckpt / "actor_dcp", model)
    if merge:
        save_file(model_tensors(model.merge_and_unload()), str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        save_file(adapter_tensors(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (out / ADAPTER_CONFIG).write_text(adapter_config_json(model))


def base_model_dir(ckpt: Path) -> str:
    """The base model a LoRA checkpoint's adapters belong to (the run's model.path), which must be there."""
    import json

    base = json.loads((ckpt / "trainer_state.json").read_text()).get("model_dir")
    if not base or not Path(base).is_dir():
        raise CheckpointError(f"'{ckpt}' holds LoRA adapters for the base model '{base}', which is not there; put the "
                              "base model back, or export the adapters alone with --adapter")
    return base


def merge_adapters(ckpt: Path, out: Path) -> None:
    """A LoRA checkpoint's actor/ copied to `out` -> a plain model directory:
    the base model (the run's model.path) with the adapters merged in, saved
    in place of the adapter files."""
    from safetensors.torch import save_file

    from posttrain.checkpoint.state import model_tensors
    from posttrain.models.loader import load_model
    from posttrain.models.lora import LoraSettings, add_adapters

    model = add_adapters(load_model(base_model_dir(ckpt)), LoraSettings(rank=0), ckpt / "actor").merge_and_unload()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        (out / name).unlink()
    save_file(model_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
