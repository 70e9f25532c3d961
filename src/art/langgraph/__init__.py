"""Train a LangGraph agent as it is written (OpenPipe ART's `art.langgraph`).

    from art.langgraph import init_chat_model, wrap_rollout

    async def rollout(model, scenario) -> art.Trajectory:
        agent = create_react_agent(init_chat_model(model.name), tools)
        await agent.ainvoke({"messages": [...]})
        return art.Trajectory(messages_and_choices=[], reward=score(...))

    group = art.TrajectoryGroup(wrap_rollout(model, rollout)(model, s) for _ in range(4))

`init_chat_model` gives a LangChain `ChatOpenAI` talking to the rollout's ART model;
`wrap_rollout` runs the rollout under `art.capture` and fills the trajectory it returns with
what the model's calls really were (each a `Choice` with the sampler's token ids). Needs
`langchain-openai` (and `langgraph` for the graphs themselves).
"""

from __future__ import annotations

from .chat_model import init_chat_model
from .rollout import wrap_rollout

__all__ = ["init_chat_model", "wrap_rollout"]
