"""`shardserve run-rank`: one real process per rank, peers over RabbitMQ, no scheduler.

Every rank gets the same all-ones input; the last stage's ranks must print the demo's
answer (`y`, 2048 elements, -48.0 everywhere), whatever the split (column + allgather,
row + allreduce, or two pipeline stages).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from shardserve import lite
from shardserve.amqp.collective import MIN_SHARD_BYTES
from shardserve.tools.export.matmul import export_matmul
from shardserve.tools.export.mlp import export_mlp, reference_model

pytestmark = pytest.mark.integration

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")
ROOT = Path(__file__).resolve().parents[2]
Y_REPORT = "tensor name is: y tensor size is: 8192 tensor elements num is: 2048"
Y_VALUES = "output data is: " + " ".join(["-48.0"] * 10)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    export_matmul(root, rank_size=2, strategy="column", version=1)
    export_matmul(root, rank_size=2, strategy="row", version=2)
    export_matmul(root, rank_size=4, stage_size=2, version=3)
    export_matmul(root, rank_size=4, strategy="row", version=4)
    return root


@pytest.fixture(scope="module")
def env(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache_home = tmp_path_factory.mktemp("xdg")
    return {
        **os.environ,
        "SHARDSERVE_AMQP_URL": isolated_amqp_url,
        "XDG_CACHE_HOME": str(cache_home),
        "PYTHONUNBUFFERED": "1",
    }


def start_ranks(
    version_dir: Path, ranks: list[int], env: dict[str, str], *extra: str
) -> list[subprocess.Popen[str]]:
    """All ranks at once, in the background, like examples/run_ranks.sh."""
    run_id = f"t{uuid.uuid4().hex[:12]}"
    return [
        subprocess.Popen(
            [SHARDSERVE, "run-rank", "--model", str(version_dir), "--rank", str(rank)]
            + ["--run-id", run_id, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ranks
    ]


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    return results


@pytest.mark.parametrize("version", [1, 2], ids=["column-allgather", "row-allreduce"])
def test_two_ranks_print_the_answer(repo: Path, env: dict[str, str], version: int) -> None:
    results = finish(start_ranks(repo / "matmul" / str(version), [0, 1], env))
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"rank {rank}: {Y_REPORT}" in out
        assert f"rank {rank}: {Y_VALUES}" in out


def test_four_ranks_reduce_through_the_stage_leader(repo: Path, env: dict[str, str]) -> None:
    """4 ranks in one stage: the allreduce goes to rank 0 and back (the leader algorithm)."""
    results = finish(start_ranks(repo / "matmul" / "4", [0, 1, 2, 3], env))
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"rank {rank}: {Y_VALUES}" in out


def test_two_stages_chain_their_ranks(repo: Path, env: dict[str, str]) -> None:
    results = finish(start_ranks(repo / "matmul" / "3", [0, 1, 2, 3], env))
    for code, _, err in results:
        assert code == 0, err
    for rank in (2, 3):  # the last stage's ranks hold the model's output
        _, out, _ = results[rank]
        assert f"rank {rank}: {Y_REPORT}" in out
        assert f"rank {rank}: {Y_VALUES}" in out
    for rank in (0, 1):  # the first stage's ranks print their stage's output, not y
        _, out, _ = results[rank]
        assert "tensor name is: y " not in out
        assert f"rank {rank}: tensor name is:" in out


def test_missing_peer_times_out_naming_it(repo: Path, env: dict[str, str]) -> None:
    ((code, out, err),) = finish(start_ranks(repo / "matmul" / "1", [0], env, "--timeout", "2"))
    assert code == 1
    assert out == ""
    assert "needs 2 ranks; after 2 s still missing rank(s) 1" in err


def test_example_script_runs_every_rank(repo: Path, env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "config.ini"
    config.write_text(f"[cache]\ndir = {tmp_path / 'cache'}\nmode = standard\n")
    script_env = {
        **env,
        "PATH": f"{Path(SHARDSERVE).parent}{os.pathsep}{env['PATH']}",
        "CONFIG": str(config),
    }
    done = subprocess.run(
        [str(ROOT / "examples" / "run_ranks.sh"), str(repo / "matmul" / "1")],
        env=script_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(Y_VALUES) == 2
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2  # one entry per rank


class BrokenSegment:
    """Stands in for one rank's onnxruntime segment and fails like a crashing kernel."""

    def __init__(self, input_names: tuple[str, ...]) -> None:
        self.input_names = input_names

    async def run(self, feeds: object) -> dict[str, object]:
        raise RuntimeError("kernel exploded")

    async def run_each(self, feed_list: object) -> list[dict[str, object]]:
        raise RuntimeError("kernel exploded")


