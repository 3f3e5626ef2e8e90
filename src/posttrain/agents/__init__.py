"""Agents: programs written against the OpenAI API that generate the trajectories, through an OpenAI-compatible
endpoint over the rollout engine (agents.server), one agent run per sample (agents.runner).

    from posttrain.agents import CompletionServer, rollout_with_agent
"""

from posttrain.agents.runner import rollout_with_agent
from posttrain.agents.server import CompletionServer, Session

__all__ = ["CompletionServer", "Session", "rollout_with_agent"]
