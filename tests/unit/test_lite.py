"""The Lite API on single-rank slices (no broker), its ini file, run-rank's report, and
warmup building the very cache entries the agent and run-rank then hit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from shardserve import lite
from shardserve.cli import main as cli_main
from shardserve.lite.config import RunConfig
from shardserve.ops.warmup import MODES, up_threads, warmup
from shardserve.runtime.compile_cache import CACHE_MODES
from shardserve.tools.export.matmul import export_matmul
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import load_slice


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    export_matmul(root, rank_size=1)
    export_matmul(root, rank_size=2, version=2)
    return root


@pytest.fixture(autouse=True)
def private_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Default cache folders land under the test's tmp dir, never in ~/.cache."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def build(path: Path, context: lite.Context, config: Path | None = None) -> lite.Model:
    model = lite.Model()
    model.build_from_file(path, context, config)
    return model


# ---------------------------------------------------------------- Lite API


def test_single_rank_predict_like_mindspore_lite(repo: Path, tmp_path: Path) -> None:
    context = lite.Context()
    context.rank_id = 0
    context.cache_dir = tmp_path / "cache"
    with build(repo / "matmul" / "1", context) as model:
        inputs = model.get_inputs()
        assert [(t.name, t.shape, t.dtype) for t in inputs] == [
            ("x", (128, 96), np.dtype(np.float32))
        ]
        assert not inputs[0].has_data
        inputs[0].set_data_from_numpy(np.ones((128, 96), dtype=np.float32))
        outputs = model.predict(inputs)
        again = model.predict(inputs)  # built once, run many times
    (y,) = outputs
    assert (y.name, y.element_num, y.data_size, y.shape) == ("y", 2048, 8192, (128, 16))
    np.testing.assert_array_equal(y.get_data_to_numpy(), np.full((128, 16), -48.0, np.float32))
    np.testing.assert_array_equal(again[0].get_data_to_numpy(), y.get_data_to_numpy())


def test_second_build_hits_the_compile_cache(repo: Path, tmp_path: Path) -> None:
    context = lite.Context(rank_id=0, cache_dir=tmp_path / "cache")
    statuses = []
    for _ in range(2):
        with build(repo / "matmul" / "1", context) as model:
            statuses.append(model.cache_status)
    assert statuses == ["miss", "hit"]


def test_mem_opt_is_its_own_cache_entry_and_computes_the_same(repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    results = {}
    for mode in ("standard", "mem_opt"):
        with build(
            repo / "matmul" / "1", lite.Context(rank_id=0, cache_dir=folder, cache_mode=mode)
        ) as model:
            assert model.cache_status == "miss"
            inputs = model.get_inputs()
            inputs[0].fill_ones()
            results[mode] = model.predict(inputs)[0].get_data_to_numpy()
    assert len(list(folder.glob("*.json"))) == 2  # one entry per mode
    np.testing.assert_array_equal(results["standard"], results["mem_opt"])


def test_rank_folder_names_the_rank(repo: Path) -> None:
    with build(repo / "matmul" / "1" / "rank_0", lite.Context(cache_enabled=False)) as model:
        assert (model.rank, model.cache_status) == (0, "off")


@pytest.mark.parametrize(
    ("path", "rank", "message"),
    [
        ("matmul/1/rank_0", 1, "rank 0's folder but the context says rank 1"),
        ("matmul/1", None, "no rank given"),
        ("matmul", 0, "not a model version folder"),
        ("matmul/1", 3, "outside the group"),
    ],
)
def test_bad_model_path_or_rank_is_refused(
    repo: Path, path: str, rank: int | None, message: str
) -> None:
    with pytest.raises(lite.LiteError, match=message):
        build(repo / path, lite.Context(rank_id=rank, cache_enabled=False))


def test_input_checks(repo: Path) -> None:
    with build(repo / "matmul" / "1", lite.Context(rank_id=0, cache_enabled=False)) as model:
        (x,) = model.get_inputs()
        with pytest.raises(lite.LiteError, match="has no data"):
            model.predict([x])
        with pytest.raises(lite.LiteError, match="is float32, got data of dtype float64"):
            x.set_data_from_numpy(np.ones((128, 96)))
        with pytest.raises(lite.LiteError, match=r"shape \[128, 96\], got data of shape \[2, 96\]"):
            x.set_data_from_numpy(np.ones((2, 96), dtype=np.float32))
        with pytest.raises(lite.LiteError, match="input x is missing"):
            model.predict([])


def test_unbuilt_model_says_so() -> None:
    with pytest.raises(lite.LiteError, match="call build_from_file first"):
        lite.Model().get_inputs()


# ---------------------------------------------------------------- ini file


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_ini_file_is_read(tmp_path: Path) -> None:
    ini = write(
        tmp_path / "config.ini",
        "[cache]\nenabled = yes\ndir = caches ; relative\nmode = mem_opt\n"
        "[session]\nintra_op_threads = 2\n",
    )
    assert lite.load_config(ini) == RunConfig(
        cache_enabled=True, cache_dir=tmp_path / "caches", cache_mode="mem_opt", intra_op_threads=2
    )


def test_empty_ini_sets_nothing(tmp_path: Path) -> None:
    assert lite.load_config(write(tmp_path / "c.ini", "")) == RunConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cash]\ndir = x\n", r"unknown section \[cash\]"),
        ("[cache]\nmod = standard\n", r"unknown key\(s\) mod in \[cache\]"),
        ("[cache]\nmode = fast\n", "mode must be one of standard, mem_opt, got 'fast'"),
        ("[cache]\nenabled = maybe\n", "enabled must be true or false"),
        ("[session]\nintra_op_threads = 0\n", "must be an integer >= 1"),
        ("no section\n", "not a valid ini file"),
    ],
)
def test_bad_ini_is_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(lite.ConfigFileError, match=message):
        lite.load_config(write(tmp_path / "c.ini", text))


def test_missing_ini_is_refused(tmp_path: Path) -> None:
    with pytest.raises(lite.ConfigFileError, match="cannot read config file"):
        lite.load_config(tmp_path / "absent.ini")


def test_context_wins_over_the_ini_and_the_ini_over_defaults(tmp_path: Path) -> None:
    config = RunConfig(cache_dir=tmp_path / "ini", cache_mode="mem_opt", intra_op_threads=3)
    merged = lite.Context(cache_dir=tmp_path / "ctx").merged(config)
    assert (merged.cache_dir, merged.cache_mode, merged.threads) == (
        tmp_path / "ctx",
        "mem_opt",
        3,
    )


def test_build_uses_the_ini_cache_folder(repo: Path, tmp_path: Path) -> None:
    ini = write(tmp_path / "config.ini", "[cache]\ndir = here\nmode = mem_opt\n")
    with build(repo / "matmul" / "1", lite.Context(rank_id=0), ini) as model:
        assert model.cache_status == "miss"
    assert len(list((tmp_path / "here").glob("*.json"))) == 1


def test_run_id_must_be_key_safe() -> None:
    with pytest.raises(lite.LiteError, match="run id"):
        lite.Context(run_id="a.b c").resolved_run_id("matmul", 1)
    assert lite.Context().resolved_run_id("my.model", 2) == "my_model-v2"


# ---------------------------------------------------------------- run-rank (rank_size 1)


def test_run_rank_prints_like_mindspore_lite(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    twos = tmp_path / "x.npy"
    np.save(twos, np.full((128, 96), 2.0, dtype=np.float32))
    code = cli_main(["run-rank", "--model", str(repo / "matmul" / "1"), "--rank", "0"])
    code_npy = cli_main(
        ["run-rank", "--model", str(repo / "matmul/1/rank_0"), "--inputs", str(twos)]
    )
    out = capsys.readouterr().out
    assert (code, code_npy) == (0, 0)
    assert "rank 0: tensor name is: y tensor size is: 8192 tensor elements num is: 2048" in out
    assert "rank 0: output data is: " + " ".join(["-48.0"] * 10) + "\n" in out
    assert "rank 0: output data is: " + " ".join(["-96.0"] * 10) + "\n" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--inputs", "a.npy", "b.npy"], "has 1 input(s) (x), got 2 file(s)"),
        (["--inputs", "absent.npy"], "input x from absent.npy"),
        (["--config", "absent.ini"], "cannot read config file"),
    ],
)
def test_run_rank_usage_errors_exit_2(
    repo: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["run-rank", "--model", str(repo / "matmul/1"), "--rank", "0", *extra])
    assert code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- warmup


def test_warmup_modes_are_the_cache_modes() -> None:
    assert MODES == CACHE_MODES


def test_warmup_default_folders_are_hit_by_the_agent(repo: Path) -> None:
    first = warmup(repo, servable="matmul", version=2, threads=1)
    assert [(r.rank, r.status) for r in first] == [(0, "miss"), (1, "miss")]
    for rank in (0, 1):
        settings = AgentSettings(repository=repo, servable="matmul", rank=rank, threads=1)
        loaded = load_slice(settings)
        assert loaded.cache == "hit"
    assert [r.status for r in warmup(repo, servable="matmul", version=2)] == ["hit", "hit"]


def test_warmup_shared_folder_is_hit_by_the_agent_and_run_rank(repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "shipped"
    results = warmup(repo, cache_dir=folder)
    assert sorted((r.version, r.rank) for r in results) == [(1, 0), (2, 0), (2, 1)]
    settings = AgentSettings(
        repository=repo, servable="matmul", version=2, rank=1, cache_dir=folder, threads=1
    )
    assert load_slice(settings).cache == "hit"
    with build(repo / "matmul" / "1", lite.Context(rank_id=0, cache_dir=folder)) as model:
        assert model.cache_status == "hit"


def test_warmup_cache_is_keyed_by_mode(repo: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mem"
    warmup(repo, cache_dir=folder, mode="mem_opt", version=1, servable="matmul")
    settings = AgentSettings(
        repository=repo, servable="matmul", version=1, rank=0, cache_dir=folder, threads=1
    )
    assert load_slice(settings).cache == "miss"  # the agent runs standard: another entry


def test_warmup_command_reports_each_rank(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["warmup", str(repo), "--cache-dir", str(tmp_path / "c"), "--servable", "matmul"]
    assert cli_main(args) == 0
    assert cli_main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if " rank " in line] == [
        "matmul v1 rank 0",
        "matmul v2 rank 0",
        "matmul v2 rank 1",
    ] * 2
    summaries = [line for line in lines if line.startswith("3 rank(s)")]
    assert summaries == [
        "3 rank(s): 3 built, 0 already cached, 0 uncached",
        "3 rank(s): 0 built, 3 already cached, 0 uncached",
    ]
    # both runs used the thread count 'shardserve up' would give these agents here
    assert [line for line in lines if line.startswith("onnxruntime threads: ")] == [
        f"onnxruntime threads: {up_threads(repo)}"
    ] * 2


def test_warmup_unknown_servable_exits_2(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["warmup", str(repo), "--servable", "nope"]) == 2
    assert "has no version" in capsys.readouterr().err


def test_a_run_waits_for_a_broker_ten_seconds_not_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardserve.lite.context import LITE_CONNECT_WAIT_S

    monkeypatch.delenv("SHARDSERVE_AMQP_CONNECT_WAIT", raising=False)
    assert lite.Context().broker_settings().connect_wait_s == LITE_CONNECT_WAIT_S
    monkeypatch.setenv("SHARDSERVE_AMQP_CONNECT_WAIT", "2.5")
    assert lite.Context(amqp_url="amqp://x@h/").broker_settings().connect_wait_s == 2.5


async def test_a_run_without_a_broker_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from shardserve.errors import UnavailableError
    from shardserve.lite.wire import RunMesh
    from shardserve.repo.repository import load_group

    monkeypatch.setenv("SHARDSERVE_AMQP_CONNECT_WAIT", "1")
    export_matmul(tmp_path, rank_size=2)
    group = load_group(tmp_path, "matmul", 1)
    settings = lite.Context(amqp_url="amqp://guest:secret@127.0.0.1:1/").broker_settings()
    mesh = RunMesh(settings, "r1", group, 0)
    with pytest.raises(UnavailableError, match="rank 0: cannot reach the message broker at"):
        await asyncio.wait_for(mesh.open(), 30)
