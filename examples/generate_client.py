"""Stream a completion from a shardserve text-generation servable through the queue-level
API, with nothing but aio-pika and msgpack (no shardserve import).

    python examples/generate_client.py --prompt "The capital of France is" --max-tokens 16
    python examples/generate_client.py --cancel-after 3     # stop it after 3 chunks

It declares its own exclusive reply queue, publishes one GenerateRequest to the topic
exchange shardserve.requests with routing key = the servable (default "llama", as written
by `shardserve export hf tests/fixtures/hf/llama ...`), reply_to and a unique
correlation_id, then prints each GenerateChunk's text as it arrives. Chunks are numbered
by `seq` from 0; the last one has `finish_reason` and `usage`, or `error`. With
--cancel-after N it publishes a GenerateCancel after N chunks (same exchange and routing
key as the request): the stream then ends with a `cancelled` error chunk. See
docs/queue-api.md and docs/generation.md.
Exit codes: 0 finished (or cancelled as asked), 1 error chunk, 2 no chunk in time or the
mesh is not there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import msgpack

REQUESTS_EXCHANGE = "shardserve.requests"
CONTENT_TYPE = "application/msgpack"


@dataclass(frozen=True)
class Options:
    url: str
    exchange: str
    servable: str
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None
    ignore_eos: bool
    cancel_after: int  # 0: never
    timeout_s: float


def generate_request(options: Options, deadline: float) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": options.max_tokens}
    sampling["temperature"] = options.temperature  # 0 = greedy
    if options.seed is not None:  # without one the scheduler draws a seed
        sampling["seed"] = options.seed
    if options.ignore_eos:  # go on past the model's end-of-sequence token
        sampling["ignore_eos"] = True
    return {
        "v": 1,  # schema version
        "kind": "generate.request",
        "id": f"example-{uuid.uuid4().hex[:8]}",  # your own label, echoed in every chunk
        "servable": options.servable,
        "version": 0,  # 0 = highest ready version
        "prompt": options.prompt,  # or "prompt_ids": [...], or "messages": [{role, content}]
        "sampling": sampling,
        "deadline": deadline,  # absolute unix seconds
    }


def cancel_message(reply_to: str, correlation_id: str) -> dict[str, Any]:
    """Names the generation to stop by its reply queue and correlation id."""
    return {
        "v": 1,
        "kind": "generate.cancel",
        "reply_to": reply_to,
        "correlation_id": correlation_id,
    }


async def stream(options: Options) -> AsyncIterator[dict[str, Any]]:
    """Publish one GenerateRequest and yield its chunks (dicts) in order, the last included."""
    connection = await aio_pika.connect(options.url)
    async with connection:
        channel = await connection.channel()  # publisher confirms: a refused publish raises
        replies = await channel.declare_queue(exclusive=True, auto_delete=True)
        exchange = await channel.get_exchange(options.exchange, ensure=True)
        correlation_id = uuid.uuid4().hex  # unique per request: how its chunks are matched
        deadline = time.time() + options.timeout_s
        body = generate_request(options, deadline)
        await publish(exchange, options.servable, body, replies.name, correlation_id)
        received = 0
        async for chunk in chunks(replies, correlation_id, options.timeout_s):
            received += 1
            yield chunk
            if received == options.cancel_after and not is_last(chunk):
                cancel = cancel_message(replies.name, correlation_id)
                await publish(exchange, options.servable, cancel, replies.name, correlation_id)


async def publish(
    exchange: aio_pika.abc.AbstractExchange,
    servable: str,
    body: dict[str, Any],
    reply_to: str,
    correlation_id: str,
) -> None:
    message = aio_pika.Message(
        msgpack.packb(body, use_bin_type=True),
        content_type=CONTENT_TYPE,
        type=body["kind"],
        reply_to=reply_to,
        correlation_id=correlation_id,
    )
    await exchange.publish(message, routing_key=servable, mandatory=True)


async def chunks(
    replies: aio_pika.abc.AbstractQueue, correlation_id: str, timeout_s: float
) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks in `seq` order; a gap or a repeat is an error (a lost message)."""
    expected = 0
    async with asyncio.timeout(timeout_s), replies.iterator() as messages:
        async for incoming in messages:
            async with incoming.process():
                if incoming.correlation_id != correlation_id:
                    continue  # another request's message on a shared queue
                chunk = msgpack.unpackb(incoming.body, raw=False)
            if chunk["seq"] != expected:
                raise RuntimeError(f"chunk {chunk['seq']} came where {expected} was due")
            expected += 1
            yield chunk
            if is_last(chunk):
                return
    raise RuntimeError("reply queue closed before the last chunk came")


def is_last(chunk: dict[str, Any]) -> bool:
    return chunk.get("finish_reason") is not None or chunk.get("error") is not None


async def run(options: Options) -> int:
    """Print the text as it streams, then how it ended; return the exit code."""
    last: dict[str, Any] = {}
    async for chunk in stream(options):  # read to its end: the queue and connection close
        print(chunk["text"], end="", flush=True)
        last = chunk
    print()
    return report_end(last, options)


def report_end(chunk: dict[str, Any], options: Options) -> int:
    error = chunk.get("error")
    if error is None:
        usage = chunk["usage"]
        print(
            f"[finish_reason={chunk['finish_reason']} prompt_tokens={usage['prompt_tokens']} "
            f"completion_tokens={usage['completion_tokens']} chunks={chunk['seq'] + 1}]"
        )
        return 0
    if error["code"] == "cancelled" and options.cancel_after:
        print(f"[cancelled after {chunk['seq']} chunks: {error['message']}]")
        return 0
    print(f"error {error['code']}: {error['message']}", file=sys.stderr)
    return 1


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("SHARDSERVE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    parser.add_argument("--exchange", default=REQUESTS_EXCHANGE)
    parser.add_argument("--servable", default="llama")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument(
        "--cancel-after", type=int, default=0, help="cancel after this many chunks (0: never)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds")
    args = parser.parse_args(argv)
    return Options(
        args.amqp_url,
        args.exchange,
        args.servable,
        args.prompt,
        args.max_tokens,
        args.temperature,
        args.seed,
        args.ignore_eos,
        args.cancel_after,
        args.timeout,
    )


def main() -> int:
    options = parse()
    try:
        return asyncio.run(run(options))
    except TimeoutError:
        print(f"\nno last chunk within {options.timeout_s:g}s", file=sys.stderr)
        return 2
    except aio_pika.exceptions.ChannelNotFoundEntity:
        print(
            f"exchange {options.exchange!r} does not exist: is the mesh running?", file=sys.stderr
        )
        return 2
    except aio_pika.exceptions.DeliveryError as exc:
        print(f"the broker refused the request (no queue, or full): {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
