"""shardserve: distributed inference serving over RabbitMQ.

The import root every service shares: wire protocol, codec, topology, broker access,
settings, the model-repository format, the exporters, the client and the CLI.
Services import this package; this package imports no service.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
