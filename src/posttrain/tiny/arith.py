"""The embedded tiny model: a small Qwen2 that starts competent but imperfect
at two-number addition. Its weights ship inside the package (models/embedded/, 3.3 MB),
so that every machine trains the same bytes: a model rebuilt on each machine
differs from machine to machine (CPU kernels round differently, and the warm-up
below stops on an accuracy that rounding moves), and so would every result.

`posttrain tiny-model --rebuild --output DIR` runs this module's build code and
says whether it reproduced the shipped bytes; to replace the shipped model,
rebuild into models/embedded/ and set EMBEDDED_DIGEST (models/shipped.py) to the
digest it prints. Another seed or spec is built on first use and cached.

Built from scratch with a seeded initialisation, then trained supervised on
the arith task's *train* pairs until its greedy accuracy on a dev slice of
those pairs reaches `sft_target_accuracy` (stopping on accuracy rather than
on a step count keeps the starting point, and so the RL gain, steady across
seeds). The RL validation uses the arith *test* pairs, never trained on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from posttrain.data import arith
from posttrain.files.cache import cache_root
from posttrain.models import shipped
from posttrain.models.tokenizer import EOS_TOKEN, PAD_TOKEN, VOCAB_SIZE, write_tokenizer

VERSION = "tiny-qwen2-v2"


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    sft_lr: float = 1e-3
    sft_batch_size: int = 128
    sft_target_accuracy: float = 0.5
    sft_max_steps: int = 600
    sft_eval_every: int = 10
    sft_dev_size: int = 256

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:8]


def _config(spec: TinySpec, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), attention_dropout=0.0,
    )


def _examples(tokenizer, pairs):
    """-> input ids [N, L] and labels [N, L] (-100 except on the answer and EOS)."""
    rows, labels = [], []
    for a, b in pairs:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": arith.prompt_text(a, b)}], add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer.encode(prompt, add_special_tokens=False)
        a_ids = tokenizer.encode(arith.answer_text(a, b) + EOS_TOKEN, add_special_tokens=False)
        rows.append(p_ids + a_ids)
        labels.append([-100] * len(p_ids) + a_ids)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, lab


def greedy_accuracy(model, tokenizer, pairs, max_new_tokens: int = 6) -> float:
    """Share of `pairs` whose greedy answer is exactly right."""
    from posttrain.rollout.base import SamplingParams, decode_responses
    from posttrain.rollout.hf import HFRolloutEngine

    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": arith.prompt_text(a, b)}],
                                      add_generation_prompt=True, tokenize=True)["input_ids"]
        for a, b in pairs
    ]
    engine = HFRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, progress=False)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, do_sample=False))
    texts = decode_responses(tokenizer, out)
    return sum(t.strip() == arith.answer_text(a, b) for t, (a, b) in zip(texts, pairs)) / len(pairs)


def sft_step(model, opt, ids, attention, labels, batch_size: int, gen: torch.Generator) -> float:
    """One supervised step (posttrain sft's update, training.sft.sft_update: one micro-batch, no clipping, no
    trimming) on `batch_size` rows drawn (with `gen`) from ids/attention/labels [N, L]. -> the loss."""
    from posttrain.training.sft import SFTSettings, sft_update

    idx = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
    batch = {"input_ids": ids[idx], "attention_mask": attention[idx], "labels": labels[idx]}
    settings = SFTSettings(micro_batch_size=batch_size, grad_clip=None, remove_padding=False)
    return sft_update(model, opt, batch, settings)["train/loss"]


def warm_start(output_dir: Path, seed: int):
    """A warm-up of the shipped model (tiny/tools.py, tiny/games.py): its tokenizer files written to `output_dir`
    byte for byte, then (tokenizer, model) loaded with torch seeded by `seed`."""
    from transformers import AutoTokenizer

    from posttrain.models.loader import load_model

    write_tokenizer(output_dir)
    base = shipped.embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    torch.manual_seed(seed)
    return tokenizer, load_model(base)


def conversation_tensors(rows, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conversations as (token ids, labels) rows (labels -100 where nothing is learned) -> ids, attention mask and
    labels [N, L], right-padded (data.sft.collate)."""
    from posttrain.data.sft import SFTExample, collate

    batch = collate([SFTExample(ids, [int(lab != -100) for lab in labels]) for ids, labels in rows], pad_token_id)
    return batch["input_ids"], batch["attention_mask"], batch["labels"]


def build_tiny_model(output_dir: str | Path, seed: int = 0, spec: TinySpec = TinySpec(), progress: bool = True) -> dict:
    """Initialise, warm up on arith, and save to `output_dir`. -> metadata."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    start = time.perf_counter()
    out = Path(output_dir)
    write_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_config(spec, tokenizer))
    train_pairs, test_pairs = arith.split_pairs(seed=0)
    dev, sft = train_pairs[: spec.sft_dev_size], train_pairs[spec.sft_dev_size:]
    ids, labels = _examples(tokenizer, sft)
    attention = (ids != tokenizer.pad_token_id).long()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    step, dev_acc = 0, 0.0
    while step < spec.sft_max_steps:
        loss = sft_step(model, opt, ids, attention, labels, spec.sft_batch_size, gen)
        step += 1
        if step % spec.sft_eval_every == 0:
            dev_acc = greedy_accuracy(model, tokenizer, dev)
            if progress and (step % 50 == 0 or dev_acc >= spec.sft_target_accuracy):
                print(f"posttrain: warming up the tiny model: step {step}, loss {loss:.3f}, "
                      f"dev accuracy {dev_acc:.2f} (target {spec.sft_target_accuracy})", file=sys.stderr)
            if dev_acc >= spec.sft_target_accuracy:
                break
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    meta = {"version": VERSION, "seed": seed, "spec": asdict(spec), "sft_steps": step, "dev_accuracy": dev_acc,
            "test_accuracy": greedy_accuracy(model, tokenizer, test_pairs[:256]),
            "parameters": sum(p.numel() for p in model.parameters()),
            "seconds": round(time.perf_counter() - start, 1)}
    (out / "posttrain_tiny.json").write_text(json.dumps(meta, indent=2))
    return meta


def ensure_tiny_model(seed: int = 0, cache_dir: str | Path | None = None, spec: TinySpec = TinySpec(),
                      progress: bool = True) -> Path:
    """The embedded model's directory: the shipped one for seed 0 and the default spec;
    any other is built on first use into the cache (atomically, one builder at a time)."""
    if seed == 0 and spec == TinySpec():
        return shipped.embedded_model()
    root = Path(cache_dir) if cache_dir else cache_root() / "models"
    final = root / f"{VERSION}-seed{seed}-{spec.digest()}"
    if (final / "posttrain_tiny.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse
        if (final / "posttrain_tiny.json").exists():
            return final
        if progress:
            print(f"posttrain: building the embedded tiny model into {final} (once; about a minute)", file=sys.stderr)
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(tmp, seed=seed, spec=spec, progress=progress)
        os.replace(tmp, final)
    return final
