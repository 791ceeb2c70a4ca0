"""The model repository format: versions, group config, signatures, external data, packs."""
