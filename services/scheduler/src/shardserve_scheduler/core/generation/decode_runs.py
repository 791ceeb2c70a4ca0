"""Decode runs: how many decode steps (K) one StepWork carries, and the clock that decides.

Each token of an ordinary step costs a round trip through the broker (StepWork out,
StepResult back) and the scheduler's bookkeeping, while the agents wait. In a decode run
(vLLM's "multi-step scheduling") the ranks of a one-stage group run K steps in a row,
each feeding back the tokens the last one sampled; the leader streams each iteration's
tokens, and the scheduler checks the ranks' agreement once, at the end
(``StepWork.decode_steps``, ``shardserve_agent.generation.decode_runs``).

The rule (``decode_steps``): K > 1 only when the group has one stage, every row of the
step is a decode row (no sequence of the lane still has prompt to send) and no sequence
waits for admission; then K is the smallest of

- ``max_decode_steps``;
- ``decode_run_ms`` / the recent time of one decode iteration (at least 1): a request
  that arrives meanwhile waits about that long for the run to end before its prefill
  joins; with no decode iteration timed yet, K = 1 (that step is timed);
- for every member, the tokens it may still generate and the KV positions it still has
  reserved, so no rank ever writes past a reservation (a sequence that stops early for
  another reason, a stop string or EOS, simply ignores the rest of the run's tokens).

The time of one iteration (``record_iteration``) is measured here, from publishing a
decode-only step to its first tokens, then between the tokens of successive iterations:
an exponentially weighted average kept on the VersionRun.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Members

from shardserve_scheduler.core.generation.lanes import VersionRun
from shardserve_scheduler.core.generation.sequences import Sequence
from shardserve_scheduler.core.generation.state import Limits

ITERATION_WEIGHT = 0.25  # weight of the newest iteration in the average
UNTIMED_STEPS = 2**31


def decode_steps(run: VersionRun, members: Members[Sequence], limits: Limits) -> int:
    """K for a decode-only step of ``members`` (see the module docstring)."""
    if run.group.stage_size != 1 or run.admission.waiting or not members:
        return 1
    k = min(limits.max_decode_steps, steps_in_time(run.iteration_ms, limits.decode_run_ms))
    for sequence in members:
        k = min(k, tokens_left(sequence), kv_positions_left(sequence))
    return max(k, 1)


def steps_in_time(iteration_ms: float | None, run_ms: float) -> int:
    """How many iterations fit in ``run_ms`` (at least 1; 1 when none was timed yet)."""
    if iteration_ms is None:
        return 1
    if iteration_ms <= 0:
        return UNTIMED_STEPS  # no measurable time (a manual clock): the other caps decide
    return max(1, math.floor(run_ms / iteration_ms))


def tokens_left(sequence: Sequence) -> int:
    """Tokens the sequence may still generate (max_tokens, then the model's context)."""
    by_request = sequence.decoding.max_tokens - len(sequence.generated)
    return min(by_request, sequence.max_positions - sequence.length)


def kv_positions_left(sequence: Sequence) -> int:
    """Decode iterations its reservation holds: iteration i writes position length-1+i."""
    return sequence.capacity - sequence.length + 1


def record_iteration(run: VersionRun, ms: float) -> None:
    """One more decode iteration timed (its share of a step's wall time)."""
    if run.iteration_ms is None:
        run.iteration_ms = ms
    else:
        run.iteration_ms += ITERATION_WEIGHT * (ms - run.iteration_ms)
