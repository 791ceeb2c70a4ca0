"""digest_tensors: what it covers, and how a digest of another function is told apart."""

from __future__ import annotations

import numpy as np

from shardserve.wire.tensors import DIGEST_PREFIX, Tensor, digest_tensors, foreign_digest


def _tensors(**arrays: np.ndarray) -> dict[str, Tensor]:
    return {name: Tensor.from_numpy(a) for name, a in arrays.items()}


def test_the_digest_names_its_function_and_ignores_dict_order() -> None:
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, dtype=np.int64)
    digest = digest_tensors(_tensors(a=a, b=b))
    assert digest.startswith(DIGEST_PREFIX) and len(digest) == len(DIGEST_PREFIX) + 32
    assert digest == digest_tensors(_tensors(b=b, a=a))
    assert foreign_digest(digest) == ""


def test_names_dtypes_shapes_and_bytes_all_change_the_digest() -> None:
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    flipped = base.copy()
    flipped[1, 2] = -1.0
    variants = [
        _tensors(x=base),
        _tensors(y=base),
        _tensors(x=base.view(np.int32)),
        _tensors(x=base.reshape(3, 2)),
        _tensors(x=flipped),
    ]
    assert len({digest_tensors(v) for v in variants}) == len(variants)


def test_a_digest_without_the_prefix_is_foreign() -> None:
    problem = foreign_digest("0123456789abcdef" * 2)
    assert problem.startswith("digest '0123456789abcdef' is not an xxh3 digest")
    assert "another shardserve version" in problem
