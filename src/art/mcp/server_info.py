"""What an MCP server offers, read from an open client session: its tools and its resources.

Works with an initialized `mcp.ClientSession` of the MCP SDK (2.x, and 1.x's camelCase
fields), over any transport; every page of a paginated listing is read.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from art.mcp.types import MCPResource, MCPTool, field_of

log = logging.getLogger(__name__)


async def list_tools(session: Any) -> list[MCPTool]:
    """Every tool the server lists."""
    return [MCPTool.from_mcp(tool) for tool in await _all_pages(session.list_tools, "tools")]


async def list_resources(session: Any) -> list[MCPResource]:
    """Every resource the server lists; none from a server that has no resources (it may
    refuse the request, as servers without the resources capability do)."""
    capabilities = _server_capabilities(session)
    if capabilities is not None and field_of(capabilities, "resources") is None:
        return []
    try:
        resources = await _all_pages(session.list_resources, "resources")
    except Exception as exc:  # a server without resources answers "method not found"
        log.info("the MCP server listed no resources (%s: %s)", type(exc).__name__, exc)
        return []
    return [MCPResource.from_mcp(resource) for resource in resources]


async def list_tools_and_resources(session: Any) -> tuple[list[MCPTool], list[MCPResource]]:
    """`(tools, resources)`: what `generate_scenarios` and `mcp_rollout` take."""
    return await list_tools(session), await list_resources(session)


def _server_capabilities(session: Any) -> Any:
    getter = getattr(session, "get_server_capabilities", None)  # SDK 1.x
    if callable(getter):
        return getter()
    return getattr(session, "server_capabilities", None)  # SDK 2.x (a property)


async def _all_pages(fetch: Callable[..., Awaitable[Any]], items: str) -> list[Any]:
    found: list[Any] = []
    cursor = None
    while True:
        page = await fetch() if cursor is None else await _next_page(fetch, cursor)
        found += list(field_of(page, items, default=[]))
        cursor = field_of(page, "next_cursor", "nextCursor")
        if not cursor:
            return found


async def _next_page(fetch: Callable[..., Awaitable[Any]], cursor: str) -> Any:
    try:
        from mcp.types import PaginatedRequestParams  # SDK 2.x: `params=`
    except ImportError:  # pragma: no cover - SDK 1.x: `cursor=`
        return await fetch(cursor=cursor)
    return await fetch(params=PaginatedRequestParams(cursor=cursor))
