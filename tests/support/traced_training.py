"""Two training steps with tracing on, in a fresh interpreter (OpenTelemetry's global tracer
provider can be set only once per process, so the tests that trace run this as a subprocess).

    python tests/support/traced_training.py MODEL_PATH ROOT (--memory SPANS_JSON | --otlp ENDPOINT | --langfuse HOST) [--remote]
        [--without-langfuse-sdk]

--memory keeps the spans in an in-memory exporter and writes them as JSON; --otlp sends them to
a real OTLP/HTTP receiver; --langfuse to a Langfuse host through the langfuse SDK (or, with
--without-langfuse-sdk, as if it were not installed: straight to its OTLP endpoint). --remote trains through `art serve`'s app on a loopback port with
RemoteBackend (the trace context must cross HTTP both for completions and for train calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import art
from art.service.local import LocalService
import art.tracing


async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    messages = [{"role": "user", "content": "Pick a token."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4, seed=seed)
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(choice.token_ids[0] % 2),
                          metrics={"first_token": choice.token_ids[0]})


async def train(model_path: str, root: str, remote: bool) -> None:
    if remote:
        from art.serve import create_serve_app
        from art.server.thread import ServerThread

        server = ServerThread(create_serve_app(LocalService(root), model_roots=[Path(model_path).resolve().parent]))
        server.start()
        backend = art.RemoteBackend(server.base_url)
    else:
        server, backend = None, art.LocalBackend(path=root)
    model = art.TrainableModel(name="traced", project="tracing", base_model=model_path)
    await model.register(backend)
    for step in range(2):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, seed=100 * step + 10 * g + i) for i in range(2)) for g in range(2)),
            pbar_desc=None)
        await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
    await backend.close()
    if server is not None:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_path")
    parser.add_argument("root")
    parser.add_argument("--memory")
    parser.add_argument("--otlp")
    parser.add_argument("--langfuse", help="a Langfuse host: keys from LANGFUSE_PUBLIC_KEY / LANGFUSE_SECRET_KEY")
    parser.add_argument("--without-langfuse-sdk", action="store_true")
    parser.add_argument("--remote", action="store_true")
    args = parser.parse_args()
    if args.without_langfuse_sdk:
        sys.modules["langfuse"] = None  # its import now raises ImportError
    exporter = None
    if args.memory:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        art.tracing.configure(exporter=exporter, service_name="art-test")
    elif args.langfuse:
        art.tracing.configure_langfuse(host=args.langfuse, service_name="art-test")
    else:
        art.tracing.configure(args.otlp, service_name="art-test")
    asyncio.run(train(args.model_path, args.root, args.remote))
    art.tracing.flush()
    if exporter is not None:
        spans = [{"name": s.name, "trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
                  "parent_id": f"{s.parent.span_id:016x}" if s.parent else None, "kind": s.kind.name,
                  "status": s.status.status_code.name, "attributes": dict(s.attributes or {})}
                 for s in exporter.get_finished_spans()]
        Path(args.memory).write_text(json.dumps(spans))
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
