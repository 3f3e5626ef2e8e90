"""The embedded tiny model warmed up on calculator calls: where the tool-use demonstration starts.

The shipped tiny model (tiny/arith.py) fine-tuned on whole conversations of the products task
(data/preprocess/products.py, without its system prompt):

    user:       What is 347 * 829?
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 829"}}</tool_call>
    tool:       287663
    assistant:  287663

with the loss on the assistant's tokens only (the tool message and the chat template's tokens
between turns are laid out by rollout.multiturn.continuation_ids, exactly as a rollout lays them
out). It stops once greedy conversations on a dev slice of the training pairs answer right
`target_accuracy` of the time: the model then writes the call's format, but copies the numbers
into it (and the tool's answer out of it) unreliably; GRPO with the calculator then raises both
(docs/multi-turn-tools.md). A 3-digit product is out of its reach without the tool.
The copying appears suddenly (none right until ~step 600, most calls right by ~step 720); a model
stopped at 0.3, just after, was too fragile for RL (one seed of three gained), hence 0.5.

Its weights ship inside the package (models/embedded_tools/, checked by models/shipped.py), for the
reason the tiny model's do: every machine starts from the same bytes. `posttrain tiny-model --task tools`
prints its directory; `--rebuild` runs this module's build and says whether it reproduced them.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from posttrain.data.preprocess import products
from posttrain.tiny import arith

VERSION = "tiny-qwen2-v2-tools-v1"
MAX_RESPONSE_TOKENS = 160  # a call (~87 tokens), the tool's message and the answer, with room to spare


@dataclass(frozen=True)
class ToolsSpec:
    lr: float = 2e-3
    batch_size: int = 64
    target_accuracy: float = 0.5  # greedy conversations answering right on the dev pairs
    max_steps: int = 2000
    eval_every: int = 10
    eval_below_loss: float = 0.3  # dev conversations are generated only once the loss is this low (no sooner
    dev_size: int = 64  # can one be right: the digits are not copied yet), which saves most of their cost


def conversation(tokenizer, a: int, b: int) -> tuple[list[int], list[int]]:
    """One products conversation as (token ids, labels): labels -100 except on the assistant's turns."""
    from posttrain.data.dataset import encode_prompt
    from posttrain.rollout.multiturn import continuation_ids

    eos = tokenizer.eos_token_id
    messages = [{"role": "user", "content": products.question(a, b)}]
    prompt = encode_prompt(tokenizer, messages)
    call = tokenizer.encode(products.tool_call(a, b), add_special_tokens=False) + [eos]
    between = continuation_ids(tokenizer, messages + [{"role": "assistant", "content": products.tool_call(a, b)}],
                               [{"role": "tool", "name": "calculator", "content": str(a * b)}], {}, eos)
    answer = tokenizer.encode(str(a * b), add_special_tokens=False) + [eos]
    ids = prompt + call + between + answer
    return ids, [-100] * len(prompt) + call + [-100] * len(between) + answer


def conversation_scores(model, tokenizer, pairs, tools) -> dict[str, float]:
    """Greedy conversations with the calculator on `pairs`: the share answered right ("accuracy") and
    the share whose calculator call returned the product ("tool_correct")."""
    from posttrain.data.dataset import encode_prompt
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_tools

    messages = [[{"role": "user", "content": products.question(a, b)}] for a, b in pairs]
    prompts = [encode_prompt(tokenizer, m) for m in messages]
    engine = HFRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, progress=False)
    settings = MultiTurnSettings(max_assistant_turns=2, max_response_length=MAX_RESPONSE_TOKENS,
                                 eos_token_ids=(tokenizer.eos_token_id,))
    params = SamplingParams(max_new_tokens=MAX_RESPONSE_TOKENS, do_sample=False)
    _, trajectories = rollout_with_tools(engine.generate, tokenizer, prompts, messages, params, tools,
                                         [{} for _ in pairs], settings)
    right = [t.answer.strip() == str(a * b) for t, (a, b) in zip(trajectories, pairs)]
    tool = [any(c["content"] == str(a * b) for c in t.tool_calls) for t, (a, b) in zip(trajectories, pairs)]
    return {"accuracy": sum(right) / len(pairs), "tool_correct": sum(tool) / len(pairs)}


def build_tools_model(output_dir: str | Path, seed: int = 0, spec: ToolsSpec = ToolsSpec(),
                      progress: bool = True) -> dict:
    """Fine-tune the shipped tiny model on products conversations and save it to `output_dir`. -> metadata."""
    from posttrain.tools import load_tools

    start = time.perf_counter()
    out = Path(output_dir)
    tokenizer, model = arith.warm_start(out, seed)
    train_pairs, test_pairs = products.split_pairs()  # RL's default split: the test pairs stay unseen
    dev, sft = train_pairs[:spec.dev_size], train_pairs[spec.dev_size:]
    rows = [conversation(tokenizer, a, b) for a, b in sft]
    ids, attention, labels = arith.conversation_tensors(rows, tokenizer.pad_token_id)  # [N, L] each
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    tools = load_tools(functions=["calculator"])
    step, dev_scores = 0, {"accuracy": 0.0, "tool_correct": 0.0}
    try:
        while step < spec.max_steps:
            loss = arith.sft_step(model, opt, ids, attention, labels, spec.batch_size, gen)
            step += 1
            if step % 50 == 0 and progress:
                print(f"posttrain: warming up the tiny model on calculator calls: step {step}, loss {loss:.3f}",
                      file=sys.stderr)
            if step % spec.eval_every == 0 and loss < spec.eval_below_loss:
                model.eval()
                dev_scores = conversation_scores(model, tokenizer, dev, tools)
                done = dev_scores["accuracy"] >= spec.target_accuracy
                if progress:
                    print(f"posttrain: warming up the tiny model on calculator calls: step {step}, loss "
                          f"{loss:.3f}, dev accuracy {dev_scores['accuracy']:.2f} (target "
                          f"{spec.target_accuracy}), correct calls {dev_scores['tool_correct']:.2f}", file=sys.stderr)
                if done:
                    break
        model.eval()
        test = conversation_scores(model, tokenizer, test_pairs, tools)
    finally:
        tools.close()
    model.save_pretrained(out, safe_serialization=True)
    meta = {"version": VERSION, "base": arith.VERSION, "seed": seed, "spec": asdict(spec), "sft_steps": step,
            "dev_accuracy": dev_scores["accuracy"], "dev_tool_correct": dev_scores["tool_correct"],
            "test_accuracy": test["accuracy"], "test_tool_correct": test["tool_correct"],
            "parameters": sum(p.numel() for p in model.parameters()),
            "seconds": round(time.perf_counter() - start, 1)}
    (out / "posttrain_tiny.json").write_text(json.dumps(meta, indent=2))
    return meta

