"""What MCP·RL passes around (ART's names): a server's tools and resources as plain data, and the
tasks `generate_scenarios` writes for them.

Plain dataclasses, so scenarios can be saved as JSON, split and filtered without an MCP SDK
installed; `from_mcp` reads the SDK's own objects (2.x snake_case or 1.x camelCase fields).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from art.errors import ArtValueError
from art.numeric import is_int

MIN_DIFFICULTY, MAX_DIFFICULTY = 1, 5


def field_of(obj: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` that `obj` (an SDK object or a dict) has and is not None. On a
    pydantic object only declared fields are read: the camelCase aliases that some libraries
    (fastmcp) add to the SDK 2.x types warn when read."""
    if isinstance(obj, dict):
        values = [obj.get(n) for n in names if n in obj]
    else:
        declared = getattr(type(obj), "model_fields", None)
        values = [getattr(obj, n, None) for n in names if not declared or n in declared]
    return next((value for value in values if value is not None), default)


@dataclass
class MCPTool:
    """A tool an MCP server offers: its name, what it does, its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        return cls(
            name=data.get("name", ""),
            description=data.get("description") or "",
            parameters=data.get("parameters") or {},
        )

    @classmethod
    def from_mcp(cls, tool: Any) -> MCPTool:
        """From an MCP SDK `Tool` (or its dict): `parameters` is its input schema."""
        return cls(
            name=field_of(tool, "name", default=""),
            description=field_of(tool, "description", default=""),
            parameters=dict(field_of(tool, "input_schema", "inputSchema", "parameters", default={})),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_openai(self) -> dict[str, Any]:
        """The tool as an OpenAI chat-completions `tools` entry."""
        parameters = self.parameters or {"type": "object", "properties": {}}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description or f"MCP tool {self.name}",
                "parameters": parameters,
            },
        }


@dataclass
class MCPResource:
    """A resource an MCP server offers (read with `session.read_resource(uri)`)."""

    uri: str
    name: str
    description: str
    mime_type: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        return cls(
            uri=str(data.get("uri", "")),
            name=data.get("name", ""),
            description=data.get("description") or "",
            mime_type=data.get("mimeType") or data.get("mime_type"),
        )

    @classmethod
    def from_mcp(cls, resource: Any) -> MCPResource:
        return cls(
            uri=str(field_of(resource, "uri", default="")),
            name=field_of(resource, "name", default=""),
            description=field_of(resource, "description", default=""),
            mime_type=field_of(resource, "mime_type", "mimeType"),
        )

    def to_dict(self) -> dict[str, Any]:
        data = {"uri": self.uri, "name": self.name, "description": self.description}
        if self.mime_type:
            data["mimeType"] = self.mime_type
        return data


@dataclass
class GeneratedScenario:
    """One task for the agent, rated from 1 (one tool call) to 5 (a long multi-step analysis)."""

    task: str
    difficulty: int

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task.strip():
            raise ArtValueError(f"a scenario's task must be a non-empty string, got {self.task!r}", "task")
        if not is_int(self.difficulty) or not MIN_DIFFICULTY <= self.difficulty <= MAX_DIFFICULTY:
            raise ArtValueError(
                f"difficulty must be an integer from {MIN_DIFFICULTY} to {MAX_DIFFICULTY}, got {self.difficulty!r}",
                "difficulty",
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        return cls(task=data["task"], difficulty=data["difficulty"])

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}

    def preview(self, max_length: int = 120) -> str:
        return self.task if len(self.task) <= max_length else self.task[:max_length].rstrip() + "…"


class GeneratedScenarioCollection:
    """Scenarios with ART's helpers: JSON round trips, shuffle, split, filter, summaries."""

    def __init__(self, scenarios: list[GeneratedScenario]) -> None:
        self.scenarios = list(scenarios)

    @classmethod
    def from_dicts(cls, data: list[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, text: str) -> GeneratedScenarioCollection:
        """From `{"scenarios": [...]}` (what `to_json` writes) or a bare list."""
        data = json.loads(text)
        items = data.get("scenarios") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ArtValueError("expected a JSON list of scenarios or an object with a 'scenarios' list", "scenarios")
        return cls.from_dicts(items)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [scenario.to_dict() for scenario in self.scenarios]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"scenarios": self.to_dicts()}, indent=indent)

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    def __getitem__(self, index):
        return self.scenarios[index]

    def shuffle(self, seed: int | None = None) -> GeneratedScenarioCollection:
        """A shuffled copy (this collection is left as it is)."""
        scenarios = list(self.scenarios)
        (random.Random(seed) if seed is not None else random).shuffle(scenarios)
        return GeneratedScenarioCollection(scenarios)

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection, GeneratedScenarioCollection]:
        """The first `train_size` scenarios and the rest (shuffle first for a random split)."""
        if not 0 <= train_size <= len(self.scenarios):
            raise ArtValueError(
                f"train_size ({train_size}) must be between 0 and the number of scenarios ({len(self.scenarios)})",
                "train_size",
            )
        return (
            GeneratedScenarioCollection(self.scenarios[:train_size]),
            GeneratedScenarioCollection(self.scenarios[train_size:]),
        )

    def filter_by_difficulty(
        self, min_difficulty: int = MIN_DIFFICULTY, max_difficulty: int = MAX_DIFFICULTY
    ) -> GeneratedScenarioCollection:
        return GeneratedScenarioCollection(
            [s for s in self.scenarios if min_difficulty <= s.difficulty <= max_difficulty]
        )

    def get_difficulty_distribution(self) -> Counter:
        return Counter(s.difficulty for s in self.scenarios)

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        for i, scenario in enumerate(self.scenarios[:n], 1):
            print(f"   {i}. {scenario.preview(max_task_length)}  (difficulty {scenario.difficulty}/5)")

    def print_difficulty_distribution(self) -> None:
        counts = self.get_difficulty_distribution()
        print("Difficulty distribution:")
        for difficulty in range(MIN_DIFFICULTY, MAX_DIFFICULTY + 1):
            print(f"   {difficulty}/5: {counts.get(difficulty, 0):3d}  {'█' * min(counts.get(difficulty, 0), 30)}")

    def get_summary(self) -> dict[str, Any]:
        n = len(self.scenarios)
        return {
            "total_scenarios": n,
            "difficulty_distribution": dict(self.get_difficulty_distribution()),
            "avg_difficulty": sum(s.difficulty for s in self.scenarios) / n if n else 0,
            "avg_task_length": sum(len(s.task) for s in self.scenarios) / n if n else 0,
        }
