"""The HTTP routes, one module per protocol or concern."""
