"""Agent memory: shared weights, the mem_opt compile cache, and --max-memory-mb.

A command, not a CI test (it writes ~1 GB of models and takes a few minutes)::

    python -m benchmarks.agent_memory [--only share|cache|cap ...] [--work DIR]

- ``share``: one rank with two segments over the same ~200 MB weight; the agent's loader
  in a fresh process with ``--share-weights`` and ``--no-share-weights``: RSS and ratio.
- ``cache``: the same slice (sharing off), compile cache hit in ``standard`` and
  ``mem_opt`` mode: RSS (anonymous vs file-backed), load peak, ratio.
- ``cap``: an MLP (hidden 1024, ffn 4096, 32 layers: 1074 MB fp32) under a per-agent cap
  of 1000 MB: the full weights alone exceed the cap.
  Unsliced (rank_size 1) one capped agent refuses to load with a clear message; sliced
  over 8 ranks, a real mesh (``shardserve up`` with SHARDSERVE_AGENT_MAX_MEMORY_MB, which
  every agent reads) answers correctly; per-agent RSS next to its slice size.

RSS figures are /proc/<pid>/status of the process after loading and one inference
(VmRSS = RssAnon + RssFile; VmHWM the peak); each load runs in its own process so nothing
carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from shardserve.ops.child_mesh import LocalMesh, MeshError, base_amqp_url, free_port

ROOT = Path(__file__).resolve().parents[1]
AGENT_SRC = ROOT / "services" / "agent" / "src"
SHARED_SIZE = 7168  # 7168 x 7168 fp32 = 196 MiB, in each of two segments
CAP_MB = 1000
MIB = 1024 * 1024

# Runs in a fresh interpreter: load one slice the agent's way, report memory as JSON.
_PROBE = """
import json, sys
from pathlib import Path
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import load_slice
args = json.loads(sys.argv[1])
args["repository"] = Path(args["repository"])
if args.get("cache_dir"):
    args["cache_dir"] = Path(args["cache_dir"])
loaded = load_slice(AgentSettings(**args))
# one inference, so weights the kernels read (e.g. mapped file pages) are resident
import numpy as np
env = {name: np.zeros((4, spec.shape[1]), np.float32)
       for name, spec in zip(loaded.stage.inputs, loaded.group.inputs)}
for op in loaded.stage.program:
    runner = loaded.runners[op.file]
    env.update(runner.run_sync({n: env[n] for n in runner.input_names}))
status = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
        status[key] = int(value.split()[0]) / 1024
