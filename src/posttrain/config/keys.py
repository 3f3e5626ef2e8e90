"""What happens to posttrain's keys that it takes but does not simply honour, as `--help-config` says it
(posttrain/help_config.py prints it, beside each dialect's lines on its own keys).

LORA_ONLY_KEYS and SFT_ONLY_KEYS are also what validation names as "set, but unused" (validate.py): one list, so
the help and the warning agree; verl's keys that posttrain's schema does not hold are its dialect's
(dialects/verl/keys.py: READ, STATUS).
"""

from __future__ import annotations

from posttrain.config.schema_rollout import VLLM_SETTINGS

# set to anything but their default, these are named in one warning line as unused
LORA_ONLY_KEYS = ("model.lora_alpha", "model.target_modules", "model.exclude_modules", "model.lora_dropout",
                  "rollout.lora_sync")

SFT_ONLY_KEYS = ("data.response_key", "data.prompt_dict_keys", "data.response_dict_keys", "data.max_length",
                 "data.multiturn.enable", "data.multiturn.messages_key", "data.multiturn.tools_key",
                 "data.multiturn.enable_thinking_key", "data.only_last_turn", "data.custom_chat_template")

# What happens to a key, as --help-config shows it; every key not named here is honoured.
ENGINE = "vLLM's engine (named unused on hf)"
KEY_STATUS = {**{f"rollout.{k}": ENGINE for k in (*VLLM_SETTINGS, "free_cache_engine", "engine_kwargs")},
              "rollout.mode": "async: named unused", "data.image_key": "rows with images refused",
              "data.seed": "null: trainer.seed's",
              **{k: "posttrain sft (named unused by posttrain train)" for k in SFT_ONLY_KEYS},
              "reward.model.input_tokenizer": "the policy's tokenizer decodes responses either way",
              "reward.reward_manager": "posttrain scores in worker processes whichever",
              **{k: "with model.lora_rank > 0 (without: named unused)" for k in LORA_ONLY_KEYS},
              "profiler.tool": "npu: torch's profiler instead", "profiler.global_tool_config": "named unused",
              "profiler.torch_memory.stack_depth": "named unused (torch records whole stacks)",
              **{f"profiler.{r}.{k}": "the loop's process counts as rank 0"
                 for r in ("actor", "ref", "rollout", "critic") for k in ("ranks", "all_ranks")},
              **{f"profiler.{r}.tool_config": "<tool>.discrete, <torch|npu>.contents read; the rest named unused"
                 for r in ("actor", "ref", "rollout", "critic")}}

