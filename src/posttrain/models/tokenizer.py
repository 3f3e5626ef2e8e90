"""The embedded model's tokenizer: bytes as tokens, stored the way Qwen2's
byte-level BPE is stored.

Every byte is one token (the 256 GPT-2 byte-to-unicode symbols, no merges),
plus `<|endoftext|>` (padding), `<|im_start|>` and `<|im_end|>` (end of a
turn, the EOS). It is written in Qwen2's layout (vocab.json, merges.txt,
tokenizer.json with Qwen2's split regex) because transformers rebuilds a
tokenizer the Qwen2 way whenever config.json says qwen2: a tokenizer stored
any other way silently loses spaces and newlines.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

# Qwen2's pre-tokenizer pattern: digits one by one, words with a leading
# non-letter, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML without a default system prompt (keeps prompts short).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_symbols() -> list[str]:
    """The printable stand-in for each byte 0..255 (GPT-2's byte-to-unicode table):
    printable Latin-1 bytes stand for themselves, the rest map to U+0100 onwards."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, extra = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def padding_symbols(count: int) -> list[str]:
    """`count` tokens that encoding never produces: strings of 2 or 3 byte
    symbols, with no merge to build them. They decode to their bytes."""
    syms = byte_symbols()
    pairs = (a + b for a in syms for b in syms)
    triples = (a + b + c for a in syms for b in syms for c in syms)
    out = []
    for s in (*pairs,) if count <= len(syms) ** 2 else (*pairs, *triples):
        if len(out) == count:
            break
        out.append(s)
    return out


def vocabulary(vocab_size: int | None = None) -> list[str]:
    """The BPE vocabulary in id order: the 256 byte symbols, then padding up to
    `vocab_size` minus the special tokens (which come last)."""
    syms = byte_symbols()
    if vocab_size is None:
        return syms
    if vocab_size < len(syms) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} < {len(syms) + len(SPECIAL_TOKENS)} (bytes and special tokens)")
    return syms + padding_symbols(vocab_size - len(syms) - len(SPECIAL_TOKENS))


def build_tokenizer(vocab_size: int | None = None) -> Tokenizer:
    vocab = {sym: i for i, sym in enumerate(vocabulary(vocab_size))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_tokenizer(output_dir: str | Path, vocab_size: int | None = None) -> None:
    """Write tokenizer.json, vocab.json, merges.txt and tokenizer_config.json.

    vocab_size: pad the vocabulary to this many ids (`padding_symbols`), for a
    model of a real vocabulary whose every sampled id must decode to text."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    vocab = vocabulary(vocab_size)
    (out / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(vocab)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n")
    first_special = len(vocab)
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(first_special + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}))


VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
