"""The ``shardserve`` command: export through a real subprocess, clear usage errors, the
hand-over to service parsers, and the pure pieces of ``up`` and ``status``."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardserve import cli
from shardserve.ops.launch.plan import (
    UpOptions,
    discover_groups,
    plan_children,
    repository_version_is_valid,
)
from shardserve.ops.launch.status import all_ready, format_status, progress_lines, public_url
from shardserve.process.redact import redact_url
from shardserve.repo.repository import GroupConfig, load_group, verify_rank_files


def shardserve(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


@pytest.fixture(scope="module")
def matmul_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    shardserve("export", "matmul", "--rank-size", "4", "--out", str(repo), check=True)
    return repo


def test_export_matmul_writes_a_valid_repository(matmul_repo: Path) -> None:
    group = load_group(matmul_repo, "matmul", 1)
    assert (group.rank_size, group.stage_size) == (4, 1)
    for rank in range(4):
        assert verify_rank_files(matmul_repo, group, rank)
    assert (matmul_repo / "matmul" / "servable_config.py").is_file()
    assert repository_version_is_valid(matmul_repo, "matmul", 1)


def test_export_reports_on_stdout_and_progress_per_rank_on_stderr(tmp_path: Path) -> None:
    result = shardserve(
        "export", "matmul", "--rank-size", "2", "--stage-size", "2", "--strategy", "row",
        "--name", "mm", "--version", "3", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("mm v3: 2 ranks, 2 stage(s)")
    assert "stage 1 ranks [1]" in result.stdout
    assert [line for line in result.stderr.splitlines() if line.startswith("rank ")] == [
        line for line in result.stderr.splitlines() if "rank" in line and "wrote seg" in line
    ]
    assert sum(1 for line in result.stderr.splitlines() if line.startswith("rank ")) == 2


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--rank-size", "3"], "do not divide 16"),
        (["--rank-size", "4", "--stage-size", "3"], "stage_size"),
        (["--rank-size", "5", "--stage-size", "2"], "multiple of stage_size"),
        (["--rank-size", "0"], "must be >= 1"),
        (["--rank-size", "2", "--strategy", "diagonal"], "invalid choice"),
    ],
)
def test_invalid_export_exits_2_with_the_reason(
    tmp_path: Path, args: list[str], reason: str
) -> None:
    result = shardserve("export", "matmul", "--out", str(tmp_path), *args)
    assert result.returncode == 2
    assert reason in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "matmul" / "1").exists()


def test_existing_export_is_refused_kept_or_replaced(matmul_repo: Path, tmp_path: Path) -> None:
    again = shardserve("export", "matmul", "--rank-size", "4", "--out", str(matmul_repo))
    assert again.returncode == 2 and "already exists" in again.stderr

    kept = shardserve("export", "matmul", "--rank-size", "2", "--if-missing", "--out",
                      str(matmul_repo))  # fmt: skip
    assert kept.returncode == 0 and "kept" in kept.stdout
    assert load_group(matmul_repo, "matmul", 1).rank_size == 4

    copy = tmp_path / "copy"
    shardserve("export", "matmul", "--rank-size", "4", "--out", str(copy), check=True)
    replaced = shardserve("export", "matmul", "--rank-size", "2", "--overwrite", "--out",
                          str(copy))  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    assert load_group(copy, "matmul", 1).rank_size == 2


def test_if_missing_replaces_a_damaged_version(tmp_path: Path) -> None:
    shardserve("export", "matmul", "--rank-size", "2", "--out", str(tmp_path), check=True)
    (tmp_path / "matmul" / "1" / "rank_1" / "seg0.onnx").write_bytes(b"not onnx")
    assert not repository_version_is_valid(tmp_path, "matmul", 1)
    fixed = shardserve("export", "matmul", "--rank-size", "2", "--if-missing", "--out",
                       str(tmp_path))  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    assert repository_version_is_valid(tmp_path, "matmul", 1)
    both = shardserve("export", "matmul", "--rank-size", "2", "--if-missing", "--overwrite",
                      "--out", str(tmp_path))  # fmt: skip
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_slice_cuts_an_onnx_model_into_stages_and_ranks(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shardserve("export", "matmul", "--rank-size", "1", "--out", str(source), check=True)
    model = source / "matmul" / "1" / "rank_0" / "seg0.onnx"
    out = tmp_path / "sliced"
    result = shardserve("slice", str(model), "--stages", "2", "--tensor-parallel", "2",
                        "--name", "mm", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("mm v1: 4 ranks, 2 stage(s)")
    group = load_group(out, "mm", 1)
    assert [s.ranks for s in group.stages] == [(0, 1), (2, 3)]
    too_many = shardserve("slice", str(model), "--stages", "5", "--out", str(out / "x"))
    assert too_many.returncode == 2 and "cannot fill 5 stages" in too_many.stderr
    missing = shardserve("slice", str(tmp_path / "nope.onnx"), "--stages", "1", "--out", str(out))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_every_subcommand_is_registered() -> None:
    parser = cli.build_parser()
    names = set(cli.SUBCOMMANDS)
    assert {"export", "slice", "up", "status", "gateway", "scheduler", "agent"} <= names
    help_text = parser.format_help()
    for name in names:
        assert name in help_text


def test_up_and_status_parse_their_options() -> None:
    parser = cli.build_parser()
    up = parser.parse_args(
        ["up", "/models", "--http-port", "9000", "--host", "0.0.0.0",
         "--wait-agents-seconds", "5", "--threads", "2", "--no-cache"]
    )  # fmt: skip
    assert (up.repository, up.http_port, up.host, up.threads, up.no_cache) == (
        Path("/models"), 9000, "0.0.0.0", 2, True,
    )  # fmt: skip
    assert parser.parse_args(["up"]).repository is None
    assert parser.parse_args(["up"]).threads is None  # auto: a share of the usable cores
    assert parser.parse_args(["up", "--threads", "auto"]).threads is None
    assert parser.parse_args(["warmup", "/m", "--threads", "auto"]).threads is None
    assert parser.parse_args(["up"]).repository_poll_seconds == 2.0
    assert parser.parse_args(["up", "--repository-poll-seconds", "0"]).repository_poll_seconds == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--repository-poll-seconds", "-1"])
    status = parser.parse_args(["status", "--url", "http://h:1"])
    assert status.url == "http://h:1"


def test_status_without_a_gateway_fails_clearly() -> None:
    result = shardserve("status", "--url", "http://127.0.0.1:9", "--timeout", "2")
    assert result.returncode == 1
    assert "cannot read http://127.0.0.1:9/api/status" in result.stderr


@pytest.mark.parametrize(
    ("service", "own_options"),
    [
        ("agent", ("--rank", "--servable")),
        ("scheduler", ("--wait-agents-seconds", "--heartbeat-timeout")),
        ("gateway", ("--http-port", "--max-body-mb")),
    ],
)
def test_service_subcommand_reaches_the_service_parser(
    service: str, own_options: tuple[str, ...]
) -> None:
    result = shardserve(service, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: shardserve_{service} ")  # the service's own prog
    assert "Distributed inference serving" not in result.stdout  # not our own parser
    assert [option for option in own_options if option not in result.stdout] == []


def test_service_subcommand_passes_exit_codes_through() -> None:
    result = shardserve("agent", "--no-such-option")
    assert result.returncode == 2
    assert "shardserve_agent: error:" in result.stderr


# ---------------------------------------------------------------- up: planning


def test_plan_has_one_agent_per_rank_and_the_pinned_command_lines(matmul_repo: Path) -> None:
    groups = discover_groups(matmul_repo)
    tiers = plan_children(matmul_repo, groups, UpOptions(http_port=9001, threads=2, no_cache=True))
    agents = tiers["agent"]
    assert [a.label for a in agents] == [f"agent matmul r{r}" for r in range(4)]
    assert agents[3].argv[1:] == (
        "-m", "shardserve_agent", "--repository", str(matmul_repo), "--servable", "matmul",
        "--version", "1", "--rank", "3", "--threads", "2", "--no-cache",
    )  # fmt: skip
    assert 3 in agents[0].final_codes and 3 not in tiers["scheduler"][0].final_codes
    assert tiers["gateway"][0].argv[1:] == (
        "-m", "shardserve_gateway", "--host", "127.0.0.1", "--http-port", "9001",
    )  # fmt: skip
    assert tiers["scheduler"][0].argv[3:5] == ("--repository", str(matmul_repo))
    assert tiers["scheduler"][0].argv[-2:] == ("--repository-poll-seconds", "2")
    assert all(spec.min_restart_delay == 0 for spec in agents)  # agents retry refusals


def test_several_gateways_share_the_port_and_one_gateway_keeps_it_alone(
    matmul_repo: Path,
) -> None:
    groups = discover_groups(matmul_repo)
    one = plan_children(matmul_repo, groups, UpOptions(http_port=9001))["gateway"]
    assert [g.label for g in one] == ["gateway"]
    assert "--reuse-port" not in one[0].argv
    two = plan_children(matmul_repo, groups, UpOptions(http_port=9001, gateways=2))["gateway"]
    assert [g.label for g in two] == ["gateway 0", "gateway 1"]
    for spec in two:
        assert spec.argv[1:] == (
            "-m", "shardserve_gateway", "--host", "127.0.0.1", "--http-port", "9001",
            "--reuse-port",
        )  # fmt: skip


def test_up_refuses_a_gateway_count_below_one() -> None:
    result = shardserve("up", "--gateways", "0")
    assert result.returncode == 2
    assert "--gateways" in result.stderr


def test_plan_arguments_parse_with_the_services_own_parsers(matmul_repo: Path) -> None:
    groups = discover_groups(matmul_repo)
    tiers = plan_children(matmul_repo, groups, UpOptions(gateways=2))
    for tier, specs in tiers.items():
        settings = _service_settings(tier)
        for spec in specs:
            settings.build_parser().parse_args(list(spec.argv[3:]))


def _service_settings(service: str) -> Any:
    return importlib.import_module(f"shardserve_{service}.settings")


def test_an_empty_repository_is_refused(tmp_path: Path) -> None:
    result = shardserve("up", str(tmp_path))
    assert result.returncode == 2
    assert "holds no servable version" in result.stderr


# ---------------------------------------------------------------- up/status: rendering


def _status(ready_ranks: int, *, ready: bool, fresh: bool = True) -> dict[str, Any]:
    ranks = [
        {"rank": r, "stage": 0, "state": "ready" if r < ready_ranks else "missing",
         "heartbeat_age_s": 0.25 if r < ready_ranks else None,
         "slice_checksum": f"{r:02d}" + "ab" * 31, "cache": "hit", "rss_bytes": 50 * 2**20,
         "inflight": r % 2, "host": "h", "pid": 100 + r}
        for r in range(4)
    ]  # fmt: skip
    servable = {"name": "matmul", "version": 1, "ready": ready, "reason": "" if ready else
                "missing ranks 2, 3", "rank_size": 4, "stage_size": 1, "methods": [],
                "ranks": ranks, "inflight": 1}  # fmt: skip
    return {"kind": "mesh.status", "scheduler": "s", "time": 0.0, "servables": [servable],
            "fresh": fresh}  # fmt: skip


def test_progress_counts_ready_ranks_per_group(matmul_repo: Path) -> None:
    groups = discover_groups(matmul_repo)
    assert progress_lines({"servables": []}, groups) == {
        "matmul v1": "matmul v1: not known to the scheduler yet"
    }
    assert progress_lines(_status(2, ready=False), groups) == {
        "matmul v1": "matmul v1: 2/4 ranks ready"
    }
    assert progress_lines(_status(4, ready=True), groups)["matmul v1"].endswith("(group ready)")
    assert not all_ready(_status(2, ready=False), groups)
    assert all_ready(_status(4, ready=True), groups)
    assert not all_ready(_status(4, ready=True, fresh=False), groups)


def test_status_grid_shows_every_rank(matmul_repo: Path) -> None:
    text = format_status(_status(2, ready=False, fresh=False))
    lines = text.splitlines()
    assert lines[0].startswith("warning: the scheduler's status is stale")
    assert "NOT READY: missing ranks 2, 3" in lines[1]
    rows = [line.split() for line in lines[3:]]
    assert [row[1] for row in rows] == ["0", "1", "2", "3"]
    assert rows[0][2:8] == ["ready", "0.2s", "00ababababab", "hit", "50.0", "0"]
    assert rows[3][2:4] == ["missing", "-"]
    assert rows[3][-1] == "h/103"
    assert "no servables" in format_status({"servables": [], "fresh": True})


def test_status_command_prints_a_served_grid(tmp_path: Path) -> None:
    import http.server
    import threading

    body = json.dumps(_status(4, ready=True)).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/api/status" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = shardserve("status", "--url", f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("matmul v1  ready  ranks 4 x stages 1")
    assert result.stdout.count(" ready ") >= 4


def test_urls_are_shown_usable_and_without_passwords() -> None:
    assert public_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert public_url("10.0.0.5", 81) == "http://10.0.0.5:81"
    assert redact_url("amqp://agent:s3cret@rabbit:5672/") == "amqp://agent:***@rabbit:5672/"
    assert redact_url("amqp://rabbit/") == "amqp://rabbit/"


def test_describe_group_names_every_rank(matmul_repo: Path) -> None:
    group: GroupConfig = load_group(matmul_repo, "matmul", 1)
    text = cli.describe_group(group)
    assert text.count("\n  rank ") == 4
    assert "seg0.onnx -> allgather" in text


def test_describe_group_says_per_rank_files_bytes_and_checksum(matmul_repo: Path) -> None:
    """Without --verbose: a count, the bytes on disk and the checksum; no file names."""
    group: GroupConfig = load_group(matmul_repo, "matmul", 1)
    folder = matmul_repo / "matmul" / "1"
    lines = cli.describe_group(group, folder, verbose=False).splitlines()
    for rank in group.ranks:
        size = sum((folder / f"rank_{rank.rank}" / name).stat().st_size for name in rank.files)
        line = next(x for x in lines if x.startswith(f"  rank {rank.rank} "))
        assert f"{len(rank.files)} files, {size:,} bytes, checksum {rank.checksum[:12]}" in line
        assert not any(name in line for name in rank.files)


def test_up_takes_every_service_option_and_passes_it_to_the_services_that_declare_it(
    matmul_repo: Path,
) -> None:
    """Derived from the services' declarations: each option they declare (but what up sets
    per process) is on up, and ends on the command line of exactly the services declaring it."""
    from shardserve.ops.launch.service_options import (
        PER_PROCESS,
        service_argvs,
        service_options,
    )

    up = cli.build_parser()._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr]
    for service in ("scheduler", "gateway", "agent"):
        settings = _service_settings(service).build_parser()
        flags = {f for a in settings._actions for f in a.option_strings if f.startswith("--")}
        assert flags - {"--help"} - PER_PROCESS - {"--no-" + f[2:] for f in flags} <= set(
            up._option_string_actions
        ), service
    args = cli.build_parser().parse_args(
        ["up", str(matmul_repo), "--max-waiting-sequences", "3", "--drain-seconds", "5",
         "--no-open-health", "--no-share-weights", "--cache-mode", "mem_opt"]
    )  # fmt: skip
    options = UpOptions(service_args=service_argvs(args))
    tiers = plan_children(matmul_repo, discover_groups(matmul_repo), options)
    scheduler, gateway, agent = (tiers[t][0].argv for t in ("scheduler", "gateway", "agent"))
    assert scheduler[-4:] == ("--drain-seconds", "5.0", "--max-waiting-sequences", "3")
    assert gateway[-3:] == ("--drain-seconds", "5.0", "--no-open-health")
    assert " ".join(agent).endswith("--drain-seconds 5.0 --cache-mode mem_opt --no-share-weights")
    for tier, specs in tiers.items():  # each service's own parser takes them
        parsed = _service_settings(tier).build_parser().parse_args(list(specs[0].argv[3:]))
        assert parsed.drain_seconds == 5.0
    assert {o.declared.flag for o in service_options()} & PER_PROCESS == set()
