"""LoRA adapters with peft (model.lora_rank > 0): the base model's weights
are frozen and only low-rank adapters train, so the optimizer state is the
adapters' alone, the reference model is the base itself (the same module
with the adapters switched off: no second copy), and a checkpoint holds the
adapters only (peft's adapter_model.safetensors + adapter_config.json).

    model = add_adapters(load_model(base_dir), LoraSettings(rank=16, alpha=32))
    with base_only(model):            # the reference's log-probs
        ...
    dict(merged_weights(model))       # base names, W + (alpha / r) B A: for vLLM or an export

Needs the `lora` extra (`pip install 'posttrain[lora]'`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from posttrain.errors import ConfigError, ModelError
from posttrain.files.cache import ADAPTER_CONFIG
from posttrain.models.loader import VISION_TOWERS

PEFT_PREFIX = "base_model.model."  # peft's wrappers in front of the base model's names


@dataclass(frozen=True)
class LoraSettings:
    """Plain LoRA knobs (verl's model.lora_rank, lora_alpha, target_modules, exclude_modules)."""

    rank: int
    alpha: float = 16
    target_modules: Any = "all-linear"  # "all-linear" or a list of module names (q_proj, v_proj, ...)
    exclude_modules: Any = None
    dropout: float = 0.0
    adapter_path: str | None = None  # start from these adapters (a peft directory) instead of fresh ones
    sync: str = "adapter"  # how the rollout engine samples: "adapter" (applied) or "merged" (W + s B A, a copy)


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora_rank > 0 needs peft: pip install 'posttrain[lora]'") from None
    return peft


def is_adapter_dir(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / ADAPTER_CONFIG).is_file()


def add_adapters(model: torch.nn.Module, s: LoraSettings, adapter_dir: str | Path | None = None):
    """`model` (a causal LM) with trainable LoRA adapters, its own weights
    frozen: fresh adapters (B = 0, so the model is unchanged), or those saved
    in `adapter_dir` (a checkpoint's actor/) or s.adapter_path."""
    peft = _peft()
    source = adapter_dir or s.adapter_path
    if source is not None:
        if not is_adapter_dir(source):
            raise ModelError(f"'{source}' holds no LoRA adapters ({ADAPTER_CONFIG} is missing); point "
                             "model.lora_adapter_path at a peft adapter directory")
        return peft.PeftModel.from_pretrained(model, str(source), is_trainable=True)
    config = peft.LoraConfig(r=s.rank, lora_alpha=s.alpha, target_modules=s.target_modules,
                             exclude_modules=s.exclude_modules if s.exclude_modules is not None else
                             vision_modules(model), lora_dropout=s.dropout, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:  # e.g. target modules not found in the model
        raise ConfigError(f"model.target_modules={s.target_modules}: {str(e).splitlines()[0][:200]}") from None


# a vision-language model's image encoder and the projection into the language model (Qwen-VL's visual with its
# merger, LLaVA's vision_tower and multi_modal_projector, Idefics3's vision_model and connector, ...)
VISION_PARTS = (*VISION_TOWERS, "multi_modal_projector", "connector")


def vision_modules(model) -> str | None:
    """peft's exclude_modules (a regex over module names) that keeps LoRA off a vision-language model's image
    encoder and projector, so the adapters train the language model only; None for a text model."""
    names = [n for n, _ in model.named_modules()]
    found = [p for p in VISION_PARTS if any(n.split(".")[-1] == p or f".{p}." in f".{n}." for n in names)]
    if not found:
        return None
    return r"(.*\.)?(" + "|".join(found) + r")(\..*)?"


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def base_only(model):
    """Within the block `model` runs as its base, the adapters switched off
    (the reference model of a LoRA run)."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The adapters' tensors as peft saves them (CPU copies)."""
    peft = _peft()
    return {k: v.detach().to("cpu", copy=True).contiguous()
            for k, v in peft.get_peft_model_state_dict(model).items()}


def adapter_config_json(model) -> str:
    """adapter_config.json's text for `model`'s adapters (peft's own format)."""
    import json

    config = model.peft_config["default"].to_dict()  # sets (target_modules) sorted: the same file every time
    return json.dumps({k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}, indent=2, default=str)


def adapter_weights(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The policy's (name, full tensor) adapter pairs -> the tensors as peft saves them (its file's names:
    'base_model.model.<layer>.lora_A.weight', no adapter name), CPU copies: what a LoRA request loads."""
    return {name.replace(".default.", "."): t.detach().to("cpu", copy=True).contiguous()
            for name, t in named if ".lora_" in name}


def lora_scaling(model) -> float:
    config = model.peft_config["default"]
    return config.lora_alpha / config.r


def merged_weights(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA model's (name, full tensor) pairs -> the base model's names and
    tensors with each adapter merged in: W + scaling * B @ A. A layer's
    weight and its two adapter matrices may come in any order; each merged
    weight is yielded once all three were seen."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        plain = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        for part in (".lora_A.default.weight", ".lora_B.default.weight", ".base_layer.weight"):
            if plain.endswith(part):
                layer = plain[:-len(part)]
                got = pending.setdefault(layer, {})
                got[part] = t
                if len(got) == 3:
                    del pending[layer]
                    w, a, b = got[".base_layer.weight"], got[".lora_A.default.weight"], got[".lora_B.default.weight"]
                    yield layer + ".weight", w + scaling * (b.to(w.dtype) @ a.to(w.dtype))
                break
        else:
            yield plain.replace(".base_layer.", "."), t
    if pending:
        raise ValueError(f"LoRA layers without their weight or adapters: {sorted(pending)[:3]}")
