"""Sample completions for people to read: rows of `samples.jsonl` and of
the loggers' tables.

A row: {"step", "group", "which" ("best" | "worst" | "val"), "data_source",
"prompt", "response", "ground_truth", "score", "reward", "advantage",
"response_length"}, and for a multi-turn sample "turns": its conversation,
turn by turn (the response is then its final answer). `score` is the reward function's, `reward` the
sequence's total after shaping and any KL penalty, `advantage` the mean over
its response tokens.
"""

from __future__ import annotations

import torch


def prompt_texts(batch, tokenizer, rows: list[int]) -> list[str]:
    """The prompts of `rows` as the model saw them (template included, special tokens and padding left out)."""
    width = batch.prompt_width
    prompts = batch.input_ids[rows, :width]  # [k, P] left-padded
    masks = batch.attention_mask[rows, :width].bool()
    return [tokenizer.decode(p[m].tolist(), skip_special_tokens=True) for p, m in zip(prompts, masks)]


def _row(batch, i: int, prompt: str, which: str, score: float) -> dict:
    mask = batch.response_mask[i].bool()
    advantage = batch.advantages[i][mask].mean().item() if batch.advantages is not None and mask.any() else None
    reward = batch.token_level_rewards[i].sum().item() if batch.token_level_rewards is not None else score
    row = {"group": int(batch.group[i]), "which": which, "data_source": batch.data_source[i], "prompt": prompt,
           "response": batch.response_text[i], "ground_truth": str(batch.ground_truth[i]), "score": float(score),
           "reward": float(reward), "advantage": advantage, "response_length": int(mask.sum())}
    info = batch.extra_info[i] if i < len(batch.extra_info) else None
    if isinstance(info, dict) and info.get("messages"):  # a multi-turn sample: its conversation, turn by turn
        row["turns"] = turns_text(info["messages"])
    return row


def turns_text(messages: list[dict]) -> str:
    """A multi-turn sample's conversation after its prompt, one block per message:
    '[assistant] <tool_call>...' / '[tool calculator] 287663' / '[assistant] 287663'."""
    return "\n".join(f"[{m.get('role', '?')}{' ' + m['name'] if m.get('name') else ''}] {m.get('content', '')}"
                     for m in messages)


def sample_rows(batch, tokenizer, prompts: int) -> list[dict]:
    """The best and the worst completion (by score; the first on ties) of
    the batch's first `prompts` groups; a group of one gives one row."""
    rows = []
    for g in range(min(prompts, int(batch.group.max()) + 1 if len(batch) else 0)):
        members = torch.nonzero(batch.group == g).squeeze(-1)
        scores = batch.scores[members]
        best, worst = int(members[scores.argmax()]), int(members[scores.argmin()])
        picked = [(best, "best")] + ([(worst, "worst")] if worst != best else [])
        text = prompt_texts(batch, tokenizer, [best])[0]
        rows += [_row(batch, i, text, which, float(batch.scores[i])) for i, which in picked]
    return rows


def val_sample_rows(batch, scores: list[float], tokenizer, limit: int) -> list[dict]:
    """The first `limit` validation completions of `batch`, scored `scores`."""
    rows = list(range(min(limit, len(batch))))
    texts = prompt_texts(batch, tokenizer, rows)
    return [_row(batch, i, texts[i], "val", scores[i]) for i in rows]
