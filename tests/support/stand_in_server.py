"""A stand-in for vLLM's server module in the process-lifetime tests of `art.engine.vllm_process`:
it answers /health on the --host/--port it is given and sleeps in a child process of its own,
as vLLM's engine core does, so a test can check that the whole process group goes away."""

from __future__ import annotations

import argparse
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"child {child.pid}", flush=True)
    ThreadingHTTPServer((args.host, args.port), Health).serve_forever()


if __name__ == "__main__":
    main()