status["cache"] = loaded.cache
status["shared_mb"] = loaded.shared_weights.nbytes / 2**20
print(json.dumps(status))
"""


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(AGENT_SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def probe(**settings: Any) -> dict[str, Any]:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(settings)],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(label: str, m: dict[str, Any]) -> str:
    return (
        f"  {label:<28} RSS {m['VmRSS']:7.0f} MB (anon {m['RssAnon']:6.0f}, file "
        f"{m['RssFile']:6.0f})  peak {m['VmHWM']:7.0f} MB  cache {m['cache']}"
    )


def twin_repo(work: Path) -> Path:
    repo = work / "twin-repo"
    if not (repo / "twin" / "1" / "group.json").exists():
        sys.path.insert(0, str(ROOT / "tests" / "integration"))
        from test_agent_memory import write_two_segment_slice

        write_two_segment_slice(repo, "twin", SHARED_SIZE)
    return repo


def bench_share(work: Path) -> None:
    repo = twin_repo(work)
    print(f"share: one rank, two segments over one {SHARED_SIZE**2 * 4 / MIB:.0f} MB weight")
    base = dict(repository=repo, servable="twin", rank=0, use_cache=False)
    off = probe(**base, share_weights=False)
    on = probe(**base, share_weights=True)
    print(_row("--no-share-weights", off))
    print(_row(f"--share-weights ({on['shared_mb']:.0f} MB)", on))
    print(f"  RSS ratio shared/unshared: {on['VmRSS'] / off['VmRSS']:.2f}")


def bench_cache(work: Path) -> None:
    repo = twin_repo(work)
    print("cache: the same slice, sharing off, compile cache hit")
    rows = {}
    for mode in ("standard", "mem_opt"):
        cache = work / f"cache-{mode}"
        settings = dict(
            repository=repo,
            servable="twin",
            rank=0,
            cache_dir=cache,
            cache_mode=mode,
            share_weights=False,
        )
        probe(**settings)  # fills the cache
        rows[mode] = probe(**settings)
        print(_row(f"--cache-mode {mode}", rows[mode]))
    std, mem = rows["standard"], rows["mem_opt"]
    print(
        f"  ratios mem_opt/standard: RSS {mem['VmRSS'] / std['VmRSS']:.2f}, anonymous "
        f"{mem['RssAnon'] / std['RssAnon']:.2f}, peak {mem['VmHWM'] / std['VmHWM']:.2f}"
    )


def _infer(url: str, x: np.ndarray) -> np.ndarray:
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ]
    }
    request = urllib.request.Request(
        url + "/v2/models/mlp/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        out = json.loads(resp.read())["outputs"][0]
    return np.array(out["data"], np.float32).reshape(out["shape"])


def bench_cap(work: Path) -> None:
    from shardserve.tools.export.mlp import export_mlp, reference_model

    hidden, ffn, layers = 1024, 4096, 32
    whole, sliced = work / "mlp1", work / "mlp8"
    for repo, ranks in ((whole, 1), (sliced, 8)):
        if not (repo / "mlp").exists():
            export_mlp(repo, hidden=hidden, ffn=ffn, layers=layers, rank_size=ranks)
    print(f"cap: MLP hidden {hidden} ffn {ffn} layers {layers}, --max-memory-mb {CAP_MB}")
    _capped_whole(whole)
    _capped_mesh(sliced, work, reference_model(hidden=hidden, ffn=ffn, layers=layers))


def _rank_mb(repo: Path, rank: int) -> float:
    folder = repo / "mlp" / "1" / f"rank_{rank}"
    return sum(p.stat().st_size for p in folder.iterdir()) / MIB


def _capped_whole(repo: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shardserve_agent", "--repository", str(repo)]
        + ["--servable", "mlp", "--rank", "0", "--no-cache", "--max-memory-mb", str(CAP_MB)],
        env=_env(SHARDSERVE_AMQP_URL="amqp://guest:guest@127.0.0.1:1/"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in done.stdout.splitlines() + done.stderr.splitlines() if "cap" in x), "")
    print(f"  rank_size 1 ({_rank_mb(repo, 0):.0f} MB slice): exit {done.returncode}: {line}")


def _capped_mesh(repo: Path, work: Path, reference: Any) -> None:
    # every agent reads the cap from its environment
    capped = {"PYTHONPATH": _env()["PYTHONPATH"], "SHARDSERVE_AGENT_MAX_MEMORY_MB": str(CAP_MB)}
    mesh = LocalMesh(repo, base_amqp_url(), free_port(), work / "mesh.log", (), capped)
    mesh.start()
    try:
        try:
            mesh.wait_ready(300.0)
        except MeshError as exc:
            raise SystemExit(f"mesh not ready: {exc}") from exc
        x = np.random.default_rng(1).standard_normal((4, 1024)).astype(np.float32)
        y = _infer(mesh.http_url, x)
        want = _run_reference(reference, x)
        print(f"  rank_size 8: answer max |error| vs unsliced model {np.abs(y - want).max():.2e}")
        time.sleep(2)  # a fresh heartbeat after the request
        for servable in mesh.status()["servables"]:
            for r in sorted(servable["ranks"], key=lambda r: r["rank"]):
                print(
                    f"    rank {r['rank']}: slice {_rank_mb(repo, r['rank']):5.1f} MB, agent "
                    f"RSS {r['rss_bytes'] / MIB:5.0f} MB, jobs {r.get('jobs_done', 0)}"
                )
    finally:
        mesh.stop()


def _run_reference(model: Any, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


SCENARIOS = {"share": bench_share, "cache": bench_cache, "cap": bench_cap}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_memory")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--work", type=Path, default=None, help="folder for models (kept)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="shardserve-agent-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in args.only:
        SCENARIOS[name](work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
