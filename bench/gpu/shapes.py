"""Real-size work for the GPU benchmark without downloading a model.

A model directory is built from a shape's config file (`configs/*.json`:
Qwen2.5-0.5B's and Qwen2.5-1.5B's architecture) with random weights,
initialised on the device, beside posttrain's byte-level tokenizer (the
tiny model's, in Qwen2's layout, padded to the shape's 151,936 ids with
tokens that encoding never produces). The embedding and the LM head cost
what they cost in the real model, and every sampled id decodes to some
bytes, so no response is empty. The benchmark times work, not learning.

Prompts are exactly `length` tokens with the chat template applied, so that
"256-token prompts" holds for every row.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"
SHAPES = {"qwen2.5-0.5b": CONFIGS / "qwen2.5-0.5b.json", "qwen2.5-1.5b": CONFIGS / "qwen2.5-1.5b.json"}
# --dry-run: the same architecture and vocabulary, shrunk to run in seconds on a CPU
DRY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)


def make_model(shape: str, output_dir: Path, device: str, dry_run: bool = False, seed: int = 0) -> Path:
    """Write a random-weight model of `shape` (float32 safetensors) and the tokenizer to `output_dir`."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.tokenizer import write_tokenizer

    out = Path(output_dir)
    fields = json.loads(SHAPES[shape].read_text())
    fields.pop("architectures", None), fields.pop("model_type", None)
    write_tokenizer(out, vocab_size=fields["vocab_size"])
    tok = AutoTokenizer.from_pretrained(str(out))
    if len(tok) != fields["vocab_size"]:
        raise ValueError(f"the tokenizer has {len(tok)} ids, the shape {fields['vocab_size']}")
    if dry_run:
        fields.update(DRY_DIMS)
    config = Qwen2Config(**fields, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: seconds on a GPU for 1.5B parameters
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def prompt_rows(model_dir: Path, count: int, length: int, seed: int = 0) -> list[dict]:
    """`count` rows (posttrain's parquet schema, arith reward) whose chat-templated
    prompt is exactly `length` tokens: digits and spaces, one token each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def templated(text: str) -> int:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    overhead = templated("")
    if length <= overhead:
        raise ValueError(f"prompts of {length} tokens cannot hold the chat template's {overhead}")
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        text = "".join(rng.choice("0123456789 ") for _ in range(length - overhead)).strip() or "0"
        text = text.ljust(length - overhead, "0")
        if templated(text) != length:
            raise ValueError(f"a prompt came out at {templated(text)} tokens, not {length}")
        rows.append({"data_source": "arith", "prompt": [{"role": "user", "content": text}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": i}})
    return rows
