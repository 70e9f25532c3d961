"""Tracing, ART's way to see rollouts, completions and training steps in Phoenix, Langfuse or Jaeger.

    import art.tracing
    art.tracing.configure("http://127.0.0.1:6006/v1/traces")   # or set OTEL_EXPORTER_OTLP_ENDPOINT

Off, and free, unless configured; see `art.observability.tracing`.
"""

from art.observability.tracing import configure, configure_langfuse, enabled, flush, langfuse_should_export

__all__ = ["configure", "configure_langfuse", "enabled", "flush", "langfuse_should_export"]
