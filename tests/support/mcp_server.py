"""A small MCP server of our own for tests/client/test_mcp.py, run over stdio as a subprocess:
`python -m tests.support.mcp_server`. Its tools compute what a test can check from the call's
arguments alone, and each reply names this process, so a result cannot have come from the
test's own process."""

from __future__ import annotations

import os

try:  # the MCP SDK 2.x name; 1.x called it FastMCP
    from mcp.server import MCPServer as _Server
except ImportError:  # pragma: no cover - MCP SDK 1.x
    from mcp.server.fastmcp import FastMCP as _Server

server = _Server("art-test-tools", instructions="Arithmetic and a word counter, for tests.")
CALLS: list[str] = []
"""The tools this process has run, in order (`calls_so_far` reports them)."""


@server.tool()
def add(a: int, b: int) -> str:
    """Add two whole numbers."""
    CALLS.append("add")
    return f"{a} + {b} = {a + b} (pid {os.getpid()})"


@server.tool()
def count_words(text: str) -> str:
    """Count the words in a text."""
    CALLS.append("count_words")
    return f"{len(text.split())} words (pid {os.getpid()})"


@server.tool()
def calls_so_far() -> str:
    """The names of the tools this server has run so far, oldest first."""
    return ",".join(CALLS) or "none"


@server.resource("notes://guide", name="guide", description="How to use these tools.", mime_type="text/plain")
def guide() -> str:
    return "Use add for sums and count_words for word counts."


if __name__ == "__main__":
    server.run()  # stdio
