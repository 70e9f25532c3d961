"""What tracing costs the serving path: engine_throughput with OpenTelemetry off and on.

    python benchmarks/tracing_overhead.py [--rounds 2] [--max-tokens 64]

Runs `engine_throughput.py --skip-hf --skip-llama-cpp` (ours only, shapes a and b) in fresh
processes, alternating tracing off / on, `rounds` times each (OpenTelemetry's tracer provider is
set once per process, so each mode gets its own). "on" records every span with the real SDK into
an in-memory exporter: the client's HTTP header injection, FastAPI's spans and ours, with
attributes (about 370 spans a run). Prints tokens/s per run, the median ratio on/off per shape (goal: > 0.97) and one
JSON line. "off" is the default every user gets; its cost is a flag check per span.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from _common import environment, table

HERE = Path(__file__).parent


def run(tracing: str, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "engine_throughput.py"), "--skip-hf", "--skip-llama-cpp",
                          "--max-tokens", str(max_tokens), "--tracing", tracing],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(args.rounds):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            report = run(mode, args.max_tokens)
            runs[mode].append(report)
            print(f"round {i} tracing {mode}: a {report['shape_a']['ours_tok_s']} tok/s, "
                  f"b {report['shape_b']['ours_tok_s']} tok/s, {report['tracing']['spans']} spans", flush=True)
    rows, result = [], {"benchmark": "tracing_overhead", "rounds": args.rounds, "max_tokens": args.max_tokens}
    for shape in ("a", "b"):
        off = [r[f"shape_{shape}"]["ours_tok_s"] for r in runs["off"]]
        on = [r[f"shape_{shape}"]["ours_tok_s"] for r in runs["on"]]
        ratio = round(statistics.median(b / a for a, b in zip(off, on)), 3)
        rows.append([shape, statistics.median(off), statistics.median(on), ratio])
        result[f"shape_{shape}"] = {"off_tok_s": off, "on_tok_s": on, "median_ratio_on_vs_off": ratio}
    result["spans_per_run"] = runs["on"][0]["tracing"]["spans"]
    print(table(["shape", "off tok/s", "on tok/s", "on / off"], rows))
    print(json.dumps({**result, **environment()}))


if __name__ == "__main__":
    main()
