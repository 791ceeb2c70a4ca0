"""A servable_config.py that calls sys.exit() is a config error, not the scheduler's end."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.errors import ServableConfigError
from shardserve.servable import load_servable_config


def test_sys_exit_in_a_config_is_reported_with_its_line(tmp_path: Path) -> None:
    config = tmp_path / "servable_config.py"
    config.write_text("import sys\n\nsys.exit(3)\n")
    with pytest.raises(ServableConfigError, match=r"servable_config.py:3: called sys.exit\(3\)"):
        load_servable_config(config)
