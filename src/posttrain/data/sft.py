"""Supervised fine-tuning examples from parquet (verl's SFT layout), tokenized with the loss on the
assistant's tokens only.

    settings = SFTDataSettings(prompt_key="question", response_key="answer", max_length=512)
    examples = load_examples(["data/train.parquet"], tokenizer, settings)   # [SFTExample(input_ids, loss_mask)]
    batch = collate(examples[:8], tokenizer.pad_token_id)                  # input_ids, attention_mask, labels

Two layouts, as verl's `data.*` keys name them:
- single turn: the `prompt_key` column (a string, one user message; or a list of chat messages) and the
  `response_key` column (a string), each reached through nested keys if `prompt_dict_keys` /
  `response_dict_keys` are given (verl's `data.prompt_key=extra_info data.prompt_dict_keys=[question]`);
- multi-turn (`multiturn`): the `messages_key` column, a list of {"role", "content"} messages; every assistant
  message is learned, everything else is context.

A conversation's tokens are the chat template's rendering, cut at each assistant message: the context before
it (the template's opening of the turn included) is tokenized as one piece, the assistant's text up to and
including the template's end of its turn as the next (what follows the end of the turn, a newline, goes
with the next context), so the learned tokens are the ones a rollout samples, and end where a rollout stops.
A template that closes no assistant turn (NeMo-RL's sft.yaml writes the answer's text and nothing after it)
gets the EOS token after the last one, learned, so the model learns to stop (NeMo-RL's data.add_eos). A
tokenizer without a chat template (a base model) gets the prompt's text, then the response and EOS.
`only_last_turn` learns a row's last assistant turn only (NeMo-RL's sft.only_unmask_final).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.data.dataset import encode_prompt
from posttrain.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant", "tool")
TRUNCATIONS = ("error", "left", "right")


@dataclass(frozen=True)
class SFTDataSettings:
    prompt_key: str = "question"
    response_key: str = "answer"
    prompt_dict_keys: tuple = ()
    response_dict_keys: tuple = ()
    multiturn: bool = False
    messages_key: str = "messages"
    tools_key: str = "tools"  # multi-turn: a column of tool schemas for the chat template (rows without: none)
    enable_thinking_key: str = "enable_thinking"  # multi-turn: a column of true/false, the template's enable_thinking
    max_length: int = 1024  # tokens of a whole example
    truncation: str = "error"  # an example over max_length: error | left (keep the end) | right (keep the start)
    template_kwargs: dict = field(default_factory=dict)  # data.apply_chat_template_kwargs
    only_last_turn: bool = False  # learn the last assistant turn only; the earlier ones are context
    templates: Any = None  # data.prompt_file / system_prompt_file (data.prompts.PromptTemplates): single-turn prompts


@dataclass
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens learned (each predicted from the ones before it)


def read_parquet_rows(paths, what: str = "SFT") -> list[tuple[str, int, dict]]:
    """(file, row index, row) of every row of the files, in order; a missing or unreadable file is a DataError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise DataError(f"no {what} data files given; set data.train_files")
    out = []
    for p in map(Path, paths):
        if not p.exists():
            raise DataError(f"{what} data file '{p}' does not exist; check data.train_files / data.val_files")
        try:
            table = pq.read_table(p)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"{what} data file '{p}' is not a readable parquet file ({str(e).strip()[:200]})") from e
        if table.num_rows == 0:
            raise DataError(f"{what} data file '{p}' holds no rows")
        out.extend((str(p), i, row) for i, row in enumerate(table.to_pylist()))
    return out


def _reach(row: dict, key: str, dict_keys, where: str, setting: str):
    if key not in row:
        raise DataError(f"{where} has no column '{key}' (it has: {', '.join(row)}); set data.{setting} to the "
                        f"column that holds it" + (", or data.multiturn.enable=true for a messages column"
                                                   if "messages" in row else ""))
    value = row[key]
    for k in dict_keys:
        if not isinstance(value, dict) or k not in value:
            have = ", ".join(value) if isinstance(value, dict) else type(value).__name__
            raise DataError(f"{where}: column '{key}' has no key '{k}' at that depth (it has: {have}); fix "
                            f"data.{setting.replace('_key', '_dict_keys')}")
        value = value[k]
    return value


