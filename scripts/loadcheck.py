"""Steady HTTP load against a gateway, counting every request's one outcome.

Outcomes: ``ok`` (200 and the expected answer), ``wrong`` (200, another answer),
``clear_error`` (an HTTP error status with an ``error`` message), ``lost`` (the
connection failed or closed without an answer), ``hung`` (no answer within the request
timeout plus a grace period). Used by scripts/rabbit-cluster, scripts/netns-hosts and the
integration tests; standard library only.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

HANG_GRACE_S = 10.0


@dataclass
class LoadReport:
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if detail:
                self.errors[detail[:120]] += 1

    def summary(self) -> dict[str, object]:
        sent = sum(self.counts.values())
        keys = ("ok", "wrong", "clear_error", "lost", "hung")
        return {
            "sent": sent,
            **{k: self.counts.get(k, 0) for k in keys},
            "errors": dict(self.errors.most_common(8)),
        }


def infer_body(shape: list[int], value: float = 1.0, name: str = "x") -> bytes:
    count = 1
    for dim in shape:
        count *= dim
    tensor = {"name": name, "shape": shape, "datatype": "FP32", "data": [value] * count}
    return json.dumps({"inputs": [tensor]}).encode()


def one_request(
    url: str, body: bytes, check: Callable[[dict[str, object]], bool], timeout_s: float
) -> tuple[str, str]:
    request = urllib.request.Request(
        url,
        data=body,
        headers={"Content-Type": "application/json", "X-Request-Timeout": f"{timeout_s:g}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s + HANG_GRACE_S) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = str(json.loads(exc.read()).get("error", ""))
        except ValueError:
            message = ""
        return ("clear_error", f"{exc.code} {message}") if message else ("lost", f"{exc.code}")
    except TimeoutError:
        return "hung", "no answer in time"
    except (urllib.error.URLError, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            return "hung", "no answer in time"
        return "lost", f"transport: {reason}"
    return ("ok", "") if check(answer) else ("wrong", json.dumps(answer)[:120])


def run_load(
    url: str,
    body: bytes,
    check: Callable[[dict[str, object]], bool],
    *,
    stop: threading.Event,
    concurrency: int = 2,
    timeout_s: float = 8.0,
    pause_s: float = 0.02,
) -> LoadReport:
    """Send requests from ``concurrency`` threads until ``stop`` is set; every one is
    waited for, so the report counts each request's outcome exactly once."""
    report = LoadReport()

    def worker() -> None:
        while not stop.is_set():
            outcome, detail = one_request(url, body, check, timeout_s)
            report.add(outcome, detail)
            time.sleep(pause_s)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return report


def all_close(expected: float, output: str = "y") -> Callable[[dict[str, object]], bool]:
    """An answer check: every value of output ``output`` equals ``expected``."""

    def check(answer: dict[str, object]) -> bool:
        outputs = answer.get("outputs")
        if not isinstance(outputs, list):
            return False
        for out in outputs:
            if isinstance(out, dict) and out.get("name") == output:
                data = out.get("data")
                return isinstance(data, list) and all(abs(v - expected) < 1e-4 for v in data)
        return False

    return check
