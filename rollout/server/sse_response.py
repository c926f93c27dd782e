"""SSEResponse: a text/event-stream response over an async iterator of byte chunks, for the streaming routes.

Starlette's StreamingResponse does the same job; this one is what a busy streaming server needs of it:
- The last chunk ends the response in the same write. With `is_last` (a callable read right after each chunk
  arrives; the /generate stream passes "every request of the call delivered its final output") the chunk that
  is last goes out with `more_body=False`, so uvicorn writes it and the chunked-encoding terminator as one
  socket write; StreamingResponse always sends an empty closing body after the loop, a second write per request.
  On a saturated 2-core server that write, and the wake-up it costs the client, are on the path between a
  request's end and its successor's arrival.
- A client that goes away is noticed while nothing is being sent (a request queued behind others, or paused):
  one watcher task reads the ASGI receive channel and cancels the streaming task at `http.disconnect`, as
  StreamingResponse's task group does (two tasks and anyio cancel scopes there, ~20 us of a request's setup).
  The iterator is closed in every case (its `finally` aborts the engine requests), and a disconnect ends the
  response quietly, as before.

What it does not do: encode (chunks are bytes, or str encoded as UTF-8), retry, or hold anything back: each
chunk is sent as it arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

from fastapi.responses import Response


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes | str], is_last: Callable[[], bool] | None = None,
                 status_code: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.body_iterator = chunks
        self.is_last = is_last
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        state = {"streaming": True, "client_gone": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["streaming"]:  # not after the last write (uvicorn answers receive with a disconnect then)
                state["client_gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            more = True
            async for chunk in self.body_iterator:
                if isinstance(chunk, str):
                    chunk = chunk.encode("utf-8")
                more = self.is_last is None or not self.is_last()
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
                if not more:
                    break
            state["streaming"] = False
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["client_gone"]:
                raise  # cancelled by someone else (the server shutting down): theirs to handle
            task.uncancel()
        finally:
            state["streaming"] = False
            watcher.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # a no-op once exhausted; else its `finally` (the engine abort) runs now
