"""The bar's pure parts (issue 35): the triad's output, GGUF headers, the weight bytes a
slice reads per token, and the targets' ratios and table."""

from __future__ import annotations

import io
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

# benchmarks/ is a top-level folder of the checkout, not part of the installed package.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gen_bar_report import (  # noqa: E402
    REAL,
    bar_ratios,
    bar_table,
    bytes_floor,
    real_ratios,
)
from benchmarks.gen_triad import bytes_floor_ms, parse_triad  # noqa: E402
from benchmarks.gguf_header import GGUFError, read_header  # noqa: E402
from benchmarks.weight_bytes import bytes_per_token  # noqa: E402

# ---------------------------------------------------------------- triad


def test_triad_takes_the_best_pass() -> None:
    out = "\n".join(
        [
            "triad pass 0 bytes 201326592 seconds 0.020000000 threads 2",
            "triad pass 1 bytes 201326592 seconds 0.010000000 threads 2",
            "triad pass 2 bytes 201326592 seconds 0.040000000 threads 2",
        ]
    )
    found = parse_triad(out)
    assert found["gb_per_s"] == pytest.approx(20.13, abs=0.01)
    assert found["median_gb_per_s"] == pytest.approx(10.07, abs=0.01)
    assert (found["threads"], found["passes"]) == (2.0, 3.0)


def test_triad_output_without_a_pass_is_an_error() -> None:
    with pytest.raises(ValueError, match="no triad pass"):
        parse_triad("Segmentation fault\n")


def test_bytes_over_bandwidth() -> None:
    assert bytes_floor_ms(400e6, 40.0) == pytest.approx(10.0)


# ---------------------------------------------------------------- GGUF


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _gguf(tensors: list[tuple[str, int]], data_bytes: int, alignment: int = 32) -> bytes:
    """A GGUF v3 file: a string, a u32, an array of strings; tensors at the offsets given."""
    meta = _string("general.architecture") + struct.pack("<I", 8) + _string("llama")
    meta += _string("general.alignment") + struct.pack("<II", 4, alignment)
    meta += _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2)
    meta += _string("a") + _string("bc")
    infos = b"".join(
        _string(name) + struct.pack("<I", 2) + struct.pack("<QQ", 4, 8) + struct.pack("<IQ", 0, off)
        for name, off in tensors
    )
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 3) + meta + infos
    head += b"\0" * (-len(head) % alignment)
    return head + b"\0" * data_bytes


def test_gguf_tensor_bytes_from_offsets_and_embedding_left_out() -> None:
    # listed out of offset order, as a file may list them
    data = _gguf([("output.weight", 4096), ("token_embd.weight", 0), ("blk.0.w", 1024)], 6000)
    header = read_header(io.BytesIO(data), len(data))
    assert header.version == 3
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["tokenizer.ggml.tokens"] == ["a", "bc"]
    assert header.tensor_bytes == {
        "token_embd.weight": 1024,
        "blk.0.w": 3072,
        "output.weight": 6000 - 4096,
    }
    assert header.weight_bytes_per_token() == 3072 + 1904


def test_a_tied_gguf_reads_its_embedding_table_as_the_head() -> None:
    data = _gguf([("token_embd.weight", 0), ("blk.0.w", 1024)], 6000)
    header = read_header(io.BytesIO(data), len(data))
    assert header.weight_bytes_per_token() == 1024 + (6000 - 1024)


def test_gguf_data_starts_at_the_alignment() -> None:
    data = _gguf([("blk.0.w", 0)], 100, alignment=64)
    assert read_header(io.BytesIO(data), len(data)).tensor_bytes == {"blk.0.w": 100}


def test_gguf_bad_magic_and_truncation_are_named() -> None:
    with pytest.raises(GGUFError, match="no GGUF magic"):
        read_header(io.BytesIO(b"GGML" + b"\0" * 40), 44)
    data = _gguf([("blk.0.w", 0)], 10)
    with pytest.raises(GGUFError, match="ends inside"):
        read_header(io.BytesIO(data[:40]), 40)


def test_gguf_overlapping_offsets_are_refused() -> None:
    data = _gguf([("a", 0), ("b", 0)], 64)
    with pytest.raises(GGUFError, match="overlap"):
        read_header(io.BytesIO(data), len(data))


# ---------------------------------------------------------------- slice bytes


