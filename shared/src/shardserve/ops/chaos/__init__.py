"""The chaos suite: faults, overload and bad input against a real local mesh, under load.

``shardserve chaos [--scenarios A,B] [--quick] [--json OUT]`` starts ``shardserve up`` on
its own vhost, loads it with K closed-loop clients whose answers are checked, and injects
one fault per scenario (agent SIGKILL/SIGSTOP, scheduler SIGKILL, gateway SIGTERM, broker
restart, 10x flood, malformed AMQP, bad HTTP, stop under load). A ledger proves that
every request id got exactly one outcome; hung, lost and duplicated must be 0.
"""

from shardserve.ops.chaos.command import build_chaos, run_chaos

__all__ = ["build_chaos", "run_chaos"]
