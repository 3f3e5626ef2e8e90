"""verl's interactions (a simulated user between the model's turns) as an environment.

verl's `rollout.multi_turn.interaction_config_path` names a YAML file:

    interaction:
      - name: gsm8k                                                    # rows pick it by extra_info.interaction_kwargs.name
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

and each row's `extra_info.interaction_kwargs` ({name, query, ground_truth, ...}) starts its conversation.
An interaction class has verl's methods (async or not): `start_interaction(instance_id, **kwargs)`,
`generate_response(instance_id, messages, **kwargs) -> (done, text, turn_score, info)`, and
`finalize_interaction(instance_id)`; its text becomes a user message. InteractionEnv drives one conversation
through those methods as reset/step. verl's own GSM8K interaction is built in (Gsm8kInteraction below: "correct"
ends the conversation, "incorrect" asks the model to try again); any other class_name is imported, so a user's
class written for verl runs unchanged (without verl installed, if it does not import verl itself).

The trajectory's score stays the reward function's (verl's semantics); the turns' scores reach it as
extra_info["turn_scores"] and are logged (env/turn_reward/mean).
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from pathlib import Path

from posttrain.envs.base import Step
from posttrain.errors import ConfigError
from posttrain.rewards import gsm8k
from posttrain.files.yamlfile import read_yaml

GSM8K = "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
FORMAT = "interaction: [{name: ..., class_name: pkg.module.Class, config: {...}}]"


class Gsm8kInteraction:
    """verl's GSM8K interaction: the last assistant message is scored with the GSM8K reward ("####" answers,
    strict); 1.0 ends the conversation ("Your response is correct!"), anything else asks for another try."""

    def __init__(self, config: dict):
        self.config, self.name = config, config.get("name", "gsm8k")
        self._answers: dict[str, dict] = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._answers[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self._answers[instance_id]
        state["response"] = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"),
                                 "")
        score = await self.calculate_score(instance_id)
        if score == 1.0:
            return True, "Your response is correct!", score, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", score, {}

    async def calculate_score(self, instance_id, **kwargs) -> float:
        state = self._answers[instance_id]
        return gsm8k.compute_score(state["response"], str(state["ground_truth"]), method="strict", format_score=0.0,
                                   score=1.0)

    async def finalize_interaction(self, instance_id, **kwargs) -> None:
        self._answers.pop(instance_id, None)


BUILT_IN = {GSM8K: Gsm8kInteraction, "posttrain.envs.interactions.Gsm8kInteraction": Gsm8kInteraction}


def read_interaction_config(path: str) -> list[dict]:
    """verl's interaction config file: [{name, class_name, config}], names filled in as verl does (the class name
    without 'Interaction', lower-cased). ConfigError naming the file and the fix."""
    where = f"interaction config '{path}'"
    if not Path(path).is_file():
        raise ConfigError(f"{where} does not exist; give rollout.multi_turn.interaction_config_path an existing file")
    data = read_yaml(Path(path), "interaction config")
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where} has no `interaction:` list; write it as {FORMAT}")
    out, names = [], set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str) or not e["class_name"].strip():
            raise ConfigError(f"{where}: entry {i} has no class_name; write it as {FORMAT}")
        config = e.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: entry {i}'s config is a {type(config).__name__}; give a mapping or leave it out")
        cls = e["class_name"].strip()
        short = cls.rpartition(".")[2].rpartition(":")[2]
        name = e.get("name") or (short[:-len("Interaction")] if short.endswith("Interaction") else short).lower()
        if name in names:
            raise ConfigError(f"{where}: two interactions are named '{name}'; give each its own name")
        names.add(name)
        out.append({"name": str(name), "class_name": cls, "config": {**config, "name": str(name)}})
    return out


def interaction_class(class_name: str):
    """The class for a class_name: posttrain's built-in for verl's GSM8K one, else the import (pkg.module.Class,
    pkg.module:Class or path/file.py:Class)."""
    from posttrain.tools.functions import import_function

    if class_name in BUILT_IN:
        return BUILT_IN[class_name]
    if class_name.startswith("verl.interactions."):
        try:
            return import_function(class_name, "interaction class", want_class=True)
        except ConfigError:
            raise ConfigError(f"interaction class '{class_name}' is verl's and verl is not importable here; posttrain "
                              f"has {GSM8K} built in, or give your own class (pkg.module.Class)") from None
    return import_function(class_name, "interaction class", want_class=True)


class Interactions:
    """The interactions of a config file, built once per process; new(row) -> an InteractionEnv."""

    def __init__(self, entries: list[dict]):
        self.by_name = {e["name"]: interaction_class(e["class_name"])(config=e["config"]) for e in entries}
        self.loop = asyncio.new_event_loop()

    def new(self) -> InteractionEnv:
        return InteractionEnv(self)

    def run(self, value):
        """A method's result: awaited when it is a coroutine (verl's are async), as is otherwise."""
        return self.loop.run_until_complete(value) if inspect.isawaitable(value) else value


class InteractionEnv:
    """One conversation with a verl interaction, as reset/step."""

    def __init__(self, interactions: Interactions):
        self.interactions = interactions
        self.instance_id = None

    def reset(self, row: dict) -> list[dict]:
        kwargs = dict((row.get("extra_info") or {}).get("interaction_kwargs") or {})
        name = kwargs.get("name")
        if name not in self.interactions.by_name:
            known = ", ".join(self.interactions.by_name)
            if name is None and len(self.interactions.by_name) == 1:
                name = known  # one interaction: rows need not name it
            else:
                raise ValueError(f"the row's extra_info.interaction_kwargs.name is {name!r}; the interactions are: "
                                 f"{known} (verl's rows name theirs)")
        kwargs.setdefault("ground_truth", (row.get("reward_model") or {}).get("ground_truth"))
        self.kwargs, self.interaction = kwargs, self.interactions.by_name[name]
        start = {k: v for k, v in kwargs.items() if k != "name"}
        self.instance_id = self.interactions.run(self.interaction.start_interaction(None, **start)) or str(uuid.uuid4())
        self.messages = [dict(m) for m in row["prompt"]]
        return self.messages

    def step(self, action: str) -> Step:
        self.messages.append({"role": "assistant", "content": action})
        kwargs = {k: v for k, v in self.kwargs.items() if k != "name"}
        done, text, score, info = self.interactions.run(
            self.interaction.generate_response(self.instance_id, list(self.messages), **kwargs))
        reply = {"role": "user", "content": str(text)}
        self.messages.append(reply)
        return Step([reply], float(score or 0.0), bool(done), dict(info or {}))

    def close(self) -> None:
        if self.instance_id is not None:
            finalize = self.interaction.finalize_interaction
            takes_id = len(inspect.signature(finalize).parameters) > 0
            self.interactions.run(finalize(self.instance_id) if takes_id else finalize())
            self.instance_id = None