def _graph(tied: bool) -> Any:
    embed = numpy_helper.from_array(np.zeros((100, 8), np.float32), "embed")
    weight = numpy_helper.from_array(np.zeros((8, 16), np.float32), "w")
    head = numpy_helper.from_array(np.zeros((16, 8), np.float32), "head")
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["x"]),
        helper.make_node("MatMul", ["x", "head"], ["y"]),
    ]
    if tied:  # the embedding read whole as well (a tied LM head)
        nodes.append(helper.make_node("MatMul", ["y", "embed"], ["z"], name="tied"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [embed, weight, head],
    )
    return helper.make_model(graph)


def test_an_indexed_table_is_not_read_per_token_unless_also_multiplied() -> None:
    assert bytes_per_token(_graph(tied=False)) == (8 * 16 + 16 * 8) * 4
    assert bytes_per_token(_graph(tied=True)) == (8 * 16 + 16 * 8 + 100 * 8) * 4


# ---------------------------------------------------------------- ratios and table

C1, C32 = "in128-out128.c1", "in128-out128.c32"


def _load(itl: float, ttft: float, out_tps: float) -> dict[str, Any]:
    def stats(v: float) -> dict[str, float]:
        return {"mean": v, "median": v, "p99": v}

    return {
        "completed": 1,
        "failed": 0,
        "itl_ms": stats(itl),
        "ttft_ms": stats(ttft),
        "output_throughput": out_tps,
    }


def _results() -> dict[str, Any]:
    r: dict[str, Any] = {
        "gen.bar.targets": {"c1": C1, "c32": C32},
        "gen.bar.bandwidth": {"gb_per_s": 40.0},
        f"gen.bar.llama-F32.{C1}": _load(13.0, 160.0, 70.0),
        f"gen.bar.llama-F32.{C32}": _load(90.0, 900.0, 280.0),
        "gen.bar.llama-F32.info": {
            "precision": "F32",
            "threads": 2,
            "rss_mb": 900.0,
            "weight_bytes_per_token": 400e6,
        },
        f"gen.bar.mesh-tp1-fp32.{C1}": _load(14.3, 150.0, 65.0),
        f"gen.bar.mesh-tp1-fp32.{C32}": _load(80.0, 800.0, 420.0),
        "gen.bar.mesh-tp1-fp32.info": {
            "precision": "fp32",
            "threads": 2,
            "rss_mb": 1000.0,
            "weight_bytes_per_token": 500e6,
            "memory": {"r0": {"rss_mb": 1000.0, "slice_mb": 476.0, "kv_budget_mb": 256.0}},
        },
        "gen.bar.mesh-tp1-int8.info": {
            "precision": "int8",
            "threads": 2,
            "skipped": "not available: exporter has no --quantize",
        },
        "gen.small.mesh-tp1.memory": {"r0": {"rss_mb": 300.0, "slice_mb": 80.0}},
    }
    return r


def test_bar_ratios_per_precision() -> None:
    ratios = {r.name: r for r in bar_ratios(_results())}
    itl = ratios["bar: c1 ITL shardserve fp32 / llama.cpp F32"]
    assert itl.value == pytest.approx(1.1)
    assert itl.passed is False
    c32 = ratios["bar: c32 out tok/s shardserve fp32 / llama.cpp F32"]
    assert c32.value == pytest.approx(1.5)
    assert c32.passed is True
    assert ratios["bar: c1 TTFT shardserve fp32 / llama.cpp F32"].value == pytest.approx(150 / 160)
    skipped = ratios["bar: c1 ITL shardserve int8 / llama.cpp Q8_0"]
    assert skipped.value is None
    assert "exporter has no --quantize" in skipped.detail
    memory = ratios["bar: (agent RSS - fixed) / (slice + KV budget)"]
    assert memory.value == pytest.approx((1000.0 - 220.0) / (476.0 + 256.0))


def test_a_failed_load_gives_no_ratio() -> None:
    r = _results()
    r[f"gen.bar.llama-F32.{C1}"] = {**r[f"gen.bar.llama-F32.{C1}"], "failed": 1}
    ratios = {x.name: x for x in bar_ratios(r)}
    assert ratios["bar: c1 ITL shardserve fp32 / llama.cpp F32"].value is None


def test_bar_table_rows_and_the_bytes_floor() -> None:
    r = _results()
    assert bytes_floor(r, "llama-F32") == pytest.approx(10.0)
    table = bar_table(r)
    assert table[0].startswith("| system | precision | threads |")
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table[2:]}
    assert rows["llama.cpp llama-server F32 GGUF"] == (
        "| llama.cpp llama-server F32 GGUF | F32 | 2 | 160 | 13 | 400 | 10 | 280 | 900 |"
    )
    assert "exporter has no --quantize" in rows["shardserve TP 1 int8"]
    assert len(table) == 2 + 3


