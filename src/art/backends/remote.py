"""`RemoteBackend`: the HTTP client of `art serve` (ART's `art.Backend`).

It speaks the same protocol as `LocalBackend` to `art.Model` (register, _get_step, train,
_train_model, _log, _delete_checkpoints, close), so a training script switches machines by
changing one line. It holds no model state and imports no torch: trajectories leave as JSON
(`for_logging()` dumps, Choices whole with their token ids and logprobs), rollouts go
straight to the server's OpenAI routes, and server errors come back as `art.errors`
exceptions carrying the server's message.

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
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import httpx
from pydantic_core import to_jsonable_python
from tqdm.auto import tqdm

from art.errors import (ArtValueError, BackendError, BackendUnavailableError, ContextLengthError, ModelNotFoundError,
                        StepCancelledError, StepConflictError)
from art.observability import tracing
from art.storage.layout import validate_name
from art.types import TrainConfig

API_KEY_ENV = "ART_API_KEY"


@dataclass
class TrainResult:
    step: int
    """The step now served (the checkpoint this update wrote)."""
    metrics: dict[str, float]


class RemoteBackend:
    """`RemoteBackend("http://gpu-box:7999", api_key=...)`; the key defaults to $ART_API_KEY.

    `transport` replaces the network (e.g. `httpx.ASGITransport(app)` to run the server app in
    this process); `timeout` bounds each request in seconds (loading a model or a training
    step can take minutes; the train stream sends a heartbeat line every few seconds).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:7999", api_key: str | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float = 1800.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._transport = transport
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, transport=transport,
                                         timeout=self._timeout, event_hooks={"request": [tracing.inject_headers]})
        self._openai_clients: list[httpx.AsyncClient] = []
        self._steps: dict[tuple[str, str], int] = {}  # the step last seen per model
        self._in_doubt: dict[tuple[str, str], tuple[str, int | None]] = {}  # body digest, step sent

    def __repr__(self) -> str:  # never shows the key
        return f"RemoteBackend({self.base_url!r})"

    # -- the protocol models call -----------------------------------------------------------
    async def register(self, model) -> None:
        config = model.config.model_dump() if hasattr(model.config, "model_dump") else model.config
        body = {
            "name": model.name, "project": model.project, "trainable": bool(getattr(model, "trainable", False)),
            "base_model": getattr(model, "base_model", None),
            "config": to_jsonable_python(config, serialize_unknown=True),
            "internal_config": getattr(model, "_internal_config", None),
        }
        if not body["trainable"]:
            body.update(inference_base_url=model.inference_base_url, inference_model_name=model.inference_model_name)
        info = await self._request("POST", "/art/models", body)
        if isinstance(info, dict) and isinstance(info.get("step"), int):
            self._steps[(model.project, model.name)] = info["step"]
        if not body["trainable"] and model.inference_base_url is not None:
            return  # a prompted baseline on its own endpoint: only its logs live on the server
        model.inference_base_url = f"{self.base_url}/v1"
        model.inference_api_key = self._api_key or "art-remote"
        model.inference_model_name = model.name

    async def _get_step(self, model) -> int:
        step = (await self._request("GET", _path(model, "step")))["step"]
        self._steps[(model.project, model.name)] = step
        return step

    async def train(self, model, trajectory_groups, *, config: TrainConfig | None = None,
                    _config: dict | None = None, progress: Callable[[dict], None] | None = None,
                    **options) -> TrainResult:
        """One update on the server, with a progress bar fed by its NDJSON stream; returns the
        new step and its metrics. Options as for `LocalBackend.train`. Raises StepConflictError
        when the server's step is not the one this client last saw (see the module docstring)."""
        key = (model.project, model.name)
        body = {
            "trajectory_groups": [group.for_logging() for group in trajectory_groups],
            "config": config.model_dump() if config is not None else None,
            "dev_config": dict(_config or {}),
            "options": options,
        }
        digest = hashlib.sha256(json.dumps(body, default=str, sort_keys=True).encode()).hexdigest()
        doubt = self._in_doubt.get(key)
        body["expected_step"] = doubt[1] if doubt is not None and doubt[0] == digest else self._steps.get(key)
        bar = tqdm(total=None, desc=f"train {model.name}", unit="step", leave=False)
        try:
            async with self._client.stream("POST", _path(model, "train"), **_json_body(body)) as response:
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
                    result = _on_event(event, bar)
                    if result is not None:
                        self._in_doubt.pop(key, None)
                        self._steps[key] = result.step
                        return result
        except httpx.HTTPError as exc:
            self._in_doubt[key] = (digest, body["expected_step"])
            raise BackendError(
                f"the connection to {self.base_url} broke during training ({type(exc).__name__}: {exc}); "
                "the step may still complete on the server: check `await model.get_step()` (sending the same "
                "groups again is safe: a step that did complete is not trained twice)") from exc
        finally:
            bar.close()
        self._in_doubt[key] = (digest, body["expected_step"])
        raise BackendError(f"{self.base_url} ended the training stream without a result; the step may still "
                           "complete on the server: check `await model.get_step()`")

    async def _train_model(self, model, groups, config: TrainConfig, dev_config: dict, verbose: bool = False):
        return await self.train(model, groups, config=config, _config=dev_config)

    async def cancel_training(self, model) -> bool:
        """Cancel the model's running training step on the server (it rolls back; its `train`
        call raises StepCancelledError). False when none was running."""
        return (await self._request("DELETE", _path(model, "train")))["cancelled"]

    async def _log(self, model, *, split: str, step: int, metrics: dict, groups) -> None:
        body = {"split": split, "step": step, "metrics": to_jsonable_python(metrics, serialize_unknown=True),
                "trajectory_groups": [group.for_logging() for group in groups]}
        await self._request("POST", _path(model, "log"), body)

    async def _delete_checkpoints(self, model, best_checkpoint_metric: str) -> list[int]:
        answer = await self._request("DELETE", _path(model, "checkpoints"),
                                     params={"best_checkpoint_metric": best_checkpoint_metric})
        return answer["deleted"]

    async def _list_checkpoints(self, model) -> list[int]:
        return (await self._request("GET", _path(model, "checkpoints")))["steps"]

    async def _get_history(self, model) -> list[dict]:
        return (await self._request("GET", _path(model, "metrics")))["rows"]

    def _openai_http_client(self, model) -> httpx.AsyncClient | None:
        """With a custom transport, `model.openai_client()` must use it too (for our URL only)."""
        if self._transport is None or not (model.inference_base_url or "").startswith(self.base_url):
            return None
        client = httpx.AsyncClient(transport=self._transport, timeout=self._timeout,
                                   event_hooks={"request": [tracing.inject_headers]})
        self._openai_clients.append(client)
        return client

    # -- lifecycle ------------------------------------------------------------------------
    async def close(self) -> None:
        """Close the HTTP connections. The server and its models keep running."""
        for client in [self._client, *self._openai_clients]:
            await client.aclose()
        self._openai_clients.clear()

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _request(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        try:
            response = await self._client.request(method, path, params=params,
                                                  **(_json_body(body) if body is not None else {}))
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(
                f"cannot reach the art server at {self.base_url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            _raise_for_response(response)
        return _parse(response.content, response)


def _path(model, action: str) -> str:
    project, name = validate_name(model.project, "project"), validate_name(model.name, "name")
    return f"/art/models/{project}/{name}/{action}"


def _json_body(body: Any) -> dict[str, Any]:
    # Python's json keeps every float exactly (repr round-trips) and the server reads it back.
    return {"content": json.dumps(body, default=str).encode(), "headers": {"Content-Type": "application/json"}}


def _parse(text: str | bytes, response: httpx.Response) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise BackendError(f"{response.request.method} {response.request.url}: the answer is not JSON "
                           f"(is this an art server?): {text[:200]!r}") from None


def _on_event(event: dict[str, Any], bar: tqdm) -> TrainResult | None:
    kind = event.get("type")
    if kind == "accepted":
        bar.set_description(f"train step {event['step']}")
        bar.set_postfix_str(f"{event.get('trajectories', '?')} trajectories sent")
    elif kind == "gradient_step":
        bar.set_description(f"train step {event['step']}")
        bar.total = event.get("total")
        bar.update(1)
        bar.set_postfix({k: f"{v:.4g}" for k, v in (event.get("metrics") or {}).items() if isinstance(v, float)})
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
    """One mapping from the server's answer to our error tree (the inverse of the app's)."""
    message = str(error.get("message") or f"HTTP {status}")
    code, param = error.get("code"), error.get("param")
    if status == 404 and code == "model_not_found":
        raise ModelNotFoundError(message)
    if status == 401:
        raise BackendError(f"{message} (set the key with RemoteBackend(api_key=...) or {API_KEY_ENV})")
    if status == 413:
        raise ArtValueError(message, field="trajectory_groups")
    if status == 409 and code == "step_conflict":
        raise StepConflictError(message, expected_step=error.get("expected_step"),
                                current_step=error.get("current_step"))
    if status == 409 and code == "step_cancelled":
        raise StepCancelledError(message)
    if status == 503:
        raise BackendUnavailableError(f"art server unavailable (HTTP 503): {message}")
    if 400 <= status < 500 and status != 404:
        cls = ContextLengthError if code == "context_length_exceeded" else ArtValueError
        raise cls(message, field=param)
    raise BackendError(f"art server error (HTTP {status}): {message}")
