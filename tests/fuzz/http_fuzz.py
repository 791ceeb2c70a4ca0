"""Property-based HTTP fuzzing of a live gateway with schemathesis.

Two specs drive it: the gateway's own ``GET /openapi.json`` (with links added here, so the
stateful phase can chain ``/v2/models`` -> a real model -> its metadata, readiness and
inference) and the normalised Open Inference Protocol spec. Every operation is fuzzed in
both generation modes (schema-conforming and schema-violating data), once more aimed at a
loaded model (real path parameters, fuzzed bodies and queries: the codecs are reached), and
the stateful phase follows the links. Every answer is tallied by status; >= 500 or no answer
is a failure. Unloading a loaded model is the one request never sent: it is valid, and the
mesh must still serve the demo afterwards.
"""

from __future__ import annotations

import copy
import gc
import json
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, assume, given
from hypothesis import strategies as st
from schemathesis.core.result import Err
from schemathesis.generation.stateful.state_machine import StepInput, StepOutput
from tests.fuzz.tally import HttpTally

REQUEST_TIMEOUT_S = 30.0
MODEL_PARAMETERS = ("model", "MODEL_NAME")
VERSION_PARAMETERS = ("version", "MODEL_VERSION")


def operation_ref(method: str, path: str) -> str:
    """A JSON pointer to one operation of the same spec ("/" is "~1" in a pointer)."""
    return f"#/paths/{path.replace('~', '~0').replace('/', '~1')}/{method.lower()}"


GATEWAY_LINKS = {  # (path, status) -> links added to the gateway's spec
    ("/v2/models", "200"): {
        f"{action} model": {
            "operationRef": operation_ref(*operation.split(" ")),
            "parameters": {"model": "$response.body#/models/0"},
        }
        for action, operation in (
            ("metadata of the", "GET /v2/models/{model}"),
            ("readiness of the", "GET /v2/models/{model}/ready"),
            ("infer with the", "POST /v2/models/{model}/infer"),
        )
    },
    ("/v2/models/{model}", "200"): {
        f"{action} version": {
            "operationRef": operation_ref(*operation.split(" ")),
            "parameters": {
                "model": "$response.body#/name",
                "version": "$response.body#/versions/0",
            },
        }
        for action, operation in (
            ("metadata of the", "GET /v2/models/{model}/versions/{version}"),
            ("readiness of the", "GET /v2/models/{model}/versions/{version}/ready"),
            ("infer with the", "POST /v2/models/{model}/versions/{version}/infer"),
        )
    },
}


@dataclass(frozen=True)
class Target:
    """The gateway under test and what must not be unloaded from it."""

    base_url: str
    loaded: tuple[str, ...]
    session: requests.Session

    def send(self, case: schemathesis.Case, tally: HttpTally) -> None:
        """One request; its status (0 when nothing answered) goes into ``tally``."""
        assume(not self.would_unload(case))
        what = f"{case.method} {case.formatted_path}"
        try:
            response = case.call(
                base_url=self.base_url, session=self.session, timeout=REQUEST_TIMEOUT_S
            )
        except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, ValueError):
            tally.refused_by_client += 1  # never left this process: nothing to learn
            return
        except requests.RequestException as exc:
            tally.record(0, f"{what}: {type(exc).__name__}")
            return
        tally.record(response.status_code, f"{what} -> {response.text[:200]!r}")

    def would_unload(self, case: schemathesis.Case) -> bool:
        model = str(_path_value(case, MODEL_PARAMETERS))
        # "<servable>:<method>" names the servable too
        return case.path.endswith("/unload") and model.split(":")[0].strip() in self.loaded


def _path_value(case: schemathesis.Case, names: tuple[str, ...]) -> Any:
    parameters = case.path_parameters or {}
    return next((parameters[n] for n in names if n in parameters), None)


def gateway_spec(base_url: str) -> dict[str, Any]:
    """The gateway's own spec, with links for the stateful phase."""
    with urllib.request.urlopen(base_url + "/openapi.json", timeout=10) as response:
        spec: dict[str, Any] = json.loads(response.read())
    return with_links(spec)


def with_links(spec: dict[str, Any]) -> dict[str, Any]:
    linked = copy.deepcopy(spec)
    for (path, status), links in GATEWAY_LINKS.items():
        responses = linked["paths"][path]["get"]["responses"]
        responses.setdefault(status, {"description": "ok"})["links"] = copy.deepcopy(links)
    return linked


# Cases per Hypothesis run: a run keeps every case's data until it ends (its megabyte
# bodies too: 0.3 MB a case), so 10,000 cases in one run held 7 GB per route.
CHUNK = 500


