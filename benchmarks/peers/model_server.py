"""A tiny OpenAI-compatible streaming model for ``bench_e2e``'s ``token_to_sse`` path.

``python -m benchmarks.peers.model_server --port P --tokens K --gap-ms G`` answers every
``POST …/chat/completions`` with a streamed completion of K tokens, G ms apart. Each token's
text is the server's ``time.time()`` at the moment it is written (``"1796135618.016890 "``),
so whoever receives the token later knows when it left the model. Standard library only (no
Django), in its own process so it shares no interpreter lock with the benchmark's clients.
HTTP/1.1 with keep-alive and chunked responses, which is all the OpenAI SDK needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


def _sse(payload: dict) -> bytes:
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _chunk(content: str | None, finish: str | None = None) -> dict:
    delta = {"role": "assistant", "content": content} if content is not None else {}
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "bench-live",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


async def _completion(writer: asyncio.StreamWriter, tokens: int, gap: float) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    for index in range(tokens):
        if index:
            await asyncio.sleep(gap)
        writer.write(_sse(_chunk(f"{time.time():.6f} ")))
        await writer.drain()
    writer.write(_sse(_chunk(None, "stop")))
    usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
    writer.write(_sse({**_chunk(None), "choices": [], "usage": usage}))
    data = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    await writer.drain()


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if length:
                await reader.readexactly(length)
            if method == "POST" and path.rstrip("/").endswith("/chat/completions"):
                await _completion(writer, args.tokens, args.gap_ms / 1000)
            else:
                body = b'{"ok": true}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main(args) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve(r, w, args), host="127.0.0.1", port=args.port
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    try:
        asyncio.run(main(parser.parse_args()))
    except KeyboardInterrupt:
        pass
