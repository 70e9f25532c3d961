"""`ServiceBackend`: what `art.Model` calls on the backend it is registered with.

The contract sits apart from its implementation (`art.backends.adapter.ServiceAdapter`, under
`LocalBackend` and `RemoteBackend`), so `art.Model` types its backend without importing the
servers and services a backend pulls in: a model's backend is typed, not probed. (`art.Backend`
is ART's name for one of them, `RemoteBackend`, not this protocol.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import httpx

    from art.service import TrainResult
    from art.types import TrainConfig, TrainSFTConfig


class ServiceBackend(Protocol):
    """What `art.Model` calls on the backend it is registered with (`ServiceAdapter` implements it)."""

    async def register(self, model) -> None: ...

    def openai_http_client(self, model) -> httpx.AsyncClient | None:
        """The httpx client `model.openai_client()` should use (None: its own, over the network)."""
        ...

    async def get_step(self, model) -> int: ...

    async def log(
        self, model, *, split: str, step: int, metrics: dict, groups: list, scenario_ids: Iterable[str] = ()
    ) -> dict: ...

    async def train(
        self,
        model,
        trajectory_groups: Iterable,
        *,
        config: TrainConfig | None = None,
        _config: dict | None = None,
        **options: Any,
    ) -> TrainResult: ...

    async def train_sft(
        self,
        model,
        trajectories: Iterable,
        *,
        config: TrainSFTConfig | None = None,
        _config: dict | None = None,
        **options: Any,
    ) -> TrainResult: ...

    async def delete_checkpoints(self, model, best_checkpoint_metric: str = "val/reward") -> list[int]: ...
