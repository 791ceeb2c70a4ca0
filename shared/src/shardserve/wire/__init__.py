"""The wire: tensors, the typed message union, the msgpack codec, chunking, the topology."""
