"""The peer: transformers' ``generate`` on torch CPU behind a minimal aiohttp server, one
request at a time, as people deploy a model naively; torch on one thread (``--threads``),
as each mesh rank runs onnxruntime (on 2 busy cores, torch's default 2 threads spun
against each other and the other load: 184 ms per token for the small model in one run,
35 ms on one thread in the next).

Runs in the benchmark's torch environment (``gen_models.torch_python``), never in the
project's: this file imports neither shardserve nor the benchmarks package.

    TORCH_PYTHON benchmarks/gen_peer.py --model CHECKPOINT_DIR --port P

``POST /v1/completions`` takes what the benchmark client sends (token-id ``prompt``,
``max_tokens``, greedy, ``ignore_eos``, ``stream``) and streams one OpenAI chunk per token
through a transformers streamer, then a usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, AutoTokenizer


class TokenQueue:
    """A transformers streamer handing each new token to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first streams the prompt itself
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(token))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class Peer:
    def __init__(self, folder: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.lock = asyncio.Lock()  # one request at a time

    def _generate(self, prompt: list[int], max_tokens: int, streamer: TokenQueue) -> None:
        with torch.inference_mode():
            self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # ignore_eos: always the full length
                do_sample=False,
                streamer=streamer,
                pad_token_id=0,
            )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt, max_tokens = list(body["prompt"]), int(body["max_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async with self.lock:
            streamer = TokenQueue(asyncio.get_running_loop())
            work = asyncio.create_task(
                asyncio.to_thread(self._generate, prompt, max_tokens, streamer)
            )
            count = 0
            while (token := await streamer.queue.get()) is not None:
                count += 1
                await _send(response, {"choices": [{"index": 0, "text": self._text(token)}]})
            await work
        usage = {"prompt_tokens": len(prompt), "completion_tokens": count}
        await _send(response, {"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        return response

    def _text(self, token: int) -> str:
        return str(self.tokenizer.decode([token])) or f"<{token}>"


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


async def ready(_: web.Request) -> web.Response:
    return web.json_response({"ready": True})  # the launcher's readiness poll reads JSON


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peer = Peer(args.model)
    app = web.Application()
    app.router.add_post("/v1/completions", peer.completions)
    app.router.add_get("/ready", ready)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
