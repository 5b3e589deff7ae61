"""The names the model sees for MCP tools: ``mcp__<server>__<tool>``.

Every provider's function-name rule accepts ``^[a-zA-Z0-9_-]{1,64}$``. A server name is
at most 32 characters of ``[a-z0-9_-]`` (the manifest's rule), so its prefix is at most
37; the tool's part is made to fit deterministically: characters outside the rule become
``_``, and a part still too long is cut and ends with 8 hex digits of its original name's
SHA-256, so two long names that share a prefix still differ.
"""

from __future__ import annotations

import hashlib
import re

PREFIX = "mcp__"
SEPARATOR = "__"
MAX_NAME_CHARS = 64
# Providers' function-name rule (OpenAI, Anthropic): the name the model sees must match.
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
SERVER_NAME_RE = re.compile(r"^[a-z0-9_-]{1,32}$")
_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
_DIGEST_CHARS = 8


def tool_name(server: str, tool: str) -> str:
    """The model-facing name of ``tool`` on ``server`` (always matches `NAME_RE`).

    Raises ``ValueError`` for a server name outside `SERVER_NAME_RE` or an empty tool.
    """
    if not SERVER_NAME_RE.match(server):
        raise ValueError(f"not an MCP server name: {server!r}")
    if not tool:
        raise ValueError("an MCP tool needs a name")
    head = f"{PREFIX}{server}{SEPARATOR}"
    room = MAX_NAME_CHARS - len(head)
    part = _UNSAFE.sub("_", tool)
    if part != tool or len(part) > room:
        # Changed or cut: the digest of the original keeps the name unique and stable.
        digest = hashlib.sha256(tool.encode("utf-8")).hexdigest()[:_DIGEST_CHARS]
        part = f"{part[: room - _DIGEST_CHARS - 1]}_{digest}"
    return head + part


def split_name(name: str) -> tuple[str, str] | None:
    """``(server, tool part)`` of a model-facing MCP name, or None for any other name."""
    if not name.startswith(PREFIX):
        return None
    server, sep, part = name[len(PREFIX) :].partition(SEPARATOR)
    if not sep or not SERVER_NAME_RE.match(server) or not part:
        return None
    return server, part
