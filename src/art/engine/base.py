"""The interface every sampling engine implements.

The server and the model service talk to engines only through these types, so the plain
PyTorch sampler, a faster CPU engine and a vLLM engine are interchangeable. An engine knows
nothing about HTTP, chat messages or GRPO: it turns prompt token ids into completions.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from art.engine.grammar import Grammars


FinishReason = Literal["stop", "length"]
"""Why a completion ended: a stop token or string, or its length limit (OpenAI's names)."""


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler (vLLM's names where vLLM has one)."""

    n: int = 1
    """Completions sampled from the one prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept; 1.0 keeps the whole distribution."""
    top_k: int = 0
    """Only the k most likely tokens may be drawn; 0 keeps them all (vLLM's -1 means the same)."""
    min_p: float = 0.0
    """Tokens less likely than min_p times the most likely one are not drawn; 0 keeps them all."""
    max_tokens: int = 256
    """Completion tokens at most, per completion."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion; the matched string is cut from the text (not from token_ids)."""
    seed: int | None = None
    """Makes sampling of this request reproducible whatever else is batched with it."""
    top_logprobs: int = 0
    """Alternatives reported per position; 0 reports only the sampled token's logprob."""
    ignore_eos: bool = False
    """Keep sampling after end-of-sequence tokens until max_tokens (for benchmarks)."""
    grammar: str | None = None
    """An llguidance grammar (JSON schema or Lark) every completion must follow; None: free text.
    `art.server.structured_output` builds it from `response_format` or a forced tool call."""


@dataclass(frozen=True)
class AdapterRef:
    """Which LoRA weights serve a request. `key` is unique per weights (e.g. 'agent@3')."""

    key: str
    path: Path | None = None
    """Checkpoint folder of `step`; None means the live adapter being trained."""
    step: int | None = 0
    """The step asked for; None means whatever the live adapter holds when sampling starts."""


@dataclass(frozen=True)
class ServedModel:
    """The result of resolving a request's `model` field."""

    name: str
    """The name as the client asked for it (echoed in the response's `model`)."""
    engine: Engine
    adapter: AdapterRef | None
    """None serves the bare base model."""
    step: int
    """Training step of the weights that serve it (0 for the base model)."""


@dataclass
class Completion:
    """One sampled completion. Lists are aligned: one entry per completion token."""

    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each sampled token under the raw model distribution (temperature 1),
    as vLLM reports by default and as the trainer computes it."""
    text: str
    finish_reason: FinishReason
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per position, the `top_logprobs` most likely (token id, logprob); empty when not asked."""
    step: int | None = None
    """Training step of the weights that sampled it, when the engine knows (None: base model)."""
    queue_s: float | None = None
    """Seconds the request waited before the engine admitted it."""
    time_to_first_token_s: float | None = None
    """Seconds from the request's arrival to its first sampled token."""
    replica: int | None = None
    """Which engine replica sampled it (`art.engine.replicas`); None without replicas."""


@dataclass
class SampledTokens:
    """Tokens one completion of a streamed request just sampled (`Engine.stream`), aligned lists."""

    index: int
    """Which of the request's `n` completions they extend."""
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    step: int | None = None
    """As `Completion.step`: the training step of the weights sampling them."""
    replica: int | None = None
    """As `Completion.replica`."""


class Tokenizer(Protocol):
    """What the routes call on an engine's tokenizer themselves (a Hugging Face tokenizer has it);
    the chat template and tokenizing helpers take the tokenizer as it is."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`."""
        ...


class Engine(Protocol):
    """A sampler bound to one base model (and its tokenizer): what the OpenAI routes use.

    Implemented by our engine (`LLMEngine`), its replica set (`ReplicaSet`) and the vLLM engine
    (`VLLMEngine`)."""

    tokenizer: Tokenizer
    max_model_len: int
    grammars: Grammars
    """The tokenizer's grammar support: the routes check a request's grammar with it."""

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> list[Completion]:
        """Sample `params.n` completions of the prompt with the given adapter (None: base model)."""
        ...

    def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        """`generate`, yielding each completion's tokens as they are sampled (`SampledTokens`),
        then, last, the `list[Completion]` that `generate` returns. A generator: a caller that
        stops early `aclose`s it."""
        ...


class ManagedEngine(Engine, Protocol):
    """An engine the model service owns (`art.service.loaded`): everything the service, the
    weight update (`art.service.update`) and the watchdog use of it."""

    kind: str
    """"ours" or "vllm": logged in the run's model.json and shown by /health."""
    eos_ids: set[int]
    """Token ids that end a completion (SFT appends one after each assistant turn)."""

    @property
    def serves_while_training(self) -> bool:
        """Whether a training step may run beside it (`serving_while_training`)."""
        ...

    def serving_while_training(self, threads: int | None = None) -> AbstractContextManager[None]:
        """Around a training step that runs beside the engine: it keeps serving the last
        published weights. `threads`: its share of the CPU cores meanwhile (None keeps them)."""
        ...

    def paused(self) -> AbstractContextManager[None]:
        """Around a change of the trainer's weights that the engine must not read halfway."""
        ...

    def weights_updated(self, step: int, checkpoint: Path) -> None:
        """Publish `step` (saved in the checkpoint folder `checkpoint`) as the live weights:
        requests admitted from now on sample with them."""
        ...

    def has_work(self) -> bool:
        """Requests running, or waiting that could run."""
        ...

    def stalled_s(self) -> float:
        """Seconds without progress while it has work; 0 when it has none (the watchdog)."""
        ...

    @property
    def thread_id(self) -> int | None:
        """The thread whose stack the watchdog shows when it is stalled (None: not ours)."""
        ...

    def stats(self) -> dict:
        """Its load for /health. An `engine_down` entry (a message) says it cannot serve."""
        ...

    def stop(self) -> None:
        """Stop serving; requests still open fail with BackendUnavailableError."""
        ...


def all_tokens(completions: list[Completion]) -> list[SampledTokens]:
    """Each whole completion as the `SampledTokens` a stream would have sent."""
    return [
        SampledTokens(i, c.token_ids, c.logprobs, c.top_logprobs, c.step, c.replica) for i, c in enumerate(completions)
    ]
