"""The model repository format: versions and group config, signatures, external data, per-host packs."""
