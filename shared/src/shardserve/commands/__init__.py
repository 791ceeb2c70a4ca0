"""Builders and handlers of the ``shardserve`` subcommands, by command group (the
registry and the entry point are ``shardserve.cli``)."""