def run_in_chunks(count: int, sent: Callable[[], int], run: Callable[[int, int], None]) -> None:
    """``run(examples, seed)`` with seeds 0, 1, ... and up to CHUNK examples each, until
    ``sent()`` reaches ``count`` (or a run sends nothing: Hypothesis found no more cases);
    each run's garbage is collected before the next."""
    seed = 0
    while (left := count - sent()) > 0:
        before = sent()
        run(min(CHUNK, left), seed)
        gc.collect()  # (a finished run's data is held in reference cycles)
        if sent() == before:
            return
        seed += 1


def _settings(examples: int, seed: int) -> Callable[[Any], Any]:
    profile = hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    return lambda test: hypothesis.seed(seed)(profile(test))


def fuzz_operation(
    strategy: st.SearchStrategy[schemathesis.Case],
    target: Target,
    tally: HttpTally,
    examples: int,
    seed: int,
) -> None:
    @_settings(examples, seed)
    @given(case=strategy)
    def one(case: schemathesis.Case) -> None:
        target.send(case, tally)

    try:
        one()
    except hypothesis.errors.Unsatisfiable:
        pass  # e.g. no schema-violating request exists for an operation without inputs


def strategies(schema: Any, target: Target) -> Iterator[st.SearchStrategy[schemathesis.Case]]:
    """Per operation: conforming, violating, and conforming aimed at a loaded model."""
    for operation in operations(schema):
        for mode in schemathesis.GenerationMode:
            yield operation.as_strategy(generation_mode=mode)
        aimed = aimed_parameters(operation, target.loaded)
        if aimed is not None and not operation.path.endswith("/unload"):
            yield operation.as_strategy(path_parameters=aimed)


def operations(schema: Any) -> list[Any]:
    """Every operation of ``schema``; one the spec does not define well raises here (a fuzz
    that silently skipped a route would pass for the wrong reason)."""
    found = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        found.append(result.ok())
    return found


def aimed_parameters(operation: Any, loaded: tuple[str, ...]) -> dict[str, str] | None:
    names = {p.name for p in operation.path_parameters}
    model = next((n for n in MODEL_PARAMETERS if n in names), None)
    if model is None or not loaded:
        return None
    aimed = {model: loaded[0]}
    aimed.update({n: "1" for n in VERSION_PARAMETERS if n in names})
    return aimed


def fuzz_spec(spec: dict[str, Any], target: Target, tally: HttpTally, budget: int) -> None:
    """Requests drawn from every operation's strategies at once (one Hypothesis run: its
    set-up per run costs far more than a request) until ``budget`` were sent."""
    schema = schemathesis.openapi.from_dict(spec)
    every_operation = st.one_of(*strategies(schema, target))
    for seed in range(1_000):
        before = tally.sent
        fuzz_operation(every_operation, target, tally, budget - tally.sent, seed)
        if tally.sent >= budget or tally.sent == before:
            return


def fuzz_stateful(spec: dict[str, Any], target: Target, tally: HttpTally, budget: int) -> None:
    """Scenarios along the spec's links until about ``budget`` steps were sent."""
    schema = schemathesis.openapi.from_dict(spec)
    machine = recording_machine(schema.as_state_machine(), target, tally)
    for seed in range(1_000):
        before = tally.sent
        examples = max(1, (budget - tally.sent) // 5)  # a scenario takes a few steps
        machine.run(settings=_state_settings(examples, seed))
        if tally.sent >= budget or tally.sent == before:
            return


def _state_settings(examples: int, seed: int) -> hypothesis.settings:
    return hypothesis.settings(
        max_examples=examples,
        stateful_step_count=6,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=False,
        print_blob=False,
    )


def recording_machine(base: type[Any], target: Target, tally: HttpTally) -> type[Any]:
    """The schema's state machine, sending through ``target`` and tallying every status
    instead of asserting schemathesis' checks (a 4xx for bad input is the right answer)."""

    class Recording(base):
        def step(self, input: StepInput) -> StepOutput:
            case = input.case
            assume(not target.would_unload(case))
            try:
                response = case.call(
                    base_url=target.base_url, session=target.session, timeout=REQUEST_TIMEOUT_S
                )
            except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL):
                tally.refused_by_client += 1
                assume(False)
                raise
            except requests.RequestException as exc:
                tally.record(0, f"{case.method} {case.formatted_path}: {type(exc).__name__}")
                assume(False)
                raise
            tally.record(response.status_code, f"{case.method} {case.formatted_path} (stateful)")
            return StepOutput(response, case)

    return Recording
