"""A checkpoint's sampling defaults, from its generation_config.json.

Applied (by the scheduler) to the fields a request leaves out, as vLLM does with the fields
the file sets: ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``. As transformers
reads it, ``do_sample: false`` means greedy whatever the temperature says; a file without
``do_sample`` keeps its temperature (vLLM's reading: most checkpoints that set a temperature
mean it). Values outside the ranges a request may give are ignored, never served.

Usage::

    defaults = SamplingDefaults.from_config(json.loads(text))
    defaults.temperature   # float | None: None = no default (1.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SamplingDefaults"]


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SamplingDefaults:
        temperature = _number(config.get("temperature"), 0.0, 100.0)
        if config.get("do_sample") is False:
            temperature = 0.0
        top_k = config.get("top_k")
        return cls(
            temperature=temperature,
            top_p=_number(config.get("top_p"), 1e-9, 1.0),
            top_k=top_k
            if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0
            else None,
            repetition_penalty=_number(config.get("repetition_penalty"), 1e-9, 100.0),
        )


def _number(value: object, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if low <= value <= high else None
