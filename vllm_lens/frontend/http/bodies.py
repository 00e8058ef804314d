"""Reading the request bodies of vllm-lens's own HTTP routes, and the header naming the API
process that answered (runs in: front end)."""

from __future__ import annotations

import multiprocessing
from typing import Any

from fastapi import Request

__all__ = ["answered_by", "json_object", "read_bounded"]


async def json_object(raw_request: Request) -> dict[str, Any] | None:
    """The body as a JSON object; ``None`` when it is not one."""
    try:
        body = await raw_request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def read_bounded(raw_request: Request, limit: int) -> bytes:
    """The request body, read no further than ``limit`` bytes (``ValueError`` past it, also
    when its declared length is larger: nothing more is read then)."""
    declared = raw_request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ValueError(f"body of {int(declared):,} bytes, above {limit:,}")
    body = bytearray()
    async for chunk in raw_request.stream():
        body += chunk
        if len(body) > limit:
            raise ValueError(f"body larger than {limit:,} bytes")
    return bytes(body)


def answered_by() -> dict[str, str]:
    """A header naming the API server process that answered (``ApiServer_1`` ... under
    ``--api-server-count``), for tracing where a follow-up call landed."""
    return {"x-vllm-lens-api-process": multiprocessing.current_process().name}
