"""gRPC over HTTP/2 on the event loop: HTTP/2 sans I/O (http2, with HPACK in header_codec),
gRPC's framing and statuses (wire), one call's stream (stream), what a handler sees
(context), and the connection that owns them (connection)."""
