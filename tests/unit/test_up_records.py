"""The run records `shardserve up` leaves for `status` and for a second `up`
(shardserve.ops.launch.records): kept while the block runs, newest first, a killed `up`'s
record ignored and removed; the vhost an AMQP URL names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardserve.ops.launch.records import UpRecord, live_records, vhost_of


def test_a_record_lives_while_its_block_runs(tmp_path: Path) -> None:
    record = UpRecord(os.getpid(), "http://127.0.0.1:9001", "/repo", "v1")
    with record.kept(tmp_path):
        assert live_records(tmp_path) == [record]
    assert live_records(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_the_newest_live_record_comes_first_and_a_dead_ones_is_removed(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = UpRecord(int(gone.stdout), "http://127.0.0.1:9000", "/old", "v1")
    older = UpRecord(os.getppid(), "http://127.0.0.1:9002", "/a", "v1")
    newer = UpRecord(os.getpid(), "http://127.0.0.1:9003", "/b", "v2")
    with dead.kept(tmp_path), older.kept(tmp_path):
        os.utime(tmp_path / f"{older.pid}.json", (1.0, 1.0))
        with newer.kept(tmp_path):
            assert live_records(tmp_path) == [newer, older]
            assert not (tmp_path / f"{dead.pid}.json").exists()
    (tmp_path / "broken.json").write_text("{")
    assert live_records(tmp_path) == []


def test_the_vhost_of_an_amqp_url() -> None:
    assert vhost_of("amqp://guest:guest@127.0.0.1:5672/shardserve-test-1") == "shardserve-test-1"
    assert vhost_of("amqp://guest:guest@127.0.0.1:5672/") == "/"
    assert vhost_of("amqp://guest:guest@127.0.0.1:5672") == "/"
    assert vhost_of("amqp://h/%2Fteam") == "/team"
