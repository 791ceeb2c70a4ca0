"""Mesh metrics re-exported from the latest MeshStatus, so one scrape of a gateway's
``/metrics`` covers the whole mesh (the scheduler and agents serve no HTTP).

Values are the scheduler's counters as last broadcast (at most ~1 s old; see
``shardserve_gateway_status_age_seconds``). Counters restart at 0 when the scheduler
restarts, which Prometheus' ``rate()`` handles as a counter reset. Names (labels):

Per servable version (``servable``, ``version``):
  shardserve_servable_ready                     gauge 1/0
  shardserve_servable_state{state}              gauge 1 for the current state
  shardserve_servable_queued                    instances waiting to be batched/run
  shardserve_servable_inflight                  instances being run
  shardserve_servable_requests_total            requests the scheduler accepted
  shardserve_servable_errors_total              requests that ended in an error
  shardserve_servable_batches_total             jobs run (a job = one batch)
  shardserve_servable_batched_instances_total   instances run in those jobs
  shardserve_servable_mean_batch_size           batched_instances_total / batches_total
  shardserve_servable_running_sequences         generations being advanced (generation only)
  shardserve_servable_waiting_sequences         generations waiting for KV room (idem)
Per rank (``servable``, ``version``, ``rank``, ``stage``):
  shardserve_rank_up                            gauge 1 when the rank is ready
  shardserve_rank_state{state}                  gauge 1 for the current state
  shardserve_rank_compute_seconds_total         time spent running ONNX segments
  shardserve_rank_collective_seconds_total      time spent in collectives
  shardserve_rank_jobs_done_total               stage jobs finished
  shardserve_rank_cache_hit{cache}              1 when the slice came from the cache
  shardserve_rank_rss_bytes                     resident memory of the agent
  shardserve_rank_heartbeat_age_seconds         age of the latest heartbeat
  shardserve_rank_load_seconds                  time the agent took to load its slice
  shardserve_rank_inflight                      jobs the agent is running
  shardserve_rank_kv_used_bytes                 KV cache reserved by sequences (generation)
  shardserve_rank_kv_capacity_bytes             the rank's KV cache budget (generation)
  shardserve_rank_sequences                     sequences holding KV on the rank (generation)
Mesh-wide:
  shardserve_dead_lettered_total                messages in the dead-letter queue (all services)
  shardserve_request_queue_depth                requests waiting in the request queue
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.wire.protocol import MeshStatus, RankStatus, ServableStatus

RANK_STATES = ("missing", "loading", "ready", "draining", "lost")
SERVABLE_STATES = ("loading", "available", "unloading", "failed")


def labels(**values: str) -> str:
    """``{k="v",...}`` with Prometheus escaping (empty string for no labels)."""
    if not values:
        return ""
    body = ",".join(f'{k}="{escape(v)}"' for k, v in values.items())
    return "{" + body + "}"


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class Family:
    """One metric family: HELP, TYPE and its samples."""

    name: str
    kind: str
    help: str
    samples: list[str] = field(default_factory=list)

    def add(self, value: float, **label_values: str) -> None:
        self.samples.append(f"{self.name}{labels(**label_values)} {_number(value)}")

    def render(self) -> list[str]:
        if not self.samples:
            return []
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples]


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.6g}"


class _Families:
    """Families created on first use, rendered in creation order."""

    def __init__(self) -> None:
        self._by_name: dict[str, Family] = {}

    def __call__(self, name: str, kind: str, help_text: str) -> Family:
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = Family(name, kind, help_text)
        return family

    def render(self) -> list[str]:
        lines: list[str] = []
        for family in self._by_name.values():
            lines += family.render()
        return lines


def render_mesh(status: MeshStatus | None) -> list[str]:
    """Prometheus lines for the mesh as the latest status describes it."""
    if status is None:
        return []
    families = _Families()
    for servable in status.servables:
        _servable_metrics(families, servable)
        for rank in servable.ranks:
            _rank_metrics(families, servable, rank)
    families("shardserve_dead_lettered_total", "counter", "Messages dead-lettered.").add(
        status.dead_lettered
    )
    families("shardserve_request_queue_depth", "gauge", "Requests waiting in the queue.").add(
        status.request_queue_depth
    )
    return families.render()


def _servable_metrics(f: _Families, s: ServableStatus) -> None:
    sv = {"servable": s.name, "version": str(s.version)}
    f("shardserve_servable_ready", "gauge", "1 when the version takes requests.").add(
        int(s.ready), **sv
    )
    state = f("shardserve_servable_state", "gauge", "1 for the version's current state.")
    for name in SERVABLE_STATES:
        state.add(int(s.state == name), **sv, state=name)
    f("shardserve_servable_queued", "gauge", "Instances waiting to run.").add(s.queued, **sv)
    f("shardserve_servable_inflight", "gauge", "Instances running.").add(s.inflight, **sv)
    counters = (
        ("requests_total", "Requests accepted by the scheduler.", s.requests_total),
        ("errors_total", "Requests that ended in an error.", s.errors_total),
        ("batches_total", "Jobs (batches) run.", s.batches_total),
        ("batched_instances_total", "Instances run in jobs.", s.batched_instances_total),
    )
    for suffix, help_text, value in counters:
        f(f"shardserve_servable_{suffix}", "counter", help_text).add(value, **sv)
    mean = s.batched_instances_total / s.batches_total if s.batches_total else 0.0
    f("shardserve_servable_mean_batch_size", "gauge", "Mean instances per job.").add(mean, **sv)
    if s.generation:
        f("shardserve_servable_running_sequences", "gauge", "Generations running.").add(
            s.running_sequences, **sv
        )
        f("shardserve_servable_waiting_sequences", "gauge", "Generations waiting.").add(
            s.waiting_sequences, **sv
        )


def _rank_metrics(f: _Families, s: ServableStatus, r: RankStatus) -> None:
    rl = {"servable": s.name, "version": str(s.version), "rank": str(r.rank), "stage": str(r.stage)}
    f("shardserve_rank_up", "gauge", "1 when the rank is ready.").add(int(r.state == "ready"), **rl)
    state = f("shardserve_rank_state", "gauge", "1 for the rank's current state.")
    for name in RANK_STATES:
        state.add(int(r.state == name), **rl, state=name)
    f("shardserve_rank_compute_seconds_total", "counter", "Time running ONNX segments.").add(
        r.compute_ms_total / 1000.0, **rl
    )
    f("shardserve_rank_collective_seconds_total", "counter", "Time in collectives.").add(
        r.collective_ms_total / 1000.0, **rl
    )
    f("shardserve_rank_jobs_done_total", "counter", "Stage jobs finished.").add(r.jobs_done, **rl)
    f("shardserve_rank_cache_hit", "gauge", "1 when the slice was loaded from the cache.").add(
        int(r.cache == "hit"), **rl, cache=r.cache
    )
    f("shardserve_rank_rss_bytes", "gauge", "Resident memory of the agent.").add(r.rss_bytes, **rl)
    if r.heartbeat_age_s is not None:
        f("shardserve_rank_heartbeat_age_seconds", "gauge", "Age of the last heartbeat.").add(
            r.heartbeat_age_s, **rl
        )
    f("shardserve_rank_load_seconds", "gauge", "Time taken to load the slice.").add(
        r.load_ms / 1000.0, **rl
    )
    f("shardserve_rank_inflight", "gauge", "Jobs the agent is running.").add(r.inflight, **rl)
    if s.generation:
        _rank_kv_metrics(f, r, rl)


def _rank_kv_metrics(f: _Families, r: RankStatus, rl: dict[str, str]) -> None:
    f("shardserve_rank_kv_used_bytes", "gauge", "KV cache reserved by sequences.").add(
        r.kv_used_bytes, **rl
    )
    f("shardserve_rank_kv_capacity_bytes", "gauge", "KV cache budget of the rank.").add(
        r.kv_capacity_bytes, **rl
    )
    f("shardserve_rank_sequences", "gauge", "Sequences holding KV on the rank.").add(
        r.sequences, **rl
    )
