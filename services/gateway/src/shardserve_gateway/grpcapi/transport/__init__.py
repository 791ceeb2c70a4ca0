"""gRPC over HTTP/2 (h2) on the event loop: framing and statuses (wire), one call's stream
(stream), what a handler sees (context), and the connection that owns them (connection)."""
