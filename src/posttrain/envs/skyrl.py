"""SkyRL-gym's environments (`pip install posttrain[envs]`: skyrl-gym) as posttrain environments.

    rollout.multi_turn.environment=posttrain.envs.skyrl:SkyRLGym
    rollout.multi_turn.environment_kwargs.id=gsm8k_multi_turn      # a skyrl_gym registry id, or pkg.module:EnvClass
    rollout.multi_turn.environment_kwargs.env_config={...}         # the environment's env_config (optional)
    rollout.multi_turn.environment_kwargs.max_turns=3              # handed on in extras (optional)

A SkyRL environment is made per conversation as SkyRL makes it: `skyrl_gym.make(id, env_config=...,
extras={"reward_spec": row's reward_model, "extra_info": row's extra_info, ...})`; its `init(prompt)` gives the
first messages, its `step(text)` the observations, reward and done, and its `get_metrics()` at the end are logged
as env/<key>/mean. Rows in verl's layout already carry what SkyRL's reward_spec holds (ground_truth).
"""

from __future__ import annotations

from posttrain.envs.base import Step


class SkyRLGym:
    def __init__(self, id: str = "gsm8k", env_config: dict | None = None, **extras):
        try:
            import skyrl_gym
        except ModuleNotFoundError:
            raise ModuleNotFoundError("SkyRL-gym's environments need the skyrl-gym package: pip install "
                                      "'posttrain[envs]' (or pip install skyrl-gym)") from None
        self.make, self.id, self.env_config, self.extras = skyrl_gym.make, id, dict(env_config or {}), extras
        self.env = None

    def reset(self, row: dict) -> list[dict]:
        extras = {"reward_spec": dict(row.get("reward_model") or {}), "extra_info": dict(row.get("extra_info") or {}),
                  **self.extras}
        self.env = self.make(self.id, env_config=self.env_config, extras=extras)
        prompt, _ = self.env.init([dict(m) for m in row["prompt"]])
        return prompt

    def step(self, action: str) -> Step:
        out = self.env.step(action)
        info = dict(out.get("metadata") or {})
        if out["done"]:  # the episode's own metrics, once, with its last turn
            info.update(self.env.get_metrics() or {})
        return Step(out.get("observations") or [], out["reward"], out["done"], info)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