def test_no_bar_run_no_ratios_no_table() -> None:
    assert bar_ratios({}) == []
    assert bar_table({}) == []


# ---------------------------------------------------------------- onnxruntime's profile


def test_profile_kernel_time_per_op_type() -> None:
    from benchmarks.gen_ort_profile import op_totals_ms

    events = [
        {"cat": "Node", "name": "mm1_kernel_time", "dur": 1500, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "mm2_kernel_time", "dur": 500, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "add_kernel_time", "dur": 250, "args": {"op_name": "Add"}},
        {"cat": "Node", "name": "mm1_fence_before", "dur": 900, "args": {"op_name": "MatMul"}},
        {"cat": "Session", "name": "model_run", "dur": 9000, "args": {}},
    ]
    assert op_totals_ms(events) == {"MatMul": 2.0, "Add": 0.25}
    assert list(op_totals_ms(events)) == ["MatMul", "Add"]  # largest first


def test_profile_counts_an_if_by_its_own_time() -> None:
    """A composed piece's segment is an If whose branch's kernels are events inside it."""
    from benchmarks.gen_ort_profile import op_totals_ms

    def kernel(op: str, ts: int, dur: int) -> dict[str, object]:
        return {
            "cat": "Node",
            "name": f"{op}_kernel_time",
            "ts": ts,
            "dur": dur,
            "args": {"op_name": op},
        }

    events = [
        kernel("If", 100, 1000),
        kernel("MatMul", 150, 600),
        kernel("Add", 800, 100),
        kernel("If", 2000, 300),
        kernel("Add", 2100, 100),
        kernel("GroupQueryAttention", 1200, 400),  # between the Ifs, in the outer graph
    ]
    assert op_totals_ms(events) == {
        "MatMul": 0.6,
        "If": 0.5,
        "GroupQueryAttention": 0.4,
        "Add": 0.2,
    }


def _real_results() -> dict[str, Any]:
    def info(precision: str, weights: float) -> dict[str, Any]:
        return {
            "precision": precision,
            "threads": 2,
            "rss_mb": 600.0,
            "weight_bytes_per_token": weights,
        }

    return {
        "gen.real.targets": {"c1": C1, "c32": C32},
        "gen.real.bandwidth": {"gb_per_s": 30.0},
        f"gen.real.llama-Q8_0.{C1}": _load(8.0, 200.0, 90.0),
        f"gen.real.llama-Q8_0.{C32}": _load(100.0, 5000.0, 200.0),
        "gen.real.llama-Q8_0.info": info("Q8_0", 150e6),
        f"gen.real.mesh-tp1-Q8_0.{C1}": _load(12.0, 150.0, 60.0),
        f"gen.real.mesh-tp1-Q8_0.{C32}": _load(90.0, 3000.0, 300.0),
        "gen.real.mesh-tp1-Q8_0.info": info("Q8_0", 150e6),
    }


def test_the_real_model_bar_pairs_the_same_files() -> None:
    r = _real_results()
    ratios = {x.name: x for x in real_ratios(r)}
    assert ratios["real model: c1 ITL shardserve Q8_0 / llama.cpp Q8_0"].value == pytest.approx(1.5)
    c32 = ratios["real model: c32 out tok/s shardserve Q8_0 / llama.cpp Q8_0"]
    assert c32.value == pytest.approx(1.5) and c32.passed is True
    q4 = ratios["real model: c1 TTFT shardserve Q4_0 / llama.cpp Q4_0"]
    assert q4.value is None  # not measured: no ratio, never a made-up one
    assert not any(name.startswith("bar:") for name in ratios)  # no memory ratio of the bar's
    table = bar_table(r, REAL)
    rows = [line for line in table[2:]]
    assert rows == [
        "| llama.cpp llama-server, SmolLM2 Q8_0 GGUF | Q8_0 | 2 | 200 | 8 | 150 | 5 | 200 | 600 |",
        "| shardserve TP 1, the same file's blocks | Q8_0 | 2 | 150 | 12 | 150 | 5 | 300 | 600 |",
    ]
    assert bar_ratios(r) == [] and real_ratios({}) == []
