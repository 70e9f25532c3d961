"""OpenTelemetry traces of rollouts, completions and training steps; off and free unless configured.

Spans are recorded when one of these holds, checked when a span would start:
- `art.tracing.configure(endpoint=...)` was called (OTLP over HTTP, e.g. Phoenix or Langfuse);
- the standard `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` variables are
  set (configured on first use with `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_SERVICE_NAME`);
- `art.tracing.configure_langfuse()` made a Langfuse SDK client, or the application installed an
  SDK tracer provider itself (the Langfuse SDK v3+ does).
`OTEL_SDK_DISABLED=true` turns all of it off. Without the `tracing` extra (opentelemetry) every
span is a no-op.

Names follow OpenTelemetry's GenAI conventions (`gen_ai.*`) with the attributes Langfuse and
Phoenix (OpenInference) read for input and output, so a rollout shows its messages and reward and
a completion its model, tokens and timings. The trace context crosses our HTTP calls in the W3C
`traceparent` header (`inject_headers` on the client, `extract_context` on the server).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

TRACER_NAME = "art"
_lock = threading.Lock()
_tracer: Any = None
"""The tracer of a provider we configured (configure() or the OTEL_* variables)."""
_env_checked = False
_otel: Any = None
"""The `opentelemetry.trace` module once imported; False when it is not installed."""
_langfuse: Any = None
"""The Langfuse SDK client rollout scores go to (configure_langfuse), if any."""


def _trace_module():
    global _otel
    if _otel is None:
        try:
            from opentelemetry import trace

            _otel = trace
        except ImportError:
            _otel = False
    return _otel


def _disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def configure(
    endpoint: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    service_name: str | None = None,
    exporter: Any = None,
) -> None:
    """Record spans and send them to `endpoint` (OTLP/HTTP, e.g. `http://127.0.0.1:6006/v1/traces`),
    or to `exporter` (any OpenTelemetry SpanExporter). Without either, the OTEL_* variables decide.

    An SDK tracer provider the application already installed (e.g. by the Langfuse SDK) gets
    the exporter added; otherwise a new provider becomes the global one."""
    global _tracer
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise ImportError('tracing needs the tracing extra: pip install "agent-rl-trainer[tracing]"') from exc
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, headers=dict(headers) if headers else None)
        processor: SpanProcessor = BatchSpanProcessor(exporter)
    else:
        processor = SimpleSpanProcessor(exporter)
    with _lock:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "art"
            provider = TracerProvider(resource=Resource.create({"service.name": name}))
            trace.set_tracer_provider(provider)
            provider = trace.get_tracer_provider()  # the one that won, should another thread race us
        if not isinstance(provider, TracerProvider):
            raise RuntimeError(f"another tracer provider ({type(provider).__name__}) was installed meanwhile")
        provider.add_span_processor(processor)
        _tracer = provider.get_tracer(TRACER_NAME)


def configure_langfuse(
    public_key: str | None = None,
    secret_key: str | None = None,
    host: str | None = None,
    *,
    service_name: str | None = None,
    client: Any = None,
) -> None:
    """Send spans to Langfuse, and each rollout's reward and numeric metrics as Langfuse scores.

    Keys and host default to LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_HOST (or
    LANGFUSE_BASE_URL; Langfuse Cloud EU when unset). With the `langfuse` SDK installed (the
    tracing extra has it) a client is made (or `client`, one the application made, is used):
    it exports the spans and sends the scores, which Langfuse takes only through its score API,
    never from span attributes. Without the SDK, spans go straight to Langfuse's OTLP endpoint
    (`{host}/api/public/otel/v1/traces`, basic auth with the key pair) and the reward is only a
    span attribute and the rollout's output."""
    global _langfuse
    public_key = public_key or os.environ.get("LANGFUSE_PUBLIC_KEY")
    secret_key = secret_key or os.environ.get("LANGFUSE_SECRET_KEY")
    if client is None and (not public_key or not secret_key):
        raise ValueError("Langfuse needs a key pair: public_key/secret_key or LANGFUSE_PUBLIC_KEY/LANGFUSE_SECRET_KEY")
    host = (
        host or os.environ.get("LANGFUSE_HOST") or os.environ.get("LANGFUSE_BASE_URL") or "https://cloud.langfuse.com"
    ).rstrip("/")
    if client is None:
        try:
            from langfuse import Langfuse
        except ImportError:
            _configure_langfuse_otlp(public_key or "", secret_key or "", host, service_name)  # both set: checked above
            return
        client = Langfuse(
            public_key=public_key, secret_key=secret_key, base_url=host, should_export_span=langfuse_should_export
        )
    _langfuse = client


def langfuse_should_export(span: Any) -> bool:
    """The Langfuse SDK's span filter that also lets art's spans through (its default keeps
    only its own, GenAI and known LLM-library spans, which would orphan our rollouts). Pass
    it as `Langfuse(should_export_span=...)` to a client you make yourself."""
    from langfuse.span_filter import is_default_export_span

    scope = span.instrumentation_scope
    return (scope is not None and scope.name == TRACER_NAME) or is_default_export_span(span)


