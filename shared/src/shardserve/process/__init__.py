"""How a shardserve process runs: settings, cores, event loop, lifecycle, heap, children."""
