"""Fixtures for gateway unit tests (helpers live in ``gateway_fakes``, importable because
this folder is put on sys.path: tests run with --import-mode=importlib)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

sys.path.insert(0, str(Path(__file__).parent))

from gateway_fakes import (
    FakeDispatcher,
    Gateway,
    Handler,
    MakeGateway,
    ManualClock,
    mesh_status,
    model_reply,
)

from shardserve.wire.protocol import ServableStatus
from shardserve_gateway.app import create_app
from shardserve_gateway.mesh_view import MeshView
from shardserve_gateway.settings import GatewaySettings


@pytest.fixture
async def make_gateway() -> AsyncIterator[MakeGateway]:
    clients: list[TestClient[Any, Any]] = []

    async def make(
        *servables: ServableStatus,
        handler: Handler = model_reply,
        status: bool = True,
        **overrides: Any,
    ) -> Gateway:
        settings = replace(GatewaySettings(gateway_id="gw-test"), **overrides)
        clock = ManualClock()
        view = MeshView(settings.status_stale_s, clock=clock)
        if status:
            view.update(mesh_status(*servables))
        dispatcher = FakeDispatcher(handler)
        app = create_app(settings, dispatcher=dispatcher, mesh_view=view)
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return Gateway(client, dispatcher, view, clock)

    yield make
    for client in reversed(clients):
        await client.close()


@pytest.fixture
async def gateway(make_gateway: MakeGateway) -> Gateway:
    return await make_gateway()
