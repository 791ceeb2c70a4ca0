"""The OpenAI surface as vLLM users expect it, through a real mesh (`shardserve up` on the
llama fixture at TP 2 and at 2 stages x TP 2) and the unchanged `openai` package: penalties,
logit_bias and min_tokens give the same tokens at every layout and on every run;
generation_config.json's defaults apply when a request leaves a field out; max_tokens left out
fills the context and one beyond it is a 400 naming it (OpenAI, Triton); what stays
unsupported is a 400 naming the parameter; models.retrieve; every /v1 error in OpenAI's
shape; Triton generate takes top-level parameters. And the commands around the mesh: a
second `shardserve up` on its vhost is refused naming it, `shardserve status` finds its
gateway (not port 8080) and ends quietly when its reader does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from shardserve.ops.child_mesh import SHARDSERVE, LocalMesh
from shardserve.text.tokenizer import TextModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import FIXTURE, REFERENCE, layouts_mesh

pytestmark = pytest.mark.integration

SERVABLES = ("llama_tp2", "llama_pp2")
PROMPT = REFERENCE["prompts"][1]  # its greedy continuation repeats tokens
CONTEXT = 128
EOS = 1  # the fixture's generation_config: eos_token_id [1, 4]
TEXT = TextModel.load(FIXTURE, "llama", 512)


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    # Its own user cache: the run record `status` reads is this mesh's alone.
    cache = {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}
    with layouts_mesh(isolated_amqp_url, tmp_path_factory, env=cache) as mesh:
        yield mesh


def client_of(mesh: LocalMesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)


def repeats(tokens: list[str]) -> int:
    return len(tokens) - len(set(tokens))


# --- penalties, logit_bias, min_tokens ------------------------------------------------------


async def test_penalties_give_the_same_tokens_at_every_layout_and_every_run(
    mesh: LocalMesh,
) -> None:
    n = len(PROMPT["greedy_ids"])
    penalties = {"repetition_penalty": 1.5, "ignore_eos": True}
    async with client_of(mesh) as client:

        async def run(servable: str, temperature: float) -> list[str]:
            done = await client.completions.create(
                model=servable,
                prompt=PROMPT["text"],
                max_tokens=n,
                temperature=temperature,
                seed=5,
                presence_penalty=1.0,
                frequency_penalty=1.5,
                logprobs=0,
                extra_body=penalties,
            )
            logprobs = done.choices[0].logprobs
            assert logprobs is not None and logprobs.tokens is not None
            return list(logprobs.tokens)

        runs = [(s, t) for t in (0.0, 0.9) for s in SERVABLES for _ in range(2)]
        texts = await asyncio.gather(*(run(s, t) for s, t in runs))
    greedy = texts[:4]
    sampled = texts[4:]
    assert all(t == greedy[0] for t in greedy), greedy
    assert all(t == sampled[0] for t in sampled), sampled
    plain = [TEXT.token_text(i) for i in PROMPT["greedy_ids"]]
    assert repeats(plain) > 0
    assert repeats(greedy[0]) < repeats(plain)


@pytest.mark.parametrize("servable", SERVABLES)
async def test_logit_bias_forces_and_bans_tokens(mesh: LocalMesh, servable: str) -> None:
    first = PROMPT["greedy_ids"][0]
    async with client_of(mesh) as client:
        forced = await client.completions.create(
            model=servable,
            prompt=PROMPT["text"],
            max_tokens=6,
            temperature=1.0,
            logit_bias={"300": 100},
            extra_body={"ignore_eos": True},
        )
        banned = await client.completions.create(
            model=servable,
            prompt=PROMPT["text"],
            max_tokens=1,
            temperature=0.0,
            logit_bias={str(first): -100},
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.BadRequestError) as outside:
            await client.completions.create(
                model=servable, prompt="Hi", max_tokens=2, logit_bias={"512": 1}
            )
    assert forced.choices[0].text == TEXT.decode([300] * 6)
    assert banned.choices[0].text != TEXT.decode([first])
    assert "logit_bias names token 512, outside the vocabulary [0, 512)" in str(outside.value)


@pytest.mark.parametrize("servable", SERVABLES)
async def test_min_tokens_holds_eos_back_until_reached(mesh: LocalMesh, servable: str) -> None:
    async with client_of(mesh) as client:

        async def eager_eos(**extra: Any) -> openai.types.Completion:
            return await client.completions.create(
                model=servable,
                prompt=PROMPT["text"],
                max_tokens=20,
                temperature=0.0,
                logit_bias={str(EOS): 100},
                extra_body=extra,
            )

        at_once, held = await asyncio.gather(eager_eos(), eager_eos(min_tokens=5))
    assert at_once.choices[0].finish_reason == "stop"
    assert at_once.usage is not None and at_once.usage.completion_tokens == 1  # the EOS
    assert held.choices[0].finish_reason == "stop"
    assert held.usage is not None and held.usage.completion_tokens == 6  # 5, then the EOS


# --- defaults: generation_config.json, max_tokens -------------------------------------------


async def test_omitted_fields_take_generation_config_greedy_and_fill_the_context(
    mesh: LocalMesh,
) -> None:
    """The fixture's generation_config says do_sample false: no temperature means greedy;
    chat without max_tokens runs to EOS or the context, not 16 tokens."""
    async with client_of(mesh) as client:
        texts = await asyncio.gather(
            *(
                client.completions.create(
                    model=servable,
                    prompt=PROMPT["text"],
                    max_tokens=len(PROMPT["greedy_ids"]),
                    extra_body={"ignore_eos": True},
                )
                for servable in SERVABLES
            )
        )
        chat = await client.chat.completions.create(
            model="llama_tp2",
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"ignore_eos": True},
        )
    assert [t.choices[0].text for t in texts] == [PROMPT["greedy_text"]] * 2
    assert chat.usage is not None
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT
    assert chat.choices[0].finish_reason == "length"


async def test_max_tokens_beyond_the_context_is_a_400_naming_it(mesh: LocalMesh) -> None:
    prompt_len = len(PROMPT["input_ids"])
    room = CONTEXT - prompt_len
    async with client_of(mesh) as client:
        with pytest.raises(openai.BadRequestError) as completion:
            await client.completions.create(
                model="llama_tp2", prompt=PROMPT["text"], max_tokens=room + 1
            )
        with pytest.raises(openai.BadRequestError) as chat:
            await client.chat.completions.create(
                model="llama_pp2", messages=[{"role": "user", "content": "Hi"}], max_tokens=500
            )
        fits = await client.completions.create(
            model="llama_tp2",
            prompt=PROMPT["text"],
            max_tokens=room,
            extra_body={"ignore_eos": True},
        )
    assert f"max_tokens is {room + 1}" in str(completion.value)
    assert f"at most {room} tokens can be generated" in str(completion.value)
    assert "max_tokens is 500" in str(chat.value)
    assert fits.usage is not None and fits.usage.completion_tokens == room
    url = f"{mesh.http_url}/v2/models/llama_tp2/generate"
    async with aiohttp.ClientSession() as session:
        body = {"text_input": PROMPT["text"], "max_tokens": room + 1}
        async with session.post(url, json=body) as response:
            assert response.status == 400
            assert f"max_tokens is {room + 1}" in (await response.json())["error"]


# --- what stays unsupported, models.retrieve, OpenAI's error shape ---------------------------


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("best_of", 2),
        ("suffix", "the end"),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
    ],
)
async def test_unsupported_parameters_are_a_400_naming_them(
    mesh: LocalMesh, param: str, value: Any
) -> None:
    async with client_of(mesh) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            if param in ("best_of", "suffix"):
                await client.completions.create(
                    model="llama_tp2", prompt="Hi", max_tokens=2, extra_body={param: value}
                )
            else:
                await client.chat.completions.create(
                    model="llama_tp2",
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=2,
                    extra_body={param: value},
                )
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert "not supported" in body["message"]


async def test_models_retrieve_and_openai_errors_on_every_v1_route(mesh: LocalMesh) -> None:
    async with client_of(mesh) as client:
        model = await client.models.retrieve("llama_pp2")
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("nope")
        with pytest.raises(openai.NotFoundError) as unknown_route:
            await client.embeddings.create(model="llama_tp2", input="Hi")
    assert (model.id, model.object) == ("llama_pp2", "model")
    assert "model 'nope' not found; models: llama_pp2, llama_tp2" in str(missing.value)
    body = unknown_route.value.body
    assert isinstance(body, dict) and body["code"] == "not_found", body
    assert body["message"] == "no route for POST /v1/embeddings"


async def test_triton_generate_takes_top_level_parameters(mesh: LocalMesh) -> None:
    n = len(PROMPT["greedy_ids"])
    url = f"{mesh.http_url}/v2/models/llama_pp2/generate"
    async with aiohttp.ClientSession() as session:
        top = {"text_input": PROMPT["text"], "max_tokens": n, "ignore_eos": True}
        async with session.post(url, json=top) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["text_output"] == PROMPT["greedy_text"]
        twice = {**top, "parameters": {"max_tokens": 3}}
        async with session.post(url, json=twice) as response:
            assert response.status == 400
            assert "max_tokens is given both" in (await response.json())["error"]
        misspelt = {**top, "max_token": 3}
        async with session.post(url, json=misspelt) as response:
            assert response.status == 400
            assert "max_token" in (await response.json())["error"]


# --- the commands around a running mesh -------------------------------------------------------


def test_a_second_up_on_the_same_vhost_is_refused_naming_the_running_mesh(
    mesh: LocalMesh,
) -> None:
    second = subprocess.run(
        [SHARDSERVE, "up", str(mesh.repo), "--http-port", "0"],
        env=mesh.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode != 0
    vhost = mesh.amqp_url.rsplit("/", 1)[1]
    assert f"a mesh already runs on the broker's vhost '{vhost}'" in second.stderr
    assert f"gateway {mesh.http_url}" in second.stderr and str(mesh.repo) in second.stderr
    assert "Traceback" not in second.stderr


def test_status_finds_the_gateway_up_started_and_ends_quietly_in_a_pipe(
    mesh: LocalMesh,
) -> None:
    assert mesh.http_port != 8080
    whole = subprocess.run(
        [SHARDSERVE, "status"],
        env=mesh.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert whole.returncode == 0, whole.stderr
    assert "llama_tp2" in whole.stdout and "llama_pp2" in whole.stdout
    piped = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{SHARDSERVE} status | head -1"],
        env=mesh.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == whole.stdout.splitlines(keepends=True)[0]
    assert piped.stderr == ""
