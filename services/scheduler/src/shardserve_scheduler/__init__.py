"""shardserve scheduler: agent registry, group readiness, the request/job state machine.

The core (``registry``, ``catalog``, ``resolve``, ``requests``, ``status``) is pure: no
broker, no asyncio, no clock of its own (``now`` is passed in). ``service`` is the I/O
shell that feeds it broker messages and executes the actions it returns.
"""