def build_ranks(version_dir: Path, ranks: list[int], amqp_url: str) -> list[lite.Model]:
    """Build the ranks' models concurrently (each build waits for its peers)."""
    run_id = f"t{uuid.uuid4().hex[:12]}"

    def build(rank: int) -> lite.Model:
        model = lite.Model()
        context = lite.Context(rank_id=rank, run_id=run_id, amqp_url=amqp_url, timeout_s=30)
        context.cache_enabled = False
        model.build_from_file(version_dir, context)
        return model

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(build, ranks))


def predict_all(models: list[lite.Model]) -> list[list[lite.Tensor] | Exception]:
    def predict(model: lite.Model) -> list[lite.Tensor] | Exception:
        inputs = model.get_inputs()
        for tensor in inputs:
            tensor.fill_ones()
        try:
            return model.predict(inputs)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(models)) as pool:
        return list(pool.map(predict, models))


def test_lite_api_over_the_broker_and_a_failing_peer(repo: Path, isolated_amqp_url: str) -> None:
    models = build_ranks(repo / "matmul" / "3", [0, 1, 2, 3], isolated_amqp_url)
    try:
        first = predict_all(models)
        for outputs in first[2:]:
            assert not isinstance(outputs, Exception), outputs
            assert float(outputs[0].get_data_to_numpy()[0, 0]) == -48.0
        runners = models[1]._require().runners  # rank 1 (stage 0) breaks on the next job
        for name, runner in list(runners.items()):
            runners[name] = BrokenSegment(runner.input_names)  # type: ignore[assignment]
        second = predict_all(models)
    finally:
        for model in models:
            model.close()
    assert isinstance(second[1], RuntimeError)
    for rank in (0, 2, 3):  # the peers stop waiting at once and name the failed rank
        outcome = second[rank]
        assert isinstance(outcome, lite.PeerFailedError), outcome
        assert "rank 1 failed" in str(outcome) and "kernel exploded" in str(outcome)


def test_a_big_allreduce_is_sharded_and_matches_the_unsliced_model(
    tmp_path: Path, isolated_amqp_url: str
) -> None:
    """4 ranks of a row-split MLP whose allreduce carries parts of 4 x MIN_SHARD_BYTES:
    reduce-scatter + allgather over the real broker, the unsliced answer, the same bits
    on every rank."""
    mlp = dict(hidden=1024, ffn=64, layers=1, seed=3)
    export_mlp(tmp_path / "repo", rank_size=4, **mlp)  # type: ignore[arg-type]
    rows = 4 * MIN_SHARD_BYTES // (mlp["hidden"] * 4)  # the partial sums: [rows, hidden] fp32
    x = np.random.default_rng(1).standard_normal((rows, mlp["hidden"])).astype(np.float32)
    models = build_ranks(tmp_path / "repo" / "mlp" / "1", [0, 1, 2, 3], isolated_amqp_url)
    try:

        def predict(model: lite.Model) -> np.ndarray:
            [tensor] = model.get_inputs()
            tensor.set_data_from_numpy(x)
            [output] = model.predict([tensor])
            return output.get_data_to_numpy()

        with ThreadPoolExecutor(len(models)) as pool:
            outputs = list(pool.map(predict, models))
        runs = [model._require().mesh.hub.runs for model in models]  # type: ignore[union-attr]
    finally:
        for model in models:
            model.close()
    unsliced = ort.InferenceSession(reference_model(**mlp).SerializeToString())  # type: ignore[arg-type]
    [expected] = unsliced.run(None, {"x": x})
    for rank, got in enumerate(outputs):
        assert float(np.max(np.abs(got - expected))) <= 1e-5
        assert got.tobytes() == outputs[0].tobytes()
        assert runs[rank]["sharded"] == 1, runs[rank]
