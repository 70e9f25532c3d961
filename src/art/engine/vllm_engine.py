"""`VLLMEngine`: the `ManagedEngine` protocol over a vLLM server process (`art.engine.vllm_process`).

Token in, token out: the server renders chats itself, and this engine sends prompt token ids to
vLLM's token-level route (`POST /inference/v1/generate`, `output_mode="tokens"`), which answers
with the exact sampled ids and per-token logprobs of the raw distribution (`logprobs_mode=
"raw_logprobs"`, which `art.service.engines` sets: temperature 1, as our engine and the trainer
compute them).
Text is decoded here with the same tokenizer and stop-string cut as our engine, so both engines
answer alike. Sampling fields map one to one to vLLM's `SamplingParams`; a grammar (llguidance's,
from `art.server.structured_output`) goes to vLLM's structured outputs, whose backend is started
as "guidance" (llguidance, the library ours uses).

Weights: each step's LoRA checkpoint is loaded as `name@step` (`/v1/load_lora_adapter`) and
becomes the live name; older ones are unloaded beyond `keep_adapters` once no request uses them,
and an older checkpoint asked for by name is loaded on demand. A fully fine-tuned model restarts
the server on the step's checkpoint. vLLM's weights are its own process's, so a training step
never needs to pause it; with vLLM's sleep mode on (`enable_sleep_mode`, CUDA only) an idle
server sleeps (level 1) through each training step and wakes after, so the trainer gets its
GPU memory back, while one with requests in flight (`PipelineTrainer`) stays awake.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from art.engine.base import AdapterRef, Completion, FinishReason, ManagedEngine, SampledTokens, SamplingParams
from art.engine.grammar import Grammars
from art.engine.stopping import first_stop
from art.engine.vllm_process import VLLMServer
from art.errors import ArtValueError, BackendError, BackendUnavailableError

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 600.0
"""Loading an adapter, sleeping and waking: generous, a large adapter loads for a while."""
GATE_POLL_S = 0.02
EXIT_WAIT_S = 5.0
"""How long a broken connection waits for the server's exit, to say how it ended."""


def structured_outputs(grammar: str) -> dict:
    """vLLM's `structured_outputs` for one of our llguidance grammars: its Lark text as
    `grammar`, or its JSON schema as `json` (the schema's own `x-guidance` options kept)."""
    try:
        parts = json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError):
        return {"grammar": grammar}  # Lark text already
    if len(parts) == 1 and "lark_grammar" in parts[0]:
        return {"grammar": parts[0]["lark_grammar"]}
    if len(parts) == 1 and "json_schema" in parts[0]:
        return {"json": parts[0]["json_schema"]}
    raise ArtValueError(
        "this grammar has several parts, which vLLM's structured outputs cannot take as one; use engine='ours' for it",
        field="response_format",
    )


def sampling_params(params: SamplingParams) -> dict:
    """Our `SamplingParams` as vLLM's, every field given (so no server default applies)."""
    body = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p,
        "max_tokens": params.max_tokens,
        "stop": list(params.stop),
        "seed": params.seed,
        "ignore_eos": params.ignore_eos,
        # One more than asked: the token route lists the sampled token first within that many.
        "logprobs": params.top_logprobs + 1 if params.top_logprobs else 0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "skip_special_tokens": True,
    }
    if params.grammar is not None:
        body["structured_outputs"] = structured_outputs(params.grammar)
    return body


