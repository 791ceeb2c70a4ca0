"""Bearer-token auth and the gateway's command line / environment settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_fakes import MakeGateway

from shardserve_gateway import auth
from shardserve_gateway.settings import GatewaySettings, build_parser, load_tokens

TOKENS = ("alpha-token", "beta-token")


async def test_missing_or_wrong_token_is_401(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(tokens=TOKENS)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic alpha-token"}):
        resp = await gw.client.get("/v2/models/matmul", headers=headers)
        assert resp.status == 401
        assert resp.headers["Content-Type"] == "application/json"
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert "bearer token" in (await resp.json())["error"]


async def test_any_configured_token_is_accepted(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(tokens=TOKENS)
    for token in TOKENS:
        resp = await gw.client.get("/v2", headers={"Authorization": f"Bearer {token}"})
        assert resp.status == 200


async def test_unauthenticated_infer_never_reaches_the_broker(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(tokens=TOKENS)
    resp = await gw.client.post("/model/matmul:predict", data=b'{"instances": {"x": 1}}')
    assert resp.status == 401
    assert "error_msg" in await resp.json()
    assert gw.dispatcher.requests == []


async def test_health_and_metrics_are_open_by_default(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(tokens=TOKENS)
    for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
        assert (await gw.client.get(path)).status == 200
    assert (await gw.client.get("/v2")).status == 401


async def test_no_open_health_protects_health_too(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(tokens=TOKENS, open_health=False)
    assert (await gw.client.get("/v2/health/live")).status == 401


async def test_every_token_is_compared_in_constant_time(
    make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    gw = await make_gateway(tokens=TOKENS)
    await gw.client.get("/v2", headers={"Authorization": "Bearer alpha-token"})
    # All tokens are compared, even after the first one matched.
    assert calls == [(b"alpha-token", b"alpha-token"), (b"alpha-token", b"beta-token")]


def test_tokens_from_file_and_env(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# comment\n\nfile-token\nshared\n")
    assert load_tokens(str(path), "env-a, shared,") == ("env-a", "shared", "file-token")


def test_parser_defaults_from_environment(tmp_path: Path) -> None:
    env = {
        "SHARDSERVE_GATEWAY_HTTP_PORT": "9999",
        "SHARDSERVE_GATEWAY_OPEN_HEALTH": "false",
        "SHARDSERVE_GATEWAY_TOKENS": "t1,t2",
        "SHARDSERVE_AMQP_URL": "amqp://u:p@broker:5672/",
    }
    args = build_parser(env).parse_args(["--max-body-mb", "2", "--default-timeout", "500"])
    settings = GatewaySettings.from_args(args, env)
    assert settings.http_port == 9999
    assert settings.open_health is False
    assert settings.tokens == ("t1", "t2")
    assert settings.max_body_bytes == 2 * 1024 * 1024
    assert settings.default_timeout_s == 300.0  # capped at --max-timeout
    assert settings.broker.url == "amqp://u:p@broker:5672/"
    assert settings.gateway_id.startswith("gw-")


def test_pinned_command_line_parses() -> None:
    argv = [
        "--host",
        "0.0.0.0",
        "--http-port",
        "8080",
        "--default-timeout",
        "30",
        "--max-body-mb",
        "64",
        "--drain-seconds",
        "10",
        "--no-open-health",
    ]
    settings = GatewaySettings.from_args(build_parser({}).parse_args(argv), {})
    assert (settings.host, settings.drain_seconds, settings.open_health) == ("0.0.0.0", 10, False)


def test_tls_options_come_in_pairs() -> None:
    args = build_parser({}).parse_args(["--tls-cert", "c.pem"])
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        GatewaySettings.from_args(args, {})


def test_reuse_port_is_off_unless_asked_on_the_command_line_or_in_the_environment() -> None:
    def reuse_port(argv: list[str], env: dict[str, str]) -> bool:
        return GatewaySettings.from_args(build_parser(env).parse_args(argv), env).reuse_port

    assert reuse_port([], {}) is False
    assert reuse_port(["--reuse-port"], {}) is True
    assert reuse_port([], {"SHARDSERVE_GATEWAY_REUSE_PORT": "1"}) is True
    assert reuse_port(["--no-reuse-port"], {"SHARDSERVE_GATEWAY_REUSE_PORT": "1"}) is False
