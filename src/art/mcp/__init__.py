"""MCP·RL: train an agent to use an MCP server's tools (ART's `art.mcp`).

    tools, resources = await list_tools_and_resources(session)       # an open mcp.ClientSession
    scenarios = await generate_scenarios(tools, resources, num_scenarios=16, generator=model)
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(mcp_rollout(model, session, s, tools=tools) for _ in range(4)) for s in scenarios),
        after_each=lambda g: ruler_score_mcp_group(g, model))
    await model.train(groups)

Nothing here imports the MCP SDK: sessions are used through their methods, and its objects are
read by field name.
"""

from art.mcp.generate_scenarios import ScenarioGenerationError, generate_scenarios
from art.mcp.rewards import ruler_score_mcp_group
from art.mcp.rollout import COMPLETE_TASK, COMPLETE_TASK_TOOL, McpScenario, mcp_rollout, system_prompt
from art.mcp.server_info import list_resources, list_tools, list_tools_and_resources
from art.mcp.types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

__all__ = [
    "COMPLETE_TASK",
    "COMPLETE_TASK_TOOL",
    "GeneratedScenario",
    "GeneratedScenarioCollection",
    "MCPResource",
    "MCPTool",
    "McpScenario",
    "ScenarioGenerationError",
    "generate_scenarios",
    "list_resources",
    "list_tools",
    "list_tools_and_resources",
    "mcp_rollout",
    "ruler_score_mcp_group",
    "system_prompt",
]
