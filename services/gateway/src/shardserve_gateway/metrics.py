"""Prometheus metrics of the gateway, in a small hand-written text exposition.

``GET /metrics`` is the one scrape point of the whole mesh: the gateway's own metrics
below, then the mesh's, re-exported from the latest MeshStatus (names listed in
``mesh_metrics``). Gateway metrics (labels):

  shardserve_gateway_requests_total{servable,method,status}   inference requests by outcome
  shardserve_gateway_errors_total{servable,method,status}     the ones with status >= 400
  shardserve_gateway_request_duration_seconds{servable,method} latency histogram
  shardserve_gateway_inflight_requests                         HTTP requests being handled
  shardserve_gateway_broker_up                                 1 while the broker is connected
  shardserve_gateway_published_requests_total                  requests handed to the broker
  shardserve_gateway_request_messages_total                    messages that carried them (a
                                                               bundle of several counts once)
  shardserve_gateway_late_replies_total                        replies after the deadline
  shardserve_gateway_failed_early_total                        requests failed at once because
                                                               their reply could not come
                                                               (scheduler restart, broker loss)
  shardserve_gateway_status_age_seconds                        age of the latest mesh status
  shardserve_gateway_status_fresh                              1 while that status is fresh

Generations add token-level histograms and counters (``generation_metrics``).

Counters and the histogram are keyed by (servable, method): names come from the mesh
status, never from the URL as typed, so unknown models all count as ``_unknown`` and a
client cannot blow up the label space.
"""

from __future__ import annotations

from collections import defaultdict

from shardserve.wire.protocol import MeshStatus
from shardserve_gateway.generation.metrics import GenerationMetrics
from shardserve_gateway.histogram import Histogram, seconds_buckets
from shardserve_gateway.mesh_metrics import render_mesh

# A request may run a minute (a long pipeline, a big batch): one bound past the series.
LATENCY_BUCKETS_S = (*seconds_buckets(0.005, 30.0), 60.0)
UNKNOWN = "_unknown"

Labels = tuple[str, str]


class Metrics:
    """Request counts by outcome, latency histogram, in-flight gauge."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.errors: dict[tuple[str, str, int], int] = defaultdict(int)
        self.latency: dict[Labels, Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS_S))
        self.inflight = 0
        self.generation = GenerationMetrics()

    def observe(self, labels: Labels, status: int, seconds: float) -> None:
        """Count one finished inference request."""
        servable, method = labels
        self.requests[(servable, method, status)] += 1
        if status >= 400:
            self.errors[(servable, method, status)] += 1
        self.latency[labels].observe(seconds)

    def render(
        self,
        *,
        broker_up: bool,
        status_age_s: float | None,
        late_replies: int,
        failed_early: int = 0,
        published: int = 0,
        request_messages: int = 0,
        status_fresh: bool = False,
        mesh: MeshStatus | None = None,
    ) -> str:
        """The Prometheus text exposition (version 0.0.4): the gateway's, then the mesh's."""
        lines = _counter(
            "shardserve_gateway_requests_total", "Inference requests by outcome.", self.requests
        )
        lines += _counter(
            "shardserve_gateway_errors_total", "Inference requests that failed.", self.errors
        )
        lines += self._render_latency()
        lines += [
            "# HELP shardserve_gateway_inflight_requests HTTP requests being handled now.",
            "# TYPE shardserve_gateway_inflight_requests gauge",
            f"shardserve_gateway_inflight_requests {self.inflight}",
            "# HELP shardserve_gateway_broker_up Whether the broker connection is up.",
            "# TYPE shardserve_gateway_broker_up gauge",
            f"shardserve_gateway_broker_up {int(broker_up)}",
            "# HELP shardserve_gateway_published_requests_total Requests handed to the broker.",
            "# TYPE shardserve_gateway_published_requests_total counter",
            f"shardserve_gateway_published_requests_total {published}",
            "# HELP shardserve_gateway_request_messages_total Messages that carried the "
            "requests (one InferRequestBundle of several requests counts once).",
            "# TYPE shardserve_gateway_request_messages_total counter",
            f"shardserve_gateway_request_messages_total {request_messages}",
            "# HELP shardserve_gateway_late_replies_total Replies that came after the deadline.",
            "# TYPE shardserve_gateway_late_replies_total counter",
            f"shardserve_gateway_late_replies_total {late_replies}",
            "# HELP shardserve_gateway_failed_early_total Requests failed at once because "
            "their reply could not come (scheduler restart, broker connection lost).",
            "# TYPE shardserve_gateway_failed_early_total counter",
            f"shardserve_gateway_failed_early_total {failed_early}",
            "# HELP shardserve_gateway_status_fresh Whether the latest mesh status is fresh.",
            "# TYPE shardserve_gateway_status_fresh gauge",
            f"shardserve_gateway_status_fresh {int(status_fresh)}",
        ]
        if status_age_s is not None:
            lines += [
                "# HELP shardserve_gateway_status_age_seconds Age of the latest mesh status.",
                "# TYPE shardserve_gateway_status_age_seconds gauge",
                f"shardserve_gateway_status_age_seconds {status_age_s:.3f}",
            ]
        lines += self.generation.render()
        lines += render_mesh(mesh)
        return "\n".join(lines) + "\n"

    def _render_latency(self) -> list[str]:
        name = "shardserve_gateway_request_duration_seconds"
        lines = [
            f"# HELP {name} Inference request latency as seen by the gateway.",
            f"# TYPE {name} histogram",
        ]
        for (servable, method), hist in sorted(self.latency.items()):
            lines += hist.render(name, servable=servable, method=method)
        return lines


def _counter(name: str, help_text: str, counts: dict[tuple[str, str, int], int]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    for (servable, method, status), n in sorted(counts.items()):
        lines.append(f"{name}{_labels(servable=servable, method=method, status=str(status))} {n}")
    return lines


def _labels(**labels: str) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
