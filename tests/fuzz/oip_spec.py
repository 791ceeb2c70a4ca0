"""The Open Inference Protocol REST spec, normalised so real requests match its paths.

The saved file (``oip/open_inference_rest.yaml``) stays untouched; its known defects
are repaired in memory: path templates such as ``/v2/models/${MODEL_NAME}`` carry a
literal ``$``, only the versioned model paths exist although clients use the versionless
ones too, and server metadata is ``/v2/`` only while clients call ``/v2``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

OIP_SPEC = Path(__file__).parent / "oip" / "open_inference_rest.yaml"
OIP_GENERATE_SPEC = Path(__file__).parent / "oip" / "generate_rest.yaml"  # the text extension
VERSION_SEGMENT = "/versions/{MODEL_VERSION}"


def load_oip_spec(path: Path = OIP_SPEC) -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(path.read_text())
    return normalise(raw)


def normalise(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy with real path templates, versionless twins and ``/v2`` beside ``/v2/``."""
    spec = copy.deepcopy(raw)
    paths = {strip_dollars(key): value for key, value in spec["paths"].items()}
    for key in [k for k in paths if VERSION_SEGMENT in k]:
        paths.setdefault(key.replace(VERSION_SEGMENT, ""), versionless(paths[key]))
    if "/v2/" in paths:
        paths.setdefault("/v2", copy.deepcopy(paths["/v2/"]))
    spec["paths"] = paths
    return spec


def strip_dollars(template: str) -> str:
    """``${NAME}`` -> ``{NAME}``: the spec's templates are not OpenAPI templates."""
    return re.sub(r"\$\{", "{", template)


def versionless(path_item: dict[str, Any]) -> dict[str, Any]:
    """The path item without its MODEL_VERSION parameter (and unique operation ids)."""
    twin = copy.deepcopy(path_item)
    twin["parameters"] = [p for p in twin.get("parameters", []) if p["name"] != "MODEL_VERSION"]
    for operation in twin.values():
        if isinstance(operation, dict) and "operationId" in operation:
            operation["operationId"] += "-versionless"
    return twin
