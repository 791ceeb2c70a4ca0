"""shardserve agent: serves one rank of a servable (its ONNX slice, stage work, collectives)."""
