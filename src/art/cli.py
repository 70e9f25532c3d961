"""The `art` command (also `python -m art`): `art serve` and `art dashboard`.

Importing this module is cheap; the server and its heavy dependencies load only when a
subcommand runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

API_KEY_ENV = "ART_API_KEY"


def _parser() -> argparse.ArgumentParser:
    """The `art` command line; each subcommand adds its own flags."""
    parser = argparse.ArgumentParser(prog="art", description="Agent Reinforcement Trainer.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_command(commands)
    _add_dashboard_command(commands)
    return parser


def _add_serve_command(commands) -> None:
    """Add `art serve`; its many flags are added in groups, by what they control."""
    serve = commands.add_parser(
        "serve",
        help="serve and train models over HTTP (for art.RemoteBackend)",
        description="Run a backend that art.RemoteBackend (art.Backend) clients register, train and "
        "sample models on: the OpenAI routes under /v1 and the management routes under /art.",
    )
    _add_serve_access_arguments(serve)
    _add_serve_watchdog_arguments(serve)
    _add_serve_engine_arguments(serve)


def _add_serve_access_arguments(serve: argparse.ArgumentParser) -> None:
    """Add the `art serve` flags for where it listens and what clients may send and load."""
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 for every interface, needs a key)",
    )
    serve.add_argument("--port", type=int, default=7999, help="port (default 7999; 0 picks a free one)")
    serve.add_argument("--path", default=".art", help="storage root for runs (default ./.art)")
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"bearer key clients must send (default: ${API_KEY_ENV}); prefer the environment "
        "variable, since command lines are visible to other users",
    )
    serve.add_argument(
        "--max-body-mb",
        type=float,
        default=256.0,
        help="largest request body accepted, in MiB (default 256); larger ones get a 413",
    )
    serve.add_argument(
        "--max-chat-body-mb",
        type=float,
        default=8.0,
        help="largest chat request (/v1) accepted, in MiB (default 8); larger ones get a 413",
    )
    serve.add_argument(
        "--models-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a server folder base_model paths may point into (repeatable; the Hugging Face cache "
        "and art's cache are always allowed)",
    )
    serve.add_argument(
        "--allow-any-model-path",
        action="store_true",
        help="let clients load a base_model from any path on this machine (a key holder could probe which files exist)",
    )


def _add_serve_watchdog_arguments(serve: argparse.ArgumentParser) -> None:
    """Add the `art serve` flags for when a stuck engine or a long training step is reported."""
    serve.add_argument(
        "--watchdog-s",
        type=float,
        default=60.0,
        help="report an engine loop stuck when it has pending requests and makes no progress for "
        "this many seconds (default 60; 0 turns it off): a WARNING with its stack, and "
        "/health says degraded",
    )
    serve.add_argument(
        "--watchdog-train-s",
        type=float,
        default=1800.0,
        help="report a training step running longer than this many seconds (default 1800; 0 off)",
    )


def _add_serve_engine_arguments(serve: argparse.ArgumentParser) -> None:
    """Add the `art serve` flags for which engine serves models and where replicas and ranks run."""
    serve.add_argument(
        "--engine",
        choices=("auto", "ours", "vllm"),
        default="auto",
        help="which engine serves models whose _internal_config names none: vLLM (a process of its "
        "own; ART_VLLM_PYTHON names its Python), ours, or auto (vLLM on CUDA when installed, "
        "else ours; default)",
    )
    serve.add_argument(
        "--ray",
        action="store_true",
        help="run models' engine replicas and trainer ranks beyond the first as Ray actors "
        "(a local Ray instance unless --ray-address)",
    )
    serve.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (e.g. auto, or HEAD_IP:6379 after `ray start --head`); implies --ray",
    )


def _add_dashboard_command(commands) -> None:
    """Add `art dashboard`, the local page over stored runs."""
    dashboard = commands.add_parser(
        "dashboard",
        help="a local web page to watch runs: curves, samples, trained tokens",
        description="Serve a page over the runs stored under --path: reward and metric curves, each step's "
        "samples and their trained tokens, updated live. Reads the run folders only; no model is loaded.",
    )
    dashboard.add_argument("--path", default=".art", help="storage root of the runs (default ./.art)")
    dashboard.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; the page has no key, so only loopback)"
    )
    dashboard.add_argument("--port", type=int, default=7990, help="port (default 7990; 0 picks a free one)")


def _dashboard(args: argparse.Namespace) -> int:
    if not is_loopback(args.host):
        print(
            f"art dashboard: refusing to listen on {args.host}: the page has no key and shows every run's "
            "samples. Bind to 127.0.0.1 and reach it through an SSH tunnel, or use `art serve` with an API key "
            "(it serves the same page at /dashboard).",
            file=sys.stderr,
        )
        return 2
    try:
        from art.dashboard.app import serve_dashboard
    except ImportError as exc:
        print(
            f"art dashboard: missing {exc.name or exc}: install the backend extra, "
            "pip install 'agent-rl-trainer[backend]'",
            file=sys.stderr,
        )
        return 1
    if not os.path.isdir(args.path):
        print(f"art dashboard: {args.path} does not exist yet; runs appear once training writes there", flush=True)
    try:
        serve_dashboard(host=args.host, port=args.port, path=args.path)
    except OSError as exc:
        print(f"art dashboard: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _serve(args: argparse.Namespace) -> int:
    """Run `art serve` until SIGINT/SIGTERM; the exit status."""
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(args.host):
        print(_keyless_refusal(args.host), file=sys.stderr)
        return 2
    try:
        import uvicorn

        from art.serve import ArtServer, create_serve_app
        from art.server.security import default_model_roots, redact_access_log
        from art.server.thread import KEEP_ALIVE_S, bind, url_for
        from art.service.local import LocalService
    except ImportError as exc:
        print(
            f"art serve: missing {exc.name or exc}: install the backend extra, pip install 'agent-rl-trainer[backend]'",
            file=sys.stderr,
        )
        return 1
    _log_library_info()
    redact_access_log()
    try:
        sock, port = bind(args.host, args.port)  # bound before anything starts: port 0 gives the real port
    except OSError as exc:
        print(f"art serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    roots = None if args.allow_any_model_path else default_model_roots(args.models_dir)
    placement = _start_placement(args)
    app = create_serve_app(
        LocalService(args.path, placement=placement, engine=args.engine),
        api_key=api_key,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_chat_body_bytes=int(args.max_chat_body_mb * 2**20),
        watchdog_s=args.watchdog_s,
        watchdog_train_s=args.watchdog_train_s,
        model_roots=roots,
    )
    server = ArtServer(
        uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_S)
    )
    print(_listening_banner(url_for(args.host, port), args, api_key, placement), flush=True)
    try:  # until SIGINT/SIGTERM: training steps are abandoned, open requests finish, the lifespan stops the engines
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _keyless_refusal(host: str) -> str:
    """Why `art serve` will not listen on a non-loopback `host` without a key, and how to set one."""
    return (
        f"art serve: refusing to listen on {host} without an API key: anyone who can reach the "
        f"port could sample and train your models. Set a key with `export {API_KEY_ENV}=$(python -c "
        "'import secrets; print(secrets.token_urlsafe(32))')` (or --api-key KEY) and give the same key "
        "to art.RemoteBackend(url, api_key=...) or the client's ART_API_KEY; or bind to 127.0.0.1 and "
        "reach it through an SSH tunnel."
    )


def _log_library_info() -> None:
    """Show the library's own INFO lines (a model ready, a step finished after its client left)."""
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("art").setLevel(logging.INFO)


def _start_placement(args: argparse.Namespace) -> str:
    """Where models' replicas and ranks beyond the first run: joins Ray first when --ray or --ray-address asks."""
    if args.ray or args.ray_address:
        from art.ray_cluster import ensure_ray

        ensure_ray(args.ray_address)  # a local instance, or the cluster at --ray-address
        return "ray"
    return "processes"


def _listening_banner(url: str, args: argparse.Namespace, api_key: str | None, placement: str) -> str:
    """The line `art serve` prints once it listens, so a user sees its settings and where each route is."""
    return (
        f"art serve: listening on {url} (storage {args.path}, auth {'on' if api_key else 'off'}, "
        f"replicas and ranks in {placement}, engine {args.engine}); "
        f"OpenAI routes at {url}/v1, management at {url}/art, schema at {url}/openapi.json, "
        f"dashboard at {url}/dashboard"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "dashboard":
        return _dashboard(args)
    return 2  # argparse rejects unknown commands before this


if __name__ == "__main__":
    sys.exit(main())
