"""Multi-turn rollouts' other side (issue 50, docs/multi-turn.md): environments in OpenRLHF's
`AgentInstanceBase` shape, tools offered through the chat template, and the per-episode turn
logic (`Episodes`) the rollout loop calls between its generations. Users' code runs concurrently,
bounded by `sampler.multi_turn.tool_timeout_s`; its failures become observations, never a crash."""

from __future__ import annotations

from ppo_trainer.agents.environment import AgentInstanceBase, load_environment
from ppo_trainer.agents.episodes import Episodes, ResetOutcome, TurnOutcome, load_multi_turn
from ppo_trainer.agents.template import (
    check_tool_template,
    parse_tool_calls,
    render_prompt_with_tools,
    template_ignores_tools,
    tools_system_text,
)
from ppo_trainer.agents.tools import Tool, allowed_tools, load_tools

__all__ = ["AgentInstanceBase", "Episodes", "ResetOutcome", "Tool", "TurnOutcome", "allowed_tools",
           "check_tool_template", "load_environment", "load_multi_turn", "load_tools", "parse_tool_calls", "render_prompt_with_tools", "template_ignores_tools",
           "tools_system_text"]
