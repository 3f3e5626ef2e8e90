"""Environments for multi-turn rollouts: a class with reset(row) -> messages and step(text) -> Step, run in worker
processes with time and memory limits (envs.pool), and verl's interactions (a simulated user) as one kind of
environment (envs.interactions).

    from posttrain.envs import EnvPool, Step

    pool = EnvPool(("class", "games.guess:GuessTheNumber", {}), workers=2, timeout_s=10, memory_mb=2048)
    sessions = pool.reset(rows); steps = pool.step(sessions, texts); pool.finish(sessions); pool.close()

The modules: base (Step, what an environment returns), pool (the worker processes), interactions (verl's
interaction config and its GSM8K interaction).
"""

from posttrain.envs.base import Step, as_messages, as_step
from posttrain.envs.pool import EnvPool, InProcessEnvs, Session

__all__ = ["EnvPool", "InProcessEnvs", "Session", "Step", "as_messages", "as_step"]