def row_messages(row: dict, settings: SFTDataSettings, where: str) -> list[dict]:
    """A row as chat messages (the last learned turn included), checked."""
    if settings.multiturn:
        messages = _reach(row, settings.messages_key, (), where, "multiturn.messages_key")
    else:
        prompt = _reach(row, settings.prompt_key, settings.prompt_dict_keys, where, "prompt_key")
        response = _reach(row, settings.response_key, settings.response_dict_keys, where, "response_key")
        if not isinstance(response, str):
            raise DataError(f"{where}: the response ('{settings.response_key}') is a {type(response).__name__}, "
                            "not text; point data.response_key (and data.response_dict_keys) at the answer text")
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        if not isinstance(messages, list):
            raise DataError(f"{where}: the prompt ('{settings.prompt_key}') is a {type(prompt).__name__}, not text "
                            "or a list of chat messages")
        if settings.templates is not None:
            extra = row.get("extra_info")
            messages = settings.templates.apply(messages, extra if isinstance(extra, dict) else None)
        messages = list(messages) + [{"role": "assistant", "content": response}]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DataError(f"{where}: the messages are not a list of {{'role', 'content'}} dicts")
    for m in messages:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: a message {str(m)[:80]} needs a role ({', '.join(ROLES)}) and text content")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where} has no assistant message: nothing to learn; every SFT row needs an assistant turn")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def conversation_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                     only_last_turn: bool = False) -> tuple[list, list]:
    """(input_ids, loss_mask) of a conversation: the template's rendering, assistant turns learned (the last one
    only with `only_last_turn`), ending with the last assistant turn's end (the EOS, learned, when the template
    writes nothing after the assistant's text)."""
    kw = dict(template_kwargs or {})
    if not getattr(tokenizer, "chat_template", None):
        if [m["role"] for m in messages][-1:] != ["assistant"] or \
                any(m["role"] == "assistant" for m in messages[:-1]):
            raise DataError("a multi-turn SFT row needs a tokenizer with a chat template (this one has none)")
        prompt = encode_prompt(tokenizer, messages[:-1])
        answer = tokenizer.encode(messages[-1]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    def render(ms: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen, **kw)

    full = render(messages, False)
    ids, mask, pos = [], [], 0
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[:i + 1], False)
        if not (after.startswith(before) and full.startswith(after) and len(before) >= pos):
            raise DataError("the chat template renders earlier turns differently once later ones follow (e.g. it "
                            "drops past reasoning); SFT on such a conversation would learn text the template never "
                            "shows: split it into one row per assistant turn")
        end = len(after.rstrip())  # the turn's end token is learned; the newline after it is context
        turn = int(i == last or not only_last_turn)
        for text, learned in ((full[pos:len(before)], 0), (full[len(before):end], turn)):
            piece = tokenizer.encode(text, add_special_tokens=False) if text else []
            ids += piece
            mask += [learned] * len(piece)
        pos = end
        if i == last and _ends_bare(full[len(before):end], m["content"], tokenizer):
            ids.append(tokenizer.eos_token_id)  # nothing would end the turn: a rollout stops at the EOS
            mask.append(1)
    return ids, mask


def _ends_bare(turn: str, content: str, tokenizer) -> bool:
    """Whether a rendered assistant turn ends with its own text (no end-of-turn token after it) and the
    tokenizer has an EOS to learn there instead. NeMo-RL's add_eos appends it unless the turn ends with it."""
    eos = getattr(tokenizer, "eos_token", None)
    if eos is None or getattr(tokenizer, "eos_token_id", None) is None or turn.endswith(eos):
        return False
    text = content.strip()
    return turn.endswith(text) if text else not turn.strip()


def chat_template_text(value: str) -> str:
    """data.custom_chat_template's template: the text of a path ending in .jinja (NeMo-RL's rule), else the
    value itself."""
    if not value.endswith(".jinja"):
        return value
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.custom_chat_template={value}: cannot read the template file ({type(e).__name__}: "
                          f"{str(e)[:120]}); give an existing .jinja file or the template's text") from None


def row_template_kwargs(row: dict, settings: SFTDataSettings, where: str = "a row") -> dict:
    """The chat template's arguments for one row: data.apply_chat_template_kwargs, and in multi-turn rows the
    tools and enable_thinking columns when the row has them (verl's multi-turn SFT dataset does the same)."""
    kw = dict(settings.template_kwargs)
    if settings.multiturn:
        tools = row.get(settings.tools_key)
        if isinstance(tools, str):  # tool schemas stored as JSON text
            try:
                tools = json.loads(tools) if tools.strip() else None
            except ValueError:
                raise DataError(f"{where}: column '{settings.tools_key}' is text but not JSON tool schemas "
                                f"({tools[:60]!r}); fix the column or set data.multiturn.tools_key") from None
        if tools is not None and len(tools):
            kw["tools"] = list(tools)
        thinking = row.get(settings.enable_thinking_key)
        if thinking is not None:
            kw["enable_thinking"] = bool(thinking)
    return kw


def fit(ids: list, mask: list, max_length: int, truncation: str, where: str) -> tuple[list, list]:
    if len(ids) <= max_length:
        return ids, mask
    if truncation == "left":
        return ids[-max_length:], mask[-max_length:]
    if truncation == "right":
        return ids[:max_length], mask[:max_length]
    raise DataError(f"{where} has {len(ids)} tokens, over data.max_length={max_length}; raise data.max_length, or set "
                    "data.truncation=left (keep the end) or right (keep the start)")


def load_examples(paths, tokenizer, settings: SFTDataSettings, max_samples: int = -1,
                  what: str = "SFT") -> list[SFTExample]:
    """The files' rows as tokenized examples (the first `max_samples` if > 0). Rows left with no learned token
    after truncation are dropped, with a warning."""
    if settings.truncation not in TRUNCATIONS:
        raise DataError(f"data.truncation must be one of {', '.join(TRUNCATIONS)}, got '{settings.truncation}'")
    rows = read_parquet_rows(paths, what)
    if max_samples and max_samples > 0:
        rows = rows[:max_samples]
    examples, dropped = [], 0
    for path, i, row in rows:
        where = f"row {i} of '{path}'"
        ids, mask = conversation_ids(tokenizer, row_messages(row, settings, where),
                                     row_template_kwargs(row, settings, where), settings.only_last_turn)
        ids, mask = fit(ids, mask, settings.max_length, settings.truncation, where)
        if not any(mask):
            dropped += 1
            continue
        examples.append(SFTExample(ids, mask))
    if dropped:
        print(f"posttrain: warning: {dropped} of {len(rows)} {what} rows kept no response token after "
              f"data.truncation={settings.truncation}; they are left out (raise data.max_length)", file=sys.stderr)
    if not examples:
        raise DataError(f"no {what} example left to train on; raise data.max_length")
    return examples


def collate(examples: list[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [B, L] input_ids and attention_mask, and labels (the token where it is learned, else -100)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        ids[r, :n] = torch.tensor(e.input_ids)
        attention[r, :n] = 1
        labels[r, :n] = torch.where(torch.tensor(e.loss_mask, dtype=torch.bool), ids[r, :n], -100)
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}
