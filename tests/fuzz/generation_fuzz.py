"""Fuzzing that reaches the generation servables (issue 36): Hypothesis-made bodies for
``/v1/completions``, ``/v1/chat/completions``, ``/v2/models/{m}/generate`` and
``generate_stream`` aimed at a served HF fixture (real tokenizer, real ranks), while one
well-formed greedy stream after another runs beside them and must give the fixture's
reference text every time.

A body is a well-formed request with some fields replaced by poison: integers past 2**64,
NaN and infinities, subnormal temperatures, unpaired surrogates, prompts past the limit,
deep nesting, wrong types; or a JSON value of any shape. Every request must be answered
(within ``REQUEST_TIMEOUT_S``) with a status below 500.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests
from hypothesis import given
from hypothesis import strategies as st
from tests.fuzz.http_fuzz import _settings as fuzz_settings
from tests.fuzz.http_fuzz import run_in_chunks
from tests.fuzz.tally import HttpTally

REQUEST_TIMEOUT_S = 60.0
POISON_NUMBERS = (2**64, 2**63, -(2**64), 2**31, -1, 0, 1e-310, 5e-324, 1e308, -0.0)
NON_FINITE = ("NaN", "Infinity", "-Infinity")  # JSON as Python writes and reads it
POISON_TEXT = ("\ud800", "a\udfffb", "", "\x00", "x" * 1_100_000, "hello world " * 20_000)


def _poison() -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.sampled_from(POISON_NUMBERS),
        st.sampled_from(POISON_TEXT),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
        st.booleans(),
        st.none(),
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=8,
    )


# Built once: a strategy made per draw is validated per draw, and its validation keeps the
# repr of POISON_TEXT (megabytes) in Hypothesis' caches: 0.3 MB a case, 7 GB a route at
# 10,000 cases.
POISON = _poison()
POISON_OR_NON_FINITE = POISON | st.sampled_from(NON_FINITE).map(float)


FIELDS = {
    "openai": (
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
    ),
    "chat": (
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "stream",
        "logprobs",
        "top_logprobs",
        "stop_token_ids",
    ),
    "triton": ("text_input", "parameters"),
    "triton-parameters": (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
    ),
}


def base_body(route: str, model: str) -> dict[str, Any]:
    if route == "completions":
        return {"model": model, "prompt": "Hello", "max_tokens": 4}
    if route == "chat":
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return {"text_input": "Hello", "parameters": {"max_tokens": 4}}


@st.composite
def bodies(draw: st.DrawFn, route: str, model: str) -> str:
    """A JSON text: a well-formed body with poisoned fields, or any JSON value, or deep."""
    shape = draw(st.integers(0, 19))
    if shape == 0:
        return json.dumps(draw(POISON))
    if shape == 1:
        return "[" * draw(st.integers(1_000, 200_000))
    body = base_body(route, model)
    names = FIELDS["openai" if route == "completions" else route if route == "chat" else "triton"]
    for name in draw(st.lists(st.sampled_from(names), max_size=3)):  # (none: well-formed)
        body[name] = draw(POISON)
    if route.startswith("triton") and isinstance(body.get("parameters"), dict):
        for name in draw(st.lists(st.sampled_from(FIELDS["triton-parameters"]), max_size=3)):
            body["parameters"][name] = draw(POISON_OR_NON_FINITE)
    if route == "chat" and draw(st.booleans()):
        body["messages"] = [{"role": draw(POISON), "content": draw(POISON)}]
    if draw(st.integers(0, 4)) == 0:  # a non-finite number where one is read
        body[draw(st.sampled_from(("temperature", "top_p", "max_tokens")))] = float(
            draw(st.sampled_from(NON_FINITE))
        )
    return json.dumps(body)  # (Python writes NaN, lone surrogates as \\udXXX escapes)


ROUTES = {  # route -> path for model m
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "triton": "/v2/models/{m}/generate",
    "triton-stream": "/v2/models/{m}/generate_stream",
}


def fuzz_route(base_url: str, model: str, route: str, tally: HttpTally, count: int) -> None:
    session = requests.Session()
    path = ROUTES[route].format(m=model)
    body_route = "triton" if route.startswith("triton") else route

    def run(examples: int, seed: int) -> None:
        @fuzz_settings(examples, seed)
        @given(text=bodies(body_route, model))
        def one(text: str) -> None:
            post(text)

        one()

    def post(text: str) -> None:
        started = time.monotonic()
        try:
            response = session.post(
                base_url + path,
                data=text.encode("utf-8", "surrogatepass"),
                headers={"Content-Type": "application/json"},
                timeout=REQUEST_TIMEOUT_S,
            )
            response.content  # noqa: B018 (read a stream to its end)
        except requests.RequestException as exc:
            tally.record(0, f"POST {path}: {type(exc).__name__}: {text[:200]!r}")
            return
        what = f"POST {path} {text[:200]!r} -> {response.text[:200]!r}"
        tally.record(response.status_code, what, time.monotonic() - started)

    run_in_chunks(count, lambda: tally.sent, run)


@dataclass
class WellFormedStreams:
    """Greedy streams of the reference prompt one after another until ``stop``: each must
    give the reference text."""

    base_url: str
    model: str
    prompt: str
    expected: str
    tokens: int
    completed: int = 0
    wrong: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        session = requests.Session()
        while not self.stop.is_set():
            text = self._one(session)
            if text == self.expected:
                self.completed += 1
            elif len(self.wrong) < 10:
                self.wrong.append(text)

    def _one(self, session: requests.Session) -> str:
        body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        parts = []
        try:
            with session.post(
                self.base_url + "/v1/completions", json=body, stream=True, timeout=120
            ) as response:
                if response.status_code != 200:
                    return f"status {response.status_code}: {response.text[:200]}"
                for line in response.iter_lines():
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            return f"error event {event['error']}"
                        parts += [c["text"] for c in event["choices"]]
        except requests.RequestException as exc:
            return f"{type(exc).__name__}: {exc}"
        return "".join(parts)

    @property
    def passed(self) -> bool:
        return self.completed > 0 and not self.wrong

    def summary(self) -> str:
        return (
            f"well-formed streams: {self.completed} right, {len(self.wrong)} wrong {self.wrong[:2]}"
        )