def _configure_langfuse_otlp(public_key: str, secret_key: str, host: str, service_name: str | None) -> None:
    import base64

    token = base64.b64encode(f"{public_key}:{secret_key}".encode()).decode()
    configure(
        f"{host}/api/public/otel/v1/traces", headers={"Authorization": f"Basic {token}"}, service_name=service_name
    )


def send_scores(current: Any, trajectory: Any) -> None:
    """Langfuse: the rollout's reward and numeric metrics as scores on its observation."""
    if _langfuse is None or current is None:
        return
    context = current.get_span_context()
    trace_id, observation_id = format(context.trace_id, "032x"), format(context.span_id, "016x")
    scores = {**(trajectory.metrics or {}), "reward": trajectory.reward}
    for name, value in scores.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            _langfuse.create_score(
                name=name, value=float(value), trace_id=trace_id, observation_id=observation_id, data_type="NUMERIC"
            )


def flush(timeout_s: float = 10.0) -> None:
    """Export what is buffered (before a short script exits, or a test reads the spans)."""
    trace = _trace_module()
    provider = trace.get_tracer_provider() if trace else None
    if provider is not None and hasattr(provider, "force_flush"):
        provider.force_flush(int(timeout_s * 1000))
    if _langfuse is not None:
        _langfuse.flush()  # its scores are queued apart from the spans


def _active_tracer() -> Any:
    """The tracer to record with, or None (tracing off): a cheap check on every span."""
    global _env_checked
    if _tracer is not None:
        return None if _disabled() else _tracer
    if _disabled():
        return None
    if not _env_checked:
        _env_checked = True
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            if _trace_module():
                configure()
                return _tracer
    trace = _trace_module()
    if not trace:
        return None
    provider = trace.get_tracer_provider()
    if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return None  # nobody configured tracing
    return provider.get_tracer(TRACER_NAME)


def enabled() -> bool:
    return _active_tracer() is not None


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    context: Any = None,
    kind: str = "INTERNAL",
    end_on_exit: bool = True,
) -> Iterator[Any]:
    """A span around the block (None when tracing is off). An exception ends it with an error
    status and is recorded, then raised on. With `end_on_exit=False` the caller ends it
    (`.end()`): a streamed response's span lasts until its last chunk."""
    tracer = _active_tracer()
    if tracer is None:
        yield None
        return
    trace = _trace_module()
    with tracer.start_as_current_span(
        name,
        context=context,
        kind=getattr(trace.SpanKind, kind),
        attributes=_clean(attributes or {}),
        end_on_exit=end_on_exit,
    ) as current:
        yield current


def set_attributes(current: Any, attributes: Mapping[str, Any]) -> None:
    if current is not None:
        current.set_attributes(_clean(attributes))


def record_failure(current: Any, exc: BaseException) -> None:
    """Mark a span failed by an exception that is handled (not raised through the span)."""
    if current is None:
        return
    from opentelemetry.trace import Status, StatusCode

    current.record_exception(exc)
    current.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))


def rollout_attributes(trajectory: Any) -> dict[str, Any]:
    """What a finished rollout's span shows: its reward and metrics, and its messages (tool
    calls included) as input/output for Langfuse (`langfuse.*`) and Phoenix (OpenInference)."""
    messages = trajectory.messages()
    out: dict[str, Any] = {
        "art.reward": float(trajectory.reward),
        "input.value": json.dumps(messages, default=str, ensure_ascii=False),
        "input.mime_type": "application/json",
        "output.value": json.dumps({"reward": trajectory.reward, "metrics": trajectory.metrics}, default=str),
        "output.mime_type": "application/json",
        "langfuse.observation.type": "agent",
        "langfuse.observation.input": json.dumps(messages, default=str, ensure_ascii=False),
        "langfuse.observation.output": json.dumps({"reward": trajectory.reward}, default=str),
    }
    for key, value in (trajectory.metrics or {}).items():
        if isinstance(value, (int, float, bool)):
            out[f"art.metrics.{key}"] = value
    for key, value in (trajectory.metadata or {}).items():
        if isinstance(value, (str, int, float, bool)):
            out[f"langfuse.observation.metadata.{key}"] = value
    return out


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes str, bool, int, float and lists of one of them; the rest as JSON."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, (str, bool, int, float)):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            out[key] = list(value)
        else:
            out[key] = json.dumps(value, default=str, ensure_ascii=False)
    return out


# -- across HTTP ----------------------------------------------------------------------------


async def inject_headers(request) -> None:
    """httpx request hook: the current trace context as a `traceparent` header."""
    if _active_tracer() is None:
        return
    from opentelemetry.propagate import inject

    inject(request.headers)


def extract_context(headers: Mapping[str, str]) -> Any:
    """The caller's trace context from request headers; None when tracing is off or when a
    span is already current (a server instrumentation such as FastAPI's extracted it first)."""
    if _active_tracer() is None or _trace_module().get_current_span().get_span_context().is_valid:
        return None
    from opentelemetry.propagate import extract

    return extract(dict(headers))
