"""Generation in the gateway: the request sent, its chunk stream, SSE, token metrics."""
