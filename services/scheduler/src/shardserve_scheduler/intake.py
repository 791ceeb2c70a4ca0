"""Requests from the request queue into the machines, or refused at once.

An inference request is resolved (servable, version, method) and admitted to the request
machine; a bug before the machine registered it answers that request alone, so the rest
of its bundle still gets in. A generation request is tokenized in a worker thread (never
on the loop, which carries heartbeats and steps), then handed to the generation machine
in arrival order with the other generation requests and cancels. While the scheduler
drains (``closing``) both are refused UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from shardserve.errors import ErrorCode, InferenceError, UnavailableError
from shardserve.process.lifecycle import request_id_var
from shardserve.wire.protocol import GenerateCancel, InferRequest
from shardserve_scheduler.arrival_order import ArrivalOrder
from shardserve_scheduler.core.actions import Action, bug_message, error_reply
from shardserve_scheduler.core.catalog import Catalog
from shardserve_scheduler.core.generation.machine import GenerationMachine
from shardserve_scheduler.core.generation.resolve import Target, place_generation, prompt_ids
from shardserve_scheduler.core.generation.sequences import Origin
from shardserve_scheduler.core.generation.texts import TextModels
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import RequestMachine
from shardserve_scheduler.core.resolve import resolve

_logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "scheduler shutting down"


class RequestIntake:
    """Admits or refuses what the request queue brings; counts the refusals."""

    def __init__(
        self,
        catalog: Catalog,
        registry: Registry,
        texts: TextModels,
        machine: RequestMachine,
        generation: GenerationMachine,
        *,
        clock: Callable[[], float],
        emit: Callable[[Iterable[Action]], None],
    ) -> None:
        self._catalog = catalog
        self._registry = registry
        self._texts = texts
        self._machine = machine
        self._generation = generation
        self._clock = clock
        self._emit = emit
        self._order = ArrivalOrder()
        self.closing = False  # draining: every new request is refused UNAVAILABLE
        self.refused = 0

    # ------------------------------------------------------------------ inference

    def admit(self, request: InferRequest, reply_to: str, correlation_id: str) -> list[Action]:
        """The request admitted (the caller settles the machine once per message), or
        its one error reply."""
        token = request_id_var.set(request.id)
        try:
            return self.admit_or_fail(request, reply_to, correlation_id)
        finally:
            request_id_var.reset(token)

    def admit_or_fail(
        self, request: InferRequest, reply_to: str, correlation_id: str
    ) -> list[Action]:
        """``resolve_and_admit``, or an INTERNAL error for this request alone if it raised
        (a bug before the core registered the request; after, the core answers it itself)."""
        try:
            return self.resolve_and_admit(request, reply_to, correlation_id)
        except Exception as exc:
            _logger.exception("could not admit the request")
            message = bug_message("while admitting the request", exc)
            return [error_reply(request, reply_to, correlation_id, ErrorCode.INTERNAL, message)]

    def resolve_and_admit(
        self, request: InferRequest, reply_to: str, correlation_id: str
    ) -> list[Action]:
        if self.closing:
            code, message = ErrorCode.UNAVAILABLE, SHUTDOWN_MESSAGE
            return [error_reply(request, reply_to, correlation_id, code, message)]
        try:
            call = resolve(self._catalog, self._registry, request, reply_to, correlation_id)
        except InferenceError as exc:
            self.refused += 1
            _logger.info("request refused (%s): %s", exc.code.value, exc.message)
            return [error_reply(request, reply_to, correlation_id, exc.code, exc.message)]
        return self._machine.admit(call, self._clock())

    # ------------------------------------------------------------------ generation

    async def generate(self, origin: Origin) -> None:
        """A GenerateRequest: its place taken now, tokenized off the loop, then admitted
        (or refused) in its turn."""
        ticket = self._order.ticket()
        try:
            prepared = await self._tokenized(origin)
            await ticket.turn()
            self._emit(self._admit_generation(origin, prepared))
        finally:
            ticket.done()

    async def cancel(self, cancel: GenerateCancel) -> None:
        ticket = self._order.ticket()
        try:
            await ticket.turn()
            now = self._clock()
            self._emit(self._generation.on_cancel(cancel.reply_to, cancel.correlation_id, now))
        finally:
            ticket.done()

    async def _tokenized(self, origin: Origin) -> Target | InferenceError:
        """The request's Target, or the error that refuses it."""
        request = origin.request
        try:
            placed = place_generation(self._catalog, self._registry, self._texts, request)
            ids = await asyncio.to_thread(prompt_ids, placed.text, request, placed.max_positions)
        except InferenceError as exc:
            return exc
        except Exception as exc:  # a bug: this stream ends with it instead of hanging
            _logger.exception("could not tokenize the prompt")
            return InferenceError(bug_message("while tokenizing the prompt", exc))
        return Target(placed.group, placed.text, ids, placed.max_positions)

    def _admit_generation(self, origin: Origin, prepared: Target | InferenceError) -> list[Action]:
        token = request_id_var.set(origin.request.id)
        try:
            if self.closing:
                raise UnavailableError(SHUTDOWN_MESSAGE)
            if isinstance(prepared, InferenceError):
                raise prepared
            return self._generation.on_generate(origin, prepared, self._clock())
        except InferenceError as exc:
            self.refused += 1
            _logger.info("generation refused (%s): %s", exc.code.value, exc.message)
            return self._generation.refuse(origin, exc)
        except Exception as exc:  # a bug: this stream ends with it instead of hanging
            _logger.exception("could not admit the generation")
            error = InferenceError(bug_message("while admitting the generation", exc))
            return self._generation.refuse(origin, error)
        finally:
            request_id_var.reset(token)
