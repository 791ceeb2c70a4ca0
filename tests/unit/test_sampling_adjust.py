"""Logit adjustments before the choice (shardserve.runtime.sampling.adjusted_logits): vLLM's
repetition, presence and frequency penalties, logit_bias, the min_tokens mask; the same
tokens whether a decode run advances its rows (RowSampling.after) or the scheduler rebuilds
them each step; logprobs stay those of the raw logits."""

from __future__ import annotations

import numpy as np
import pytest

from shardserve.runtime.sampling import adjusted_logits, sample_rows
from shardserve.wire.protocol import LogitBias, RowSampling


def row(**fields: object) -> RowSampling:
    return RowSampling(seq=fields.pop("seq", 0), index=fields.pop("index", 0), **fields)  # type: ignore[arg-type]


def greedy(logits: list[float], sampling: RowSampling) -> int:
    tokens, _, _ = sample_rows(np.asarray([logits], np.float32), [sampling])
    return tokens[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_ids() -> None:
    sampling = row(repetition_penalty=2.0, prompt_ids=(0, 2), output_ids=(3,))
    adjusted = adjusted_logits(np.asarray([2.0, 1.5, -1.0, 0.5], np.float32), sampling)
    assert adjusted.tolist() == [1.0, 1.5, -2.0, 0.25]
    assert greedy([2.0, 1.5, -1.0, 0.5], sampling) == 1
    assert greedy([2.0, 1.5, -1.0, 0.5], row()) == 0
    # A seen id counts once however often it comes back.
    twice = row(repetition_penalty=2.0, prompt_ids=(0,), output_ids=(0, 0, 0))
    assert adjusted_logits(np.asarray([2.0, 1.0], np.float32), twice).tolist() == [1.0, 1.0]


def test_frequency_counts_every_occurrence_presence_counts_once() -> None:
    logits = [3.0, 2.5, 0.0]
    assert greedy(logits, row(frequency_penalty=0.3, output_ids=(0, 0))) == 1  # 3 - 0.6
    assert greedy(logits, row(frequency_penalty=0.2, output_ids=(0, 0))) == 0  # 3 - 0.4
    assert greedy(logits, row(presence_penalty=0.6, output_ids=(0, 0))) == 1  # 3 - 0.6
    assert greedy(logits, row(presence_penalty=0.4, output_ids=(0, 0, 0))) == 0  # 3 - 0.4
    # Only the output counts: the prompt is the repetition penalty's alone.
    assert greedy(logits, row(presence_penalty=2.0, prompt_ids=(0,))) == 0
    # A negative penalty favours what was said.
    assert greedy([2.5, 3.0], row(frequency_penalty=-1.0, output_ids=(0,))) == 0


def test_logit_bias_bans_and_forces_tokens_greedy_and_sampled() -> None:
    logits = np.random.default_rng(0).standard_normal((1, 500)).astype(np.float32) * 3
    top = int(logits[0].argmax())
    banned = row(logit_bias=(LogitBias(token_id=top, bias=-100.0),))
    assert greedy(logits[0].tolist(), banned) == int(np.argsort(-logits[0])[1])
    low = int(logits[0].argmin())
    forced = (LogitBias(token_id=low, bias=100.0),)
    for seed in range(20):
        sampled = row(temperature=1.0, seed=seed, logit_bias=forced)
        assert sample_rows(logits, [sampled])[0] == [low]


def test_min_tokens_masks_the_stop_ids_until_reached() -> None:
    logits = [0.0, 9.0, 1.0, 8.0]  # 1 (EOS, say) and 3 (a stop id) lead
    masked = {"min_tokens": 2, "masked_until_min": (1, 3)}
    assert greedy(logits, row(index=0, **masked)) == 2
    assert greedy(logits, row(index=1, **masked)) == 2
    assert greedy(logits, row(index=2, **masked)) == 1
    for seed in range(20):
        sampled = row(index=1, temperature=5.0, seed=seed, **masked)
        assert greedy(logits, sampled) not in (1, 3)


def test_logprobs_are_those_of_the_raw_logits() -> None:
    logits = np.asarray([[2.0, 1.0, 0.0]], np.float32)
    sampling = row(logprobs=1, logit_bias=(LogitBias(token_id=2, bias=50.0),))
    tokens, logprobs, _ = sample_rows(logits, [sampling])
    raw = logits[0].astype(np.float64)
    expected = raw - np.log(np.exp(raw).sum())
    assert tokens == [2]
    assert logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(expected[2], abs=1e-12)
    assert logprobs[0].top[0].token_id == 0


def test_a_decode_run_advancing_its_rows_picks_what_rebuilt_rows_pick() -> None:
    rng = np.random.default_rng(3)
    steps = rng.standard_normal((24, 64)).astype(np.float32) * 2
    settings = {
        "temperature": 0.8,
        "seed": 11,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.7,
        "prompt_ids": (1, 2, 3),
        "min_tokens": 4,
        "masked_until_min": (int(steps[0].argmax()),),
    }
    advanced = row(**settings)
    by_run: list[int] = []
    for logits in steps:
        (token,), _, _ = sample_rows(logits[None, :], [advanced])
        by_run.append(token)
        advanced = advanced.after(token)
    rebuilt: list[int] = []
    for index, logits in enumerate(steps):
        fresh = row(index=index, output_ids=tuple(rebuilt), **settings)
        rebuilt.append(sample_rows(logits[None, :], [fresh])[0][0])
    assert by_run == rebuilt
    assert advanced.output_ids == tuple(by_run)
    plain = row(temperature=0.8, seed=11)
    assert plain.after(5).output_ids == ()  # no penalty: no history carried


def test_penalties_change_nothing_at_their_neutral_values() -> None:
    logits = np.random.default_rng(4).standard_normal((8, 300)).astype(np.float32)
    neutral = [
        row(seq=i, temperature=0.9, seed=i, repetition_penalty=1.0, output_ids=(1, 2))
        for i in range(8)
    ]
    plain = [row(seq=i, temperature=0.9, seed=i) for i in range(8)]
    assert sample_rows(logits, neutral)[0] == sample_rows(logits, plain)[0]
    penalized = [r.model_copy(update={"frequency_penalty": 2.0}) for r in neutral]
    assert not all(
        adjusted_logits(logits[i], penalized[i]).tolist() == logits[i].astype(np.float64).tolist()
        for i in range(8)
    )
