"""The scheduler's pure core: events and the current time in, actions out; no I/O."""
