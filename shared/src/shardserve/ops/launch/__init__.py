"""The pieces of ``shardserve up`` (entry point: ``shardserve.ops.launch.up``).

``plan``: the repository's versions and every process's command line; ``status``: the
mesh's state read through the gateway, as progress lines and the status grid; ``mesh``:
the supervised processes, by tier and by version; ``watch``: versions added to or
removed from the repository while the mesh runs.
"""
