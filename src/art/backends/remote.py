"""`RemoteBackend`: the HTTP client of `art serve` (ART's `art.Backend`).

`RemoteService` implements the service API (`art.service`) over HTTP, and `RemoteBackend` is
the same adapter over it as `LocalBackend` is over its local service, so a training script
switches machines by changing one line. It holds no model state and imports no torch:
trajectories leave as JSON (`for_logging()` dumps, Choices whole with their token ids and
logprobs) once per step (the log call after a train call names the groups it uploaded), rollouts
go straight to the server's OpenAI routes, and server errors come back as
`art.errors` exceptions carrying the server's message.

No batch is trained twice. Every train call carries `expected_step`, the step this client last
saw for the model (from register, get_step or the previous result); the server refuses another
step with a 409, raised here as `art.StepConflictError`. A call whose outcome is unknown (the
connection broke mid-step: the step may still complete on the server) is remembered with a
digest of its body: sending the same body again sends the step it was first sent for, so a
blind retry of a step that did complete gets the 409 instead of a second update, while a retry
of one that did not complete trains normally.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any, NoReturn

import httpx
from pydantic_core import to_jsonable_python
from tqdm.auto import tqdm

from art.backends.adapter import ServiceAdapter
from art.errors import ArtValueError, BackendError, BackendUnavailableError, from_wire
from art.observability import tracing
from art.observability.progress import progress_bar
from art.service import ModelKey, ModelSpec, Progress, TrainResult
from art.storage.layout import validate_name
from art.training.options import TrainOptions
from art.training.sft_options import SFTOptions

API_KEY_ENV = "ART_API_KEY"


class RemoteService:
    """The service API (`art.service`) as a client of `art serve`'s management routes.

    `transport` replaces the network (e.g. `httpx.ASGITransport(app)` to run the server app in
    this process); `timeout` bounds each request in seconds (loading a model or a training
    step can take minutes; the train stream sends a heartbeat line every few seconds).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 1800.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.transport = transport
        self.timeout = httpx.Timeout(timeout, connect=10.0)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            timeout=self.timeout,
            event_hooks={"request": [tracing.inject_headers]},
        )
        self._steps: dict[ModelKey, int] = {}  # the step last seen per model
        self._in_doubt: dict[ModelKey, tuple[str, int | None]] = {}  # body digest, step sent
        self._uploaded: dict[ModelKey, str] = {}  # digest of the groups the last train call sent

    def __repr__(self) -> str:  # never shows the key
        return f"RemoteService({self.base_url!r})"

    async def register(self, spec: ModelSpec) -> int:
        body = {**asdict(spec), "config": to_jsonable_python(spec.config, serialize_unknown=True)}
        if spec.trainable:
            del body["inference_base_url"], body["inference_model_name"]
        info = await self._request("POST", "/art/models", body)
        step = info.get("step") if isinstance(info, dict) else None
        if isinstance(step, int):
            self._steps[spec.key] = step
        return step if isinstance(step, int) else 0

    async def specs(self) -> list[ModelSpec]:
        """What `GET /art/models` lists: each model's project, name, trainable and base_model
        (its config and internal config stay on the server)."""
        return [
            ModelSpec(
                project=info["project"], name=info["name"], trainable=info["trainable"], base_model=info["base_model"]
            )
            for info in await self._request("GET", "/art/models")
        ]

    async def step(self, key: ModelKey) -> int:
        step = (await self._request("GET", _path(key, "step")))["step"]
        self._steps[key] = step
        return step

    async def train(
        self,
        key: ModelKey,
        groups: list,
        options: TrainOptions,
        *,
        expected_step: int | None = None,
        progress: Progress | None = None,
    ) -> TrainResult:
        """One update on the server, with a progress bar fed by its NDJSON stream. Without
        `expected_step`, the step this client last saw is sent (see the module docstring)."""
        payload = [group.for_logging() for group in groups]
        upload_id = _digest(payload)
        body = {"trajectory_groups": payload, "options": options.as_dict(), "upload_id": upload_id}
        result = await self._stream_update(key, "train", body, expected_step, progress)
        self._uploaded[key] = upload_id  # the server holds them for the log call that follows
        return result

    async def train_sft(
        self,
        key: ModelKey,
        trajectories: list,
        options: SFTOptions,
        *,
        expected_step: int | None = None,
        progress: Progress | None = None,
    ) -> TrainResult:
        """SFT on the server, which renders the chats with the model's own template; streamed and
        guarded against double application like `train`."""
        body = {"trajectories": [trajectory.for_logging() for trajectory in trajectories], "options": options.as_dict()}
        return await self._stream_update(key, "train_sft", body, expected_step, progress)

    async def _stream_update(
        self, key: ModelKey, action: str, body: dict, expected_step: int | None, progress: Progress | None
    ) -> TrainResult:
        """POST `body` to the model's `action` route and follow its NDJSON stream to the result."""
        digest = hashlib.sha256(json.dumps([action, body], default=str, sort_keys=True).encode()).hexdigest()
        doubt = self._in_doubt.get(key)
        if expected_step is None:
            expected_step = doubt[1] if doubt is not None and doubt[0] == digest else self._steps.get(key)
        body["expected_step"] = expected_step
        bar = progress_bar(total=None, desc=f"{action} {key[1]}", unit="step", leave=False)
        try:
            async with self._client.stream("POST", _path(key, action), **_json_body(body)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._in_doubt.pop(key, None)  # refused before anything started
                    _raise_for_response(response)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    event = _parse(line, response)
                    if progress is not None:
                        progress(event)
                    if event.get("type") == "error" and (event.get("error") or {}).get("code") != "step_conflict":
                        self._in_doubt.pop(key, None)  # the server says the step failed: nothing in doubt
                    result = _on_event(event, bar, action)
                    if result is not None:
                        self._in_doubt.pop(key, None)
                        self._steps[key] = result.step
                        return result
        except httpx.HTTPError as exc:
            self._in_doubt[key] = (digest, expected_step)
            raise BackendError(
                f"the connection to {self.base_url} broke during training ({type(exc).__name__}: {exc}); "
                "the step may still complete on the server: check `await model.get_step()` (sending the same "
                "groups again is safe: a step that did complete is not trained twice)"
            ) from exc
        finally:
            bar.close()
        self._in_doubt[key] = (digest, expected_step)
        raise BackendError(
            f"{self.base_url} ended the training stream without a result; the step may still "
            "complete on the server: check `await model.get_step()`"
        )

    async def check_training_input(self, key: ModelKey, groups: list) -> None:
        """Checked by the server when the groups arrive; nothing to ask for up front."""

    async def cancel_training(self, key: ModelKey) -> bool:
        return (await self._request("DELETE", _path(key, "train")))["cancelled"]

    async def log(
        self, key: ModelKey, *, split: str, step: int, metrics: dict, groups: list, scenario_ids: Iterable[str] = ()
    ) -> dict:
        """Groups the last train call uploaded (`model.train` logs what it trained on) are
        named by their digest instead of sent again; a server that no longer holds them gets
        them in full."""
        body = {
            "split": split,
            "step": step,
            "metrics": to_jsonable_python(metrics, serialize_unknown=True),
            "scenario_ids": list(scenario_ids),
        }
        payload = [group.for_logging() for group in groups]
        digest = _digest(payload) if payload else None
        if digest is not None and self._uploaded.get(key) == digest:
            del self._uploaded[key]
            try:
                return (await self._request("POST", _path(key, "log"), {**body, "trajectory_groups_from": digest})).get(
                    "row"
                ) or {}
            except ArtValueError as exc:
                if exc.field != "trajectory_groups_from":
                    raise
        return (await self._request("POST", _path(key, "log"), {**body, "trajectory_groups": payload})).get("row") or {}

    async def checkpoints(self, key: ModelKey) -> list[int]:
        return (await self._request("GET", _path(key, "checkpoints")))["steps"]

    async def delete_checkpoints(
        self, key: ModelKey, best_checkpoint_metric: str, keep_steps: list[int] | None = None
    ) -> list[int]:
        params: dict = {"best_checkpoint_metric": best_checkpoint_metric}
        if keep_steps is not None:
            params["keep_step"] = list(keep_steps)
        answer = await self._request("DELETE", _path(key, "checkpoints"), params=params)
        return answer["deleted"]

    async def history(self, key: ModelKey) -> list[dict]:
        return (await self._request("GET", _path(key, "metrics")))["rows"]

    async def restart_replicas(self, key: ModelKey) -> list[int]:
        return (await self._request("POST", _path(key, "replicas/restart")))["restarted"]

    async def fork_checkpoint(self, spec: ModelSpec, source: ModelKey, *, not_after_step: int | None = None) -> int:
        """The source run must be stored on the server. The model's step changes, so the step
        the next train call expects does too."""
        body = {
            "from_project": source[0],
            "from_model": source[1],
            "not_after_step": not_after_step,
            "base_model": spec.base_model,
            "config": to_jsonable_python(spec.config, serialize_unknown=True),
            "internal_config": spec.internal_config,
        }
        step = (await self._request("POST", _path(spec.key, "fork"), body))["step"]
        self._steps[spec.key] = step
        self._in_doubt.pop(spec.key, None)
        return step

    async def close(self) -> None:
        """Close the HTTP connections. The server and its models keep running."""
        await self._client.aclose()

    async def _request(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        try:
            response = await self._client.request(
                method, path, params=params, **(_json_body(body) if body is not None else {})
            )
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(
                f"cannot reach the art server at {self.base_url}: {type(exc).__name__}: {exc}"
            ) from exc
        if response.status_code >= 400:
            _raise_for_response(response)
        return _parse(response.content, response)


class RemoteBackend(ServiceAdapter):
    """`RemoteBackend("http://gpu-box:7999", api_key=...)`; the key defaults to $ART_API_KEY.
    `transport` and `timeout`: see `RemoteService`."""

    service: RemoteService

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:7999",
        api_key: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 1800.0,
    ) -> None:
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        super().__init__(RemoteService(base_url, api_key, transport=transport, timeout=timeout))
        self.base_url = self.service.base_url
        self._openai_clients: list[httpx.AsyncClient] = []

    def __repr__(self) -> str:  # never shows the key
        return f"RemoteBackend({self.base_url!r})"

    async def _endpoint(self) -> tuple[str, str]:
        return f"{self.base_url}/v1", self.service.api_key or "art-remote"

    def openai_http_client(self, model) -> httpx.AsyncClient | None:
        """With a custom transport, `model.openai_client()` must use it too (for our URL only)."""
        if self.service.transport is None or not (model.inference_base_url or "").startswith(self.base_url):
            return None
        client = httpx.AsyncClient(
            transport=self.service.transport,
            timeout=self.service.timeout,
            event_hooks={"request": [tracing.inject_headers]},
        )
        self._openai_clients.append(client)
        return client

    async def close(self) -> None:
        """Close the HTTP connections. The server and its models keep running."""
        await self.service.close()
        for client in self._openai_clients:
            await client.aclose()
        self._openai_clients.clear()


def _path(key: ModelKey, action: str) -> str:
    project, name = validate_name(key[0], "project"), validate_name(key[1], "name")
    return f"/art/models/{project}/{name}/{action}"


def _digest(payload: Any) -> str:
    """A name for a JSON payload: equal digests, equal content."""
    return hashlib.sha256(json.dumps(payload, default=str, sort_keys=True).encode()).hexdigest()


def _json_body(body: Any) -> dict[str, Any]:
    # Python's json keeps every float exactly (repr round-trips) and the server reads it back.
    return {"content": json.dumps(body, default=str).encode(), "headers": {"Content-Type": "application/json"}}


def _parse(text: str | bytes, response: httpx.Response) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise BackendError(
            f"{response.request.method} {response.request.url}: the answer is not JSON "
            f"(is this an art server?): {text[:200]!r}"
        ) from None


def _bar_label(action: str, step: int) -> str:
    """Named as the server's bar is (`art.service.update`): an RL step by the step history files
    its rows under (the one it trains from; events carry the step it writes), SFT by the step it writes."""
    return f"train step {step - 1}" if action == "train" else f"sft step {step}"


def _on_event(event: dict[str, Any], bar: tqdm, action: str = "train") -> TrainResult | None:
    kind = event.get("type")
    if kind == "accepted":
        bar.set_description(_bar_label(action, event["step"]))
        bar.set_postfix_str(f"{event.get('trajectories', '?')} trajectories sent")
    elif kind == "gradient_step":
        bar.set_description(_bar_label(action, event["step"]))
        bar.total = event.get("total")
        bar.set_postfix(
            {k: f"{v:.4g}" for k, v in (event.get("metrics") or {}).items() if isinstance(v, float)}, refresh=False
        )
        bar.update(1)
    elif kind == "heartbeat":
        bar.refresh()
    elif kind == "result":
        return TrainResult(step=int(event["step"]), metrics=event.get("metrics") or {})
    elif kind == "error":
        _raise_error(event.get("error") or {}, int((event.get("error") or {}).get("status", 500)))
    return None


def _raise_for_response(response: httpx.Response) -> NoReturn:
    try:
        error = json.loads(response.content).get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, dict):
        text = response.text[:300].strip() or response.reason_phrase
        where = f"{response.request.method} {response.request.url.path}"
        error = {"message": f"{where}: HTTP {response.status_code}: {text}"}
    _raise_error(error, response.status_code)


def _raise_error(error: dict[str, Any], status: int) -> NoReturn:
    """The server's answer as our error tree (`art.errors.from_wire`, the inverse of the app's
    mapping), worded for a client of `art serve`."""
    message = str(error.get("message") or f"HTTP {status}")
    if status == 401:  # the key check in front of every route
        raise BackendError(f"{message} (set the key with RemoteBackend(api_key=...) or {API_KEY_ENV})")
    if status == 413:  # the body bound: what grows is the trajectories
        raise ArtValueError(message, field="trajectory_groups")
    exc = from_wire(status, error)
    if isinstance(exc, BackendUnavailableError):
        raise BackendUnavailableError(f"art server unavailable (HTTP 503): {message}")
    if type(exc) is BackendError:  # no error the server named: say where it came from
        raise BackendError(f"art server error (HTTP {status}): {message}")
    raise exc