class VLLMEngine(ManagedEngine):
    """Implements `art.engine.base.ManagedEngine` by HTTP to a `VLLMServer` it owns."""

    kind = "vllm"

    def __init__(
        self,
        server: VLLMServer,
        tokenizer,
        *,
        base_name: str,
        adapter_name: str | None,
        max_model_len: int,
        vocab_size: int,
        eos_ids: set[int],
        keep_adapters: int = 4,
        sleep_mode: bool = False,
    ) -> None:
        """`server` is started already. `base_name`: its served model name. `adapter_name`: the
        trained model's name (its adapters load as `adapter_name@step`); None under full
        fine-tuning, where the server's model is the trained one. `keep_adapters`: checkpoint
        adapters kept loaded. `sleep_mode`: sleep through idle training steps."""
        self.server = server
        self.tokenizer = tokenizer
        self.base_name = base_name
        self.adapter_name = adapter_name
        self.max_model_len = max_model_len
        self.eos_ids = set(eos_ids)
        self.grammars = Grammars(tokenizer, vocab_size, self.eos_ids)
        self.keep_adapters = keep_adapters
        self.sleep_mode = sleep_mode
        self.live_step: int | None = None
        self.loaded: OrderedDict[int, str] = OrderedDict()
        """Steps whose adapter vLLM holds -> their names, oldest first."""
        self._in_use: dict[str, int] = {}
        """Requests running per served name (an adapter in use is not unloaded)."""
        self._cv = threading.Condition()
        self._open = threading.Event()
        self._open.set()
        self.waiting = 0
        self.progress_at = time.monotonic()
        self.asleep = False
        self._admin = httpx.Client(base_url=server.url, timeout=ADMIN_TIMEOUT_S)
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._load_lock = threading.Lock()

    # -- sampling -----------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> list[Completion]:
        events = self.stream(prompt_token_ids, params, adapter, _streaming=False)
        try:
            async for item in events:
                if isinstance(item, list):
                    return item
        finally:
            await events.aclose()
        raise BackendError("vLLM ended the request without completions")

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None, _streaming: bool = True
    ) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        await self._admitted()
        name, step = await self._served_name(adapter)
        with self._cv:
            self._in_use[name] = self._in_use.get(name, 0) + 1
        try:
            body = {
                "model": name,
                "token_ids": list(prompt_token_ids),
                "sampling_params": sampling_params(params),
                "output_mode": "tokens",
                "stream": _streaming,
            }
            ids: list[list[int]] = [[] for _ in range(params.n)]
            logprobs: list[list[float]] = [[] for _ in range(params.n)]
            tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(params.n)]
            finish: list[str | None] = [None] * params.n
            async for choice in self._choices(body, _streaming):
                i = choice["index"]
                new_ids, new_lps, new_tops = _tokens(choice, params.top_logprobs)
                ids[i] += new_ids
                logprobs[i] += new_lps
                tops[i] += new_tops
                finish[i] = choice.get("finish_reason") or finish[i]
                self.progress_at = time.monotonic()
                if _streaming and new_ids:
                    yield SampledTokens(i, new_ids, new_lps, new_tops, step)
            yield [self._completion(ids[i], logprobs[i], tops[i], finish[i], params, step) for i in range(params.n)]
        finally:
            with self._cv:
                self._in_use[name] -= 1
                self._cv.notify_all()

    async def _choices(self, body: dict, streaming: bool) -> AsyncGenerator[dict, None]:
        """vLLM's choices (whole, or a stream's deltas); its refusals as our errors."""
        client = self._client()
        try:
            if not streaming:
                response = await client.post("/inference/v1/generate", json=body)
                self._raise_for(response.status_code, response.content)
                for choice in response.json()["choices"]:
                    yield choice
                return
            async with client.stream("POST", "/inference/v1/generate", json=body) as response:
                if response.status_code != 200:
                    self._raise_for(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        raise BackendError(f"vLLM failed the request: {_message(chunk)}")
                    for choice in chunk.get("choices", ()):
                        yield choice
        except httpx.TransportError as exc:
            raise await self._unavailable(exc) from exc

    def _completion(
        self, ids: list[int], logprobs: list[float], tops, finish: str | None, params: SamplingParams, step: int | None
    ) -> Completion:
        reason: FinishReason
        if finish == "stop":
            reason = "stop"
        elif finish == "length":
            reason = "length"
        else:
            raise BackendError(
                f"vLLM ended a completion with finish_reason {finish!r}; its log: {self.server.log_path}"
            )
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = first_stop(text, params.stop, 0) if params.stop else None
        if cut is not None:
            text = text[:cut]
        return Completion(ids, logprobs, text, reason, tops, step)

    def _raise_for(self, status: int, content: bytes) -> None:
        if status == 200:
            return
        try:
            message = _message(json.loads(content))
        except ValueError:
            message = content.decode(errors="replace")[:500]
        if 400 <= status < 500:
            raise ArtValueError(f"vLLM refused the request: {message}", field=_field(message))
        if not self.server.alive():
            raise BackendUnavailableError(self.server.failure())
        raise BackendError(f"vLLM answered {status}: {message} (its log: {self.server.log_path})")

    async def _unavailable(self, exc: Exception) -> BackendUnavailableError:
        """The error for a request whose connection broke: a dying server's socket closes a
        moment before its process can be reaped, so its exit is waited for briefly."""
        failure = await asyncio.to_thread(self.server.failure, EXIT_WAIT_S)
        return BackendUnavailableError(
            failure
            or f"the vLLM server on {self.server.url} did not answer "
            f"({type(exc).__name__}: {exc}); its log: {self.server.log_path}"
        )

    def _client(self) -> httpx.AsyncClient:
        """One connection pool per event loop (the server's loop and the service's)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(
                base_url=self.server.url,
                timeout=httpx.Timeout(None, connect=10.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
            self._clients[loop] = client
        return client

    async def _admitted(self) -> None:
        """Wait while a restart or a sleep holds requests back; a dead server is an error now."""
        if not self._open.is_set():
            with self._cv:
                self.waiting += 1
            try:
                while not self._open.is_set():
                    await asyncio.sleep(GATE_POLL_S)
            finally:
                with self._cv:
                    self.waiting -= 1
        if not self.server.alive():
            raise BackendUnavailableError(self.server.failure())
        if not self.has_work():
            self.progress_at = time.monotonic()

    async def _served_name(self, adapter: AdapterRef | None) -> tuple[str, int | None]:
        """The name vLLM serves `adapter` under, and the step it holds."""
        if adapter is None or self.adapter_name is None:  # the base model, or the fully fine-tuned one
            return self.base_name, (self.live_step if self.adapter_name is None else None)
        if adapter.path is None:  # the live weights
            step = self.live_step
            if step is None:
                raise RuntimeError("vLLM serves no live adapter yet: no step was published to it")
            return self.loaded[step], step
        step = adapter.step
        if step is None:
            raise RuntimeError(f"the checkpoint adapter {adapter.key!r} names no step")
        if step not in self.loaded:
            await asyncio.to_thread(self._load, step, adapter.path, False)
        return self.loaded[step], step

    # -- weights --------------------------------------------------------------------------------
    def weights_updated(self, step: int, checkpoint: Path) -> None:
        if self.adapter_name is None:  # fully fine-tuned: the server runs on the step's checkpoint
            if self.server.args.get("model") != str(checkpoint):
                self._restart_on(checkpoint)
            self.live_step = step
            return
        self._load(step, checkpoint, True)
        self.live_step = step
        for old in [s for s in self.loaded if s > step]:  # a rolled-back step: its checkpoint is gone
            self._unload(old)
        self._unload_beyond_keep()

    def _load(self, step: int, checkpoint: Path, live: bool) -> None:
        with self._load_lock:
            if step in self.loaded:
                self.loaded.move_to_end(step)
                return
            name = f"{self.adapter_name}@{step}"
            response = self._admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(checkpoint)})
            if response.status_code == 400 and "already been loaded" in response.text:
                pass  # loaded before a rollback dropped it from our list
            elif response.status_code != 200:
                self._raise_admin("loading the adapter " + name, response)
            self.loaded[step] = name
            if not live:  # a checkpoint asked for by name: it goes first when room is needed
                self.loaded.move_to_end(step, last=False)

    def _unload_beyond_keep(self) -> None:
        with self._load_lock:
            extra = len(self.loaded) - self.keep_adapters - 1  # the live one is not counted
            for step in list(self.loaded):
                if extra <= 0:
                    break
                if step != self.live_step and not self._in_use.get(self.loaded[step]):
                    self._unload(step)
                    extra -= 1

    def _unload(self, step: int) -> None:
        name = self.loaded.pop(step)
        response = self._admin.post("/v1/unload_lora_adapter", json={"lora_name": name})
        if response.status_code != 200:
            log.warning("vLLM did not unload %s: %s", name, response.text[:300])

    def _restart_on(self, checkpoint: Path) -> None:
        """Full fine-tuning: the server starts again on the step's weights (requests wait)."""
        self._open.clear()
        try:
            with self._cv:
                self._cv.wait_for(lambda: not any(self._in_use.values()))
            started = time.monotonic()
            self.server.stop()
            self.server.args["model"] = str(checkpoint)
            self.server.start()
            self._admin.close()
            self._admin = httpx.Client(base_url=self.server.url, timeout=ADMIN_TIMEOUT_S)
            self._clients = weakref.WeakKeyDictionary()
            log.info("vLLM restarted on %s in %.1f s", checkpoint, time.monotonic() - started)
        finally:
            self._open.set()

    def _raise_admin(self, what: str, response: httpx.Response) -> None:
        if not self.server.alive():
            raise BackendUnavailableError(f"{what} failed: {self.server.failure()}")
        raise BackendError(f"{what} failed: vLLM answered {response.status_code}: {response.text[:500]}")

    # -- sharing the device with the trainer ----------------------------------------------------
    @property
    def serves_while_training(self) -> bool:
        return True  # its weights are its own process's: the trainer never writes them

    @contextmanager
    def serving_while_training(self, threads: int | None = None) -> Iterator[None]:
        """Serves on through the step; with sleep mode, an idle server sleeps through it."""
        if not (self.sleep_mode and not self.has_work()):
            yield
            return
        self._open.clear()
        try:
            self._admin.post("/sleep", params={"level": 1}).raise_for_status()
            self.asleep = True
            try:
                yield
            finally:
                self._admin.post("/wake_up").raise_for_status()
                self.asleep = False
        finally:
            self._open.set()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing to pause: the trainer's weights are not the ones vLLM reads."""
        yield

    # -- what the service and the watchdog read -------------------------------------------------
    def has_work(self) -> bool:
        return self.waiting > 0 or any(self._in_use.values())

    def stalled_s(self) -> float:
        return time.monotonic() - self.progress_at if self.has_work() and self.server.alive() else 0.0

    @property
    def thread_id(self) -> int | None:
        return None  # it samples in another process

    def stats(self) -> dict:
        stats = {
            "engine/kind": "vllm",
            "engine/running": sum(self._in_use.values()),
            "engine/queue_depth": self.waiting,
            "engine/loaded_adapters": len(self.loaded),
            "engine/asleep": self.asleep,
            "engine/vllm_version": self.server.install.version,
            "engine/vllm_log": str(self.server.log_path),
        }
        failure = self.server.failure()
        if failure is not None:
            stats["engine_down"] = failure
        return stats

    def stop(self) -> None:
        self.server.stop()
        self._admin.close()


def _tokens(choice: dict, top_logprobs: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """A choice's sampled ids, their logprobs, and per position the `top_logprobs` most likely
    (vLLM lists the sampled token first, then the top candidates; each has its rank, 1 the best)."""
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise BackendError(f"vLLM sent {len(ids)} token ids but {len(content)} logprobs")
    logprobs = [float(entry["logprob"]) for entry in content]
    tops = []
    if top_logprobs:
        for entry in content:
            ranked = {
                int(c["token_id"]): c
                for c in entry.get("top_logprobs") or ()
                if c.get("rank") is not None and c["rank"] <= top_logprobs
            }
            best = sorted(ranked.values(), key=lambda c: c["rank"])
            tops.append([(int(c["token_id"]), float(c["logprob"])) for c in best])
    return ids, logprobs, tops


def _message(body) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(body.get("message") or body.get("detail") or body)[:500] if isinstance(body, dict) else str(body)[:500]


def _field(message: str) -> str | None:
    """The request field vLLM's message names, when one of ours (for the 400's `param`)."""
    for field in ("max_tokens", "top_k", "top_p", "min_p", "temperature", "seed", "stop", "n", "logprobs"):
        if re.search(rf"\b{field}\b", message):
            return "top_logprobs" if field == "logprobs" else field
    if re.search(r"structured|grammar|json", message, re.IGNORECASE):
        return "response_format"
    return "messages"
