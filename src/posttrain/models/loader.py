"""Load a Hugging Face causal LM and its tokenizer from a local directory."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.errors import ModelError
from posttrain.files.cache import check_model_dir, check_tokenizer_dir
from posttrain.models.attention import use_grouped_attention
from posttrain.models.processor import is_vision_dir, load_vision_model, load_vision_value_model
from posttrain.text.lines import one_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, apart: bool = False):
    """AutoTokenizer from `path`, a model directory (`apart`: a directory given as model.tokenizer_path, which needs
    only the tokenizer's files), with a pad token (the EOS when none is set)."""
    from transformers import AutoTokenizer

    p = check_tokenizer_dir(path) if apart else check_model_dir(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds here
        raise ModelError(f"cannot load the tokenizer from '{p}': {one_line(e)}{_remote_code_hint(e)}") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False, device="cpu",
               small_attention: bool = True):
    """AutoModelForCausalLM from safetensors weights only. small_attention: small
    CPU attentions as grouped matmuls (models/attention.py)."""
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path, tokenizer=False)  # the tokenizer may be given apart (model.tokenizer_path)
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    if is_vision_dir(p):  # a vision-language model: its image-text-to-text class
        model = load_vision_model(p, DTYPES[dtype], trust_remote_code)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(p), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, use_safetensors=True,
            )
        except Exception as e:
            raise ModelError(f"cannot load the model from '{p}': {one_line(e)}{_remote_code_hint(e)}") from e
    if small_attention:
        use_grouped_attention(model)
    return model.to(device)


def load_value_model(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False, device="cpu",
                     small_attention: bool = True):
    """A value model: the causal LM's body with a scalar head on every position
    (AutoModelForTokenClassification with one label; the head starts from
    scratch unless `path` is a saved critic). -> model whose `.logits` are [B, L, 1]."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    p = check_model_dir(path, tokenizer=False)  # the tokenizer may be given apart (model.tokenizer_path)
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    if is_vision_dir(p):  # a vision-language model: its body, the output layer replaced by the value head
        model = load_vision_value_model(p, DTYPES[dtype], trust_remote_code)
        if small_attention:
            use_grouped_attention(model)
        return model.to(device)
    try:
        config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
        config.num_labels = 1
        config.classifier_dropout = 0.0  # values are regression targets: no dropout on the head
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "score.weight | MISSING": the new value head, on purpose
        try:
            model = AutoModelForTokenClassification.from_pretrained(
                str(p), config=config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                use_safetensors=True)
        finally:
            hf_logging.set_verbosity(level)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ModelError(f"the model in '{p}' has no token-classification variant in transformers, which the "
                             "critic's value head needs; point critic.model.path at a model that has one "
                             "(Llama, Qwen2, Mistral, ...)") from e
        raise ModelError(f"cannot load a value model from '{p}': {one_line(e)}{_remote_code_hint(e)}") from e
    except Exception as e:
        raise ModelError(f"cannot load a value model from '{p}': {one_line(e)}{_remote_code_hint(e)}") from e
    if small_attention:
        use_grouped_attention(model)
    return model.to(device)


VISION_TOWERS = ("visual", "vision_tower", "vision_model", "vpm", "image_encoder")  # Qwen-VL, LLaVA, SigLIP, MiniCPM-V


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop training a vision-language model's image encoder (verl's
    actor.freeze_vision_tower): its parameters keep their values and get no
    optimizer state. -> the number of parameters frozen (0: a text-only model)."""
    frozen = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_TOWERS:
            for p in module.parameters():
                if p.requires_grad:
                    p.requires_grad_(False)
                    frozen += p.numel()
    return frozen


def _remote_code_hint(e: Exception) -> str:
    """The fix when transformers refused to run a model directory's own Python code."""
    if "custom code" not in str(e) and "trust_remote_code" not in str(e):
        return ""
    return ("; the directory ships its own Python code (auto_map in its config), which posttrain runs only with "
            "model.trust_remote_code=true: set it only for a model whose code you have read and trust")




def eos_token_ids(tokenizer, model) -> list[int]:
    """Tokens that end a response: the tokenizer's EOS and the generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(gen_eos)
    return sorted(ids)
