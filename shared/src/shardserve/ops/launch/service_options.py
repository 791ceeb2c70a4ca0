"""The services' own options on ``shardserve up``, derived from their settings declarations.

Each service (scheduler, gateway, agent) declares its options once, on its settings
dataclass (``shardserve.process.options``). ``up`` reads those declarations and offers every
option it does not set itself: given on ``up``'s command line, an option is passed on to
every service that declares it (``--drain-seconds 5`` to all three, ``--max-waiting-sequences
3`` to the scheduler). Nothing is written twice: a new service option shows on ``up`` by
itself.

Not offered: what ``up`` decides per process (``--repository``, ``--servable``, ``--version``,
``--rank``, ``--gateway-id``, ``--reuse-port``, ``--cache-dir``) and what ``up`` declares
itself (``--host``, ``--threads``...: its parser has them already).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

from shardserve.process.options import Option, declared_options

__all__ = ["PassedOption", "add_service_options", "service_argvs", "service_options"]

SETTINGS = {
    "scheduler": ("shardserve_scheduler.settings", "SchedulerSettings"),
    "gateway": ("shardserve_gateway.settings", "GatewaySettings"),
    "agent": ("shardserve_agent.settings", "AgentSettings"),
}
# --cache-dir names one rank's folder: given to every agent, their caches would collide.
PER_PROCESS = frozenset(
    {
        "--repository",
        "--servable",
        "--version",
        "--rank",
        "--gateway-id",
        "--reuse-port",
        "--cache-dir",
    }
)
DEST_PREFIX = "service_option_"


@dataclass(frozen=True)
class PassedOption:
    """One option and the services that declare it (the first declaration describes it)."""

    declared: Option
    services: tuple[str, ...]

    @property
    def dest(self) -> str:
        return DEST_PREFIX + self.declared.flag.removeprefix("--").replace("-", "_")

    def argv(self, value: object) -> tuple[str, ...]:
        """The option as the service's command line takes it."""
        flag = self.declared.flag
        if self.declared.kind == "switch":
            return (flag if value else "--no-" + flag.removeprefix("--"),)
        if self.declared.kind == "off_switch":
            return (flag,)
        return (flag, str(value))


def service_options() -> list[PassedOption]:
    """Every service's options, merged by flag, in declaration order."""
    found: dict[str, PassedOption] = {}
    for service, (module, name) in SETTINGS.items():
        settings_class = getattr(importlib.import_module(module), name)
        for _, declared in declared_options(settings_class):
            known = found.get(declared.flag)
            services = (known.services if known else ()) + (service,)
            found[declared.flag] = PassedOption(known.declared if known else declared, services)
    return [o for o in found.values() if o.declared.flag not in PER_PROCESS]


def add_service_options(parser: argparse.ArgumentParser) -> None:
    """Add the options ``parser`` does not have yet, each defaulting to "not given"."""
    group = parser.add_argument_group(
        "service options", "passed on to every service that declares them (see its --help)"
    )
    for passed in service_options():
        if passed.declared.flag in parser._option_string_actions:
            continue  # up's own option
        _add(group, passed)


def _add(group: argparse._ArgumentGroup, passed: PassedOption) -> None:
    declared = passed.declared
    where = f"[{', '.join(passed.services)}]"
    text = f"{declared.help} {where}" if declared.help else where
    if declared.kind == "switch":
        action: type[argparse.Action] = argparse.BooleanOptionalAction
        group.add_argument(declared.flag, dest=passed.dest, action=action, default=None, help=text)
    elif declared.kind == "off_switch":
        group.add_argument(
            declared.flag, dest=passed.dest, action="store_true", default=None, help=text
        )
    else:
        group.add_argument(
            declared.flag,
            dest=passed.dest,
            type=declared.parse,
            choices=declared.choices,
            default=None,
            metavar=None if declared.choices else passed.dest.removeprefix(DEST_PREFIX).upper(),
            help=text,
        )


def service_argvs(args: argparse.Namespace) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(service, arguments) of the service options given on ``up``'s command line."""
    argvs: dict[str, list[str]] = {service: [] for service in SETTINGS}
    for passed in service_options():
        value = getattr(args, passed.dest, None)
        if value is None:
            continue
        for service in passed.services:
            argvs[service] += passed.argv(value)
    return tuple((service, tuple(argv)) for service, argv in argvs.items())
