"""benchmarks.quality's arithmetic: perplexity and greedy tokens from logits."""

from __future__ import annotations

import numpy as np
from benchmarks.quality import SAMPLE, VARIANTS, measure


def test_uniform_logits_have_the_vocabulary_as_perplexity() -> None:
    measured = measure(np.zeros((5, 40), np.float32), [1, 2, 3, 4, 5], 0)
    assert np.isclose(measured.perplexity, 40.0)


def test_perplexity_is_the_exp_of_the_mean_negative_log_likelihood() -> None:
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1, 1, 1]], np.float32))
    measured = measure(logits, [0, 1, 2], 7)
    assert np.isclose(measured.perplexity, np.exp(-(np.log(0.25) + np.log(0.8)) / 2))
    assert measured.argmax.tolist() == [0, 2]
    assert measured.slice_bytes == 7


def test_fp32_comes_first_and_the_sample_is_committed() -> None:
    assert VARIANTS[0][1] is None
    assert len(SAMPLE.read_text().split()) > 500
