"""Turn a Req into the SGLang-shaped output dict, and deliver it to a waiting caller.

Sinks decouple the engine thread from callers: a thread-safe queue for blocking calls, an asyncio
queue fed through `call_soon_threadsafe` for coroutines.
"""

from __future__ import annotations

import asyncio
import queue

from rollout.request import Req
from rollout.tokenizer import TokenizerWrapper


def build_output(req: Req, tok: TokenizerWrapper, weight_version: str, final: bool) -> dict:
    text = tok.final_text(req) if final else tok.decode(req.output_ids, req)
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finished_reason.to_dict() if req.finished_reason else None,
        "weight_version": weight_version,
        "num_retractions": req.num_retractions,
    }
    if req.return_logprob:
        texts = [tok.token_text(t) for t in req.output_ids] if final else [None] * len(req.output_ids)
        meta["output_token_logprobs"] = [
            (lp, t, s) for lp, t, s in zip(req.output_logprobs, req.output_ids, texts)
        ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [(lp, t, tok.token_text(t) if final else None) for lp, t in step]
                for step in req.output_top_logprobs
            ]
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta, "index": req.index}


class SyncSink:
    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def put(self, item) -> None:
        self.queue.put(item)

    def get(self, timeout: float | None = None):
        return self.queue.get(timeout=timeout)


class AsyncSink:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self):
        return await self.queue.get()
