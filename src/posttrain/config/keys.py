"""posttrain's keys that only a feature reads: set while it is off, validation names them "set, but unused"
(validate.py), and `--help-config` says so beside each (posttrain/help_config.py): one list, so the help and the
warning agree. verl's keys that posttrain's schema does not hold are its dialect's (dialects/verl/keys.py).
"""

from __future__ import annotations

# set to anything but their default, these are named in one warning line as unused
LORA_ONLY_KEYS = ("model.lora_alpha", "model.target_modules", "model.exclude_modules", "model.lora_dropout",
                  "rollout.lora_sync")

SFT_ONLY_KEYS = ("data.response_key", "data.prompt_dict_keys", "data.response_dict_keys", "data.max_length",
                 "data.multiturn.enable", "data.multiturn.messages_key", "data.multiturn.tools_key",
                 "data.multiturn.enable_thinking_key", "data.only_last_turn", "data.custom_chat_template")
