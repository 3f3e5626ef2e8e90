"""The other side of multi-turn rollouts when it is not tools: an environment (rollout.multi_turn.environment,
or verl's interaction_config_path: posttrain.envs, in worker processes) or an agent program
(rollout.multi_turn.agent: posttrain.agents, through the OpenAI-compatible endpoint). generation.sample
calls `converse`; the step scores with `needs_rule` / `scores`, and logs `metrics`.

Scores (rollout.multi_turn.reward_from): env, the sum of an environment's turn rewards, or the number an agent
returned (an agent that returned None: the reward function's score of its last answer); rule, the reward function
on the last answer; sum, both. A conversation whose environment or agent failed trains nothing (its response mask
is zero) and is counted (env/num_errors, num_timeouts, num_crashes).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from posttrain.agents import CompletionServer, rollout_with_agent
from posttrain.envs import EnvPool
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_env


def env_row(item) -> dict:
    """What an environment's reset(row) or an agent sees: the row as verl writes it."""
    return {"prompt": item.messages, "data_source": item.data_source, "extra_info": item.extra_info,
            "reward_model": {"ground_truth": item.ground_truth}}


@dataclass
class EnvSide:
    """An environment pool, or an agent function and its endpoint (started on first use, over the engine it is
    handed), and where a conversation's score comes from."""

    pool: EnvPool | None = None
    reward_from: str = "env"
    agent: Callable | None = None
    agent_workers: int = 64
    agent_timeout_s: float = 600.0
    model_name: str = "policy"
    server: CompletionServer | None = None
    errors: dict = field(default_factory=dict)  # an agent's failures by kind (a pool counts its own)

    def converse(self, engine, tokenizer, items, params: SamplingParams, settings: MultiTurnSettings):
        """params.n conversations per item -> (RolloutOutput, trajectories), failed ones masked out."""
        rows = [env_row(it) for it in items]
        if self.agent is not None:
            if self.server is None:
                self.server = CompletionServer(engine.generate, tokenizer, settings, self.model_name)
            self.server.generate = engine.generate  # this call's engine (validation's may not be the step's)
            self.server.defaults = params  # what a request does not set: the run's sampling (or validation's)
            out, trajectories = rollout_with_agent(self.server, self.agent, rows, params.n, self.agent_workers,
                                                   self.agent_timeout_s, [it.prompt_ids for it in items], self.errors)
        else:
            out, trajectories, sessions = rollout_with_env(engine.generate, tokenizer, [it.messages for it in items],
                                                           params, self.pool, rows, settings)
            self.pool.finish(sessions)
        failed = torch.tensor([t.env_error is not None for t in trajectories], dtype=torch.bool)
        out.response_mask = out.response_mask.masked_fill(failed.unsqueeze(-1), 0)
        return out, trajectories

    def needs_rule(self, trajectories) -> bool:
        """Whether the reward function must score these conversations too."""
        return self.reward_from != "env" or any(t.rewards is None for t in trajectories)

    def scores(self, rule: torch.Tensor, trajectories) -> torch.Tensor:
        """[N] the conversations' scores from the reward function's (`rule`) as reward_from says."""
        if self.reward_from == "rule":
            return rule
        own = torch.tensor([float(sum(t.rewards)) if t.rewards is not None else float("nan") for t in trajectories])
        if self.reward_from == "env":
            return torch.where(torch.isnan(own), rule, own)
        return rule + torch.nan_to_num(own, nan=0.0)

    def metrics(self, trajectories, prefix: str = "env/") -> dict[str, float]:
        """Turns, reward, how the conversations ended, failures since the last call, and the mean of every
        number the environment's info held."""
        k = max(len(trajectories), 1)
        m = {f"{prefix}turns/mean": sum(t.turns for t in trajectories) / k,
             f"{prefix}reward/mean": sum(sum(t.rewards or []) for t in trajectories) / k,
             f"{prefix}success_ratio": sum(1 for t in trajectories if sum(t.rewards or []) > 0) / k,
             f"{prefix}done_ratio": sum(1 for t in trajectories if t.ended in ("done", "answer")) / k,
             f"{prefix}max_turns_ratio": sum(1 for t in trajectories if t.ended == "max_turns") / k,
             f"{prefix}length_ratio": sum(1 for t in trajectories if t.ended == "length") / k,
             f"{prefix}failed_ratio": sum(1 for t in trajectories if t.env_error is not None) / k}
        errors = self.pool.errors if self.pool is not None else self.errors
        for kind, name in (("error", "num_errors"), ("timeout", "num_timeouts"), ("crash", "num_crashes")):
            m[f"{prefix}{name}"] = float(errors.pop(kind, 0))
        infos = defaultdict(list)
        for t in trajectories:
            for info in t.infos:
                for key, value in info.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                        infos[key].append(float(value))
        m.update({f"{prefix}{key}/mean": sum(v) / len(v) for key, v in infos.items()})
        return m

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.server is not None:
            self.server.close()
            self.server = None
