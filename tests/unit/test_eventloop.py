"""The services' event loop choice: uvloop by default, asyncio on request, bad values named."""

from __future__ import annotations

import asyncio
import sys

import pytest

from shardserve.process.eventloop import loop_factory


def loop_type(choice: str | None) -> str:
    factory = loop_factory(choice)
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        return type(loop).__module__.split(".")[0]
    finally:
        loop.close()


# uvloop is a dependency wherever it runs (pyproject): missing there, this test fails.
@pytest.mark.skipif(sys.platform == "win32", reason="uvloop does not run on Windows")
@pytest.mark.parametrize("choice", [None, "", "uvloop", " UVLOOP "])
def test_default_and_uvloop_give_uvloop(choice: str | None) -> None:
    assert loop_type(choice) == "uvloop"


def test_asyncio_gives_the_default_loop() -> None:
    assert loop_factory("asyncio") is None
    assert loop_type("asyncio") == "asyncio"


def test_unknown_loop_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="SHARDSERVE_EVENT_LOOP must be one of uvloop, asyncio"):
        loop_factory("trio")
