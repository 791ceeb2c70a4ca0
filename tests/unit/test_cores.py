"""Usable cores (affinity capped by a cgroup CPU quota) and the agents' thread share."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.ops.launch.plan import UpOptions, agent_specs, discover_groups, with_agent_threads
from shardserve.process.cores import (
    cgroup_cpu_quota,
    parse_threads,
    threads_per_agent,
    usable_cores,
)
from shardserve.tools.export.matmul import export_matmul


def _cgroup_v2(root: Path, cpu_max: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def _cgroup_v1(root: Path, quota_us: str, period_us: str) -> Path:
    (root / "cpu").mkdir(parents=True, exist_ok=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(quota_us + "\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(period_us + "\n")
    return root


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [("max 100000", None), ("200000 100000", 2.0), ("50000 100000", 0.5), ("junk", None)],
)
def test_cgroup_v2_quota(tmp_path: Path, cpu_max: str, quota: float | None) -> None:
    assert cgroup_cpu_quota(_cgroup_v2(tmp_path, cpu_max)) == quota


@pytest.mark.parametrize(
    ("quota_us", "period_us", "quota"),
    [("-1", "100000", None), ("150000", "100000", 1.5), ("300000", "100000", 3.0)],
)
def test_cgroup_v1_quota(tmp_path: Path, quota_us: str, period_us: str, quota: float) -> None:
    assert cgroup_cpu_quota(_cgroup_v1(tmp_path, quota_us, period_us)) == quota


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None


def test_usable_cores_is_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    eight = lambda: 8  # noqa: E731
    assert usable_cores(tmp_path / "none", affinity=eight) == 8
    assert usable_cores(_cgroup_v2(tmp_path / "a", "300000 100000"), affinity=eight) == 3
    assert usable_cores(_cgroup_v2(tmp_path / "b", "2500000 100000"), affinity=eight) == 8
    assert usable_cores(_cgroup_v2(tmp_path / "c", "50000 100000"), affinity=eight) == 1


def test_this_process_has_at_least_one_usable_core() -> None:
    assert usable_cores() >= 1


@pytest.mark.parametrize(
    ("agents", "cores", "threads"),
    [(1, 1, 1), (3, 1, 1), (1, 2, 2), (2, 2, 1), (8, 2, 1), (1, 8, 8), (3, 8, 2), (4, 33, 8)],
)
def test_agents_share_the_cores_evenly(agents: int, cores: int, threads: int) -> None:
    assert threads_per_agent(agents, cores) == threads


@pytest.mark.parametrize(
    ("agents", "cores", "requested", "threads"),
    [(1, 2, 1, 1), (1, 2, 2, 2), (1, 2, 8, 2), (2, 2, 2, 1), (4, 2, 3, 1), (2, 16, 3, 3)],
)
def test_a_requested_count_is_kept_up_to_the_share(
    agents: int, cores: int, requested: int, threads: int
) -> None:
    assert threads_per_agent(agents, cores, requested) == threads


def test_threads_option_takes_a_count_or_auto() -> None:
    assert (
        parse_threads("4") == 4 and parse_threads("auto") is None and parse_threads("AUTO") is None
    )
    for bad in ("0", "-2", "many"):
        with pytest.raises(ValueError, match="positive number of threads or 'auto'"):
            parse_threads(bad)


def test_up_gives_every_agent_its_share_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    matmul_repo = tmp_path / "repo"
    export_matmul(matmul_repo, rank_size=2)
    monkeypatch.setattr("shardserve.ops.launch.plan.usable_cores", lambda: 17)
    groups = discover_groups(matmul_repo)
    agents = sum(g.rank_size for g in groups)
    options, cores = with_agent_threads(UpOptions(), agents)
    assert cores == 17 and options.threads == threads_per_agent(agents, 17)
    [spec, *_] = agent_specs(matmul_repo, groups[0], options, False)
    assert spec.argv[-2:] == ("--threads", str(options.threads))
    told, _ = with_agent_threads(UpOptions(threads=3), agents)
    too_many, _ = with_agent_threads(UpOptions(threads=64), agents)
    assert told.threads == 3 and too_many.threads == threads_per_agent(agents, 17)
