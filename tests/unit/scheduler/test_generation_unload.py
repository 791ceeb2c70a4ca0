"""Unloading a text-generation version: it drains its sequences and steps in flight, then
the generation machine and the tokenizer cache forget it (a later load starts afresh)."""

from __future__ import annotations

import shutil
from pathlib import Path

from test_generation_kit import FIXTURE, SERVABLE, Bench, request

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import RegistrationVerdict
from shardserve_scheduler.core.catalog import Catalog, ServableEntry, VersionEntry
from shardserve_scheduler.core.generation.state import Limits
from shardserve_scheduler.core.generation.texts import TOKENIZER_FOLDER, TextModels
from shardserve_scheduler.core.requests import RequestMachine
from shardserve_scheduler.repository_changes import RepositoryChanges

KEY = (SERVABLE, 1)


class Unload:
    """A bench whose version is being unloaded through RepositoryChanges."""

    def __init__(self, repo: Path, limits: Limits | None = None) -> None:
        self.bench = Bench(limits=limits)
        folder = repo / SERVABLE / "1" / TOKENIZER_FOLDER
        folder.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copyfile(FIXTURE / name, folder / name)
        self.texts = TextModels(repo)
        entry = VersionEntry(self.bench.group)
        self.catalog = Catalog({SERVABLE: ServableEntry(SERVABLE, {1: entry})})
        self.verdicts: list[RegistrationVerdict] = []
        self.changes = RepositoryChanges(
            repo,
            self.catalog,
            self.bench.registry,
            RequestMachine(result_to="results.q", id_prefix="t"),
            changed=lambda: None,
            send_verdict=self.verdicts.append,
            generation=self.bench.machine,
            texts=self.texts,
        )


def test_unload_waits_for_running_sequences_then_forgets_the_version(tmp_path: Path) -> None:
    unload = Unload(tmp_path)
    bench = unload.bench
    first_text = unload.texts(bench.group)
    bench.generate("a", request("a", max_tokens=3))
    unload.changes.start_unload(KEY)
    assert not unload.changes.finish_unloads()  # a sequence is still running
    assert KEY in bench.machine.state.versions and unload.catalog.entry(KEY) is not None

    bench.run_until_idle()
    assert bench.last("a").finish_reason == "length"
    assert unload.changes.finish_unloads()
    assert KEY not in bench.machine.state.versions
    assert unload.catalog.entry(KEY) is None
    assert sorted(v.instance for v in unload.verdicts) == ["agent-0", "agent-1"]
    assert unload.texts(bench.group) is not first_text  # read again from the folder


def test_unload_waits_for_a_step_in_flight_after_a_cancel(tmp_path: Path) -> None:
    unload = Unload(tmp_path)
    bench = unload.bench
    bench.generate("a", request("a", max_tokens=50))
    bench.take(bench.machine.on_cancel("reply.q", "a", bench.now))
    assert bench.last("a").error is not None
    assert bench.last("a").error.code == ErrorCode.CANCELLED  # type: ignore[union-attr]
    unload.changes.start_unload(KEY)
    assert bench.pending and not bench.machine.state.sequences
    assert not unload.changes.finish_unloads()  # its step has not answered yet

    bench.run_until_idle()  # a late result of a forgotten version would find no run
    assert unload.changes.finish_unloads()
    assert KEY not in bench.machine.state.versions


def test_waiting_sequences_keep_the_version_too(tmp_path: Path) -> None:
    unload = Unload(tmp_path, Limits(max_running=1))
    bench = unload.bench
    bench.generate("a", request("a", max_tokens=2))
    bench.generate("b", request("b", max_tokens=2))
    assert bench.machine.waiting(SERVABLE, 1) == 1
    unload.changes.start_unload(KEY)
    bench.run_step()
    while bench.machine.running(SERVABLE, 1) or bench.machine.waiting(SERVABLE, 1):
        assert not unload.changes.finish_unloads()
        bench.run_step()
    bench.run_until_idle()
    assert bench.last("b").finish_reason == "length"
    assert unload.changes.finish_unloads()
