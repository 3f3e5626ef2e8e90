"""Sampling: n responses per prompt from the actor's generate verb, one turn or conversations (tools, an
environment or agent); shared by the step (rollouts.py) and validation. Nothing here scores."""

from __future__ import annotations

from posttrain.driver.batch import RolloutBatch
from posttrain.driver.env_side import EnvSide
from posttrain.rollout.base import SamplingParams, decode_responses
from posttrain.data.images import decode_image, vision_inputs
from posttrain.errors import DataError
from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_tools
from posttrain.rollout.vision import ImagePrompt, end_at_placeholders, placeholder_ids
from posttrain.tools import ToolSet, load_tools


def sample(engine, tokenizer, items, params: SamplingParams, tools: ToolSet | None = None,
           multi_turn: MultiTurnSettings | None = None, env: EnvSide | None = None, processor=None
           ) -> tuple[RolloutBatch, list | None]:
    """params.n responses per prompt of `items` (PromptItems) from `engine` (the actor's generate verb) as
    a RolloutBatch with their texts; with `tools` or an `env`, conversations (rollout.multiturn): the texts are
    the final answers and each row's extra_info gains its turns, tool calls, messages and turn scores, which the
    reward function sees. A conversation whose environment failed trains nothing (its response mask is zero).
    `processor`: a vision-language model's: each prompt goes to the engine with its images (`vision_prompts`),
    the batch's rows carry their image tensors, and a response that samples an image placeholder ends before
    it. -> (batch, the trajectories or None)."""
    prompts = vision_prompts(items, processor) if processor is not None else [it.prompt_ids for it in items]
    if processor is not None and (env is not None or tools is not None) and any(p.vision for p in prompts):
        raise DataError("multi-turn rollouts (tools, environments, agents) do not take images yet: train on rows "
                        "without images, or without tools and environments")
    if env is not None:
        out, trajectories = env.converse(engine, tokenizer, items, params, multi_turn)
        texts = [t.answer for t in trajectories]
    elif tools is not None:
        out, trajectories = rollout_with_tools(engine.generate, tokenizer, prompts, [it.messages for it in items],
                                               params, tools, [tool_context(it) for it in items], multi_turn)
        texts = [t.answer for t in trajectories]
    else:
        out, trajectories = engine.generate(prompts, params), None
        if processor is not None:
            end_at_placeholders(out, placeholder_ids(processor), tokenizer.pad_token_id)
        texts = decode_responses(tokenizer, out)
    batch = RolloutBatch.from_rollout(out, params.n, [it.data_source for it in items],
                                      [it.ground_truth for it in items], [it.extra_info for it in items], texts,
                                      vision=[p.vision for p in prompts] if processor is not None else None)
    if trajectories:
        batch.extra_info = [{**(info or {}), "turns": t.turns, "tool_calls": t.tool_calls, "messages": t.messages,
                             **({"turn_scores": t.rewards, "env_error": t.env_error} if env is not None else {})}
                            for info, t in zip(batch.extra_info, trajectories)]
    return batch, trajectories


def vision_prompts(items, processor) -> list[ImagePrompt]:
    """The engine's prompts of `items` for a vision-language model: each one's token ids with its images
    decoded and their tensors (the processor's, made here each time: a dataset holds its images undecoded)."""
    out = []
    for it in items:
        where = f"row {it.index}"
        images = [decode_image(img, f"{where} image {k}") for k, img in enumerate(getattr(it, "images", None) or [])]
        out.append(ImagePrompt(it.prompt_ids, vision_inputs(processor, images, where) if images else {}, images))
    return out


def tool_context(item) -> dict:
    """What a prompt's tools may see (an answer checker: the ground truth)."""
    return {"ground_truth": item.ground_truth, "extra_info": item.extra_info, "data_source": item.data_source}


def multi_turn_metrics(trajectories) -> dict[str, float]:
    """Turns and tool use of a step's samples: per sample means, the share that called a tool, errors
    (malformed calls, unknown tools, failed or timed-out tools), generated vs tool tokens."""
    k = max(len(trajectories), 1)
    return {"multi_turn/turns/mean": sum(t.turns for t in trajectories) / k,
            "multi_turn/tool_calls/mean": sum(len(t.tool_calls) + t.malformed for t in trajectories) / k,
            "multi_turn/tool_use_ratio": sum(1 for t in trajectories if t.tool_calls or t.malformed) / k,
            "multi_turn/tool_errors": float(sum(t.tool_errors for t in trajectories)),
            "multi_turn/generated_tokens/mean": sum(t.generated_tokens for t in trajectories) / k,
            "multi_turn/tool_tokens/mean": sum(t.tool_tokens for t in trajectories) / k,
            "multi_turn/max_turns_ratio": sum(1 for t in trajectories if t.ended == "max_turns") / k}



def load_tool_use(tool_config_path: str | None, functions: list[str] | None, timeout_s: float, *,
                  max_assistant_turns: int, max_tool_response_length: int, max_response_length: int,
                  eos_token_ids, template_kwargs: dict | None = None,
                  in_process: bool = False) -> tuple[ToolSet, MultiTurnSettings]:
    """The tools a model may call (tools.load_tools: a verl tool config file, function specs) and the
    multi-turn rollout's settings (`posttrain train` and `posttrain eval` both make them here). The chat
    template's arguments (`template_kwargs`) gain the tools' schemas as tools=, which templates with tool
    support render into the system prompt: prompts are encoded with settings.template_kwargs too.
    in_process (trainer.debug): function tools run in this process (tools.load_tools)."""
    tools = load_tools(tool_config_path=tool_config_path, functions=functions, timeout_s=timeout_s,
                       in_process=in_process)
    settings = MultiTurnSettings(max_assistant_turns=max_assistant_turns,
                                 max_tool_response_length=max_tool_response_length,
                                 max_response_length=max_response_length,
                                 template_kwargs={**(template_kwargs or {}), "tools": tools.schemas},
                                 eos_token_ids=tuple(eos_token_ids))
    return tools, settings
