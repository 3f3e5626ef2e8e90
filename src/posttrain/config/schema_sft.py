"""posttrain sft's own data dataclasses (the rest of its keys are data.* and actor.*, shared with RL)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MultiturnSFTConfig:
    """posttrain sft: rows that are whole conversations (verl's data.multiturn.*)."""

    enable: bool = False
    messages_key: str = "messages"  # the column of {role, content} messages; every assistant turn is learned
    tools_key: str = "tools"  # a column of tool schemas handed to the chat template (when the row has one)
    enable_thinking_key: str = "enable_thinking"  # a column of true/false handed to the template as enable_thinking
