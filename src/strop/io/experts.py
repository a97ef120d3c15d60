"""Routed experts: stored one linear per expert in checkpoints, stacked in transformers' models.

transformers 5 holds a MoE layer's experts as 3-D parameters (Qwen3-MoE's
``mlp.experts.gate_up_proj [E, 2I, H]``, each expert's gate rows then its up rows, and
``mlp.experts.down_proj [E, H, I]``), while checkpoints, its own ``save_pretrained``'s
included, keep a linear per expert (``mlp.experts.N.gate_proj.weight [I, H]``, ...).
:data:`STACKED_EXPERTS` declares each stacked layout; :class:`StackedExpertsReader` reads
a checkpoint with its per-expert tensors seen as the stacked parameters a model asks for,
and :func:`per_expert` splits a stacked parameter back into the checkpoint's tensors, so
that what strop writes loads anywhere a checkpoint does.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np

from strop.errors import ModelError
from strop.io.hf import SafetensorsReader


@dataclass(frozen=True)
class StackedExperts:
    """A parameter ``{prefix}{container}.{name}`` of shape ``[E, rows, cols]``: expert
    ``e``'s ``parts`` (``{prefix}{container}.{e}.{part}.weight``, each ``[rows_p, cols]``)
    concatenated along the rows."""

    container: str
    name: str
    parts: tuple[str, ...]

    def prefix_of(self, parameter: str) -> str | None:
        """The prefix (``model.layers.3.``) of ``parameter`` if it is of this layout."""
        suffix = f"{self.container}.{self.name}"
        if parameter == suffix or parameter.endswith("." + suffix):
            return parameter.removesuffix(suffix)
        return None

    def source(self, prefix: str, expert: int, part: str) -> str:
        """The checkpoint's name of expert ``expert``'s ``part``."""
        return f"{prefix}{self.container}.{expert}.{part}.weight"

    def experts_in(self, prefix: str, names: Collection[str]) -> int:
        """How many experts ``names`` holds every part of, counting from 0."""
        pattern = re.compile(
            rf"{re.escape(prefix + self.container)}\.(0|[1-9][0-9]*)\.{re.escape(self.parts[0])}\.weight"
        )
        numbers = {int(m[1]) for n in names if (m := pattern.fullmatch(n))}
        count = 0
        while count in numbers and all(self.source(prefix, count, p) in names for p in self.parts):
            count += 1
        return count


STACKED_EXPERTS = (
    StackedExperts("mlp.experts", "gate_up_proj", ("gate_proj", "up_proj")),
    StackedExperts("mlp.experts", "down_proj", ("down_proj",)),
)
"""The stacked layouts transformers 5 builds (Qwen2-MoE's and every model converted as it
is: Qwen3-MoE, OLMoE, ...)."""


def _layout_of(parameter: str) -> tuple[StackedExperts, str] | None:
    for layout in STACKED_EXPERTS:
        prefix = layout.prefix_of(parameter)
        if prefix is not None:
            return layout, prefix
    return None


class StackedExpertsReader:
    """A :class:`~strop.io.hf.SafetensorsReader` in which the per-expert tensors of each
    stacked parameter in ``wanted`` (a model's parameter names) read as that parameter:
    its name replaces theirs in :meth:`names`, its shape is ``[E, rows, cols]`` and
    :meth:`get` stacks them (one layer's experts at a time in memory). Every other
    tensor reads as it is stored."""

    def __init__(self, reader: SafetensorsReader, wanted: Collection[str]):
        self.reader = reader
        self.directory = reader.directory
        stored = set(reader.names())
        self.sources: dict[str, list[list[str]]] = {}  # stacked name -> [expert][part]
        for parameter in wanted:
            found = _layout_of(parameter)
            if found is None or parameter in stored:
                continue
            layout, prefix = found
            experts = range(layout.experts_in(prefix, stored))
            if experts:
                self.sources[parameter] = [
                    [layout.source(prefix, e, part) for part in layout.parts] for e in experts
                ]
        self.stacked = {n for parts in self.sources.values() for row in parts for n in row}

    def names(self) -> list[str]:
        return [n for n in self.reader.names() if n not in self.stacked] + list(self.sources)

    def __contains__(self, name: str) -> bool:
        return name in self.sources or (name in self.reader and name not in self.stacked)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.sources:
            return self.reader.shape(name)
        experts = self.sources[name]
        shapes = {tuple(self.reader.shape(n) for n in parts) for parts in experts}
        columns = {s[1] for parts in shapes for s in parts}
        if len(shapes) != 1 or len(columns) != 1 or any(len(s) != 2 for s in next(iter(shapes))):
            raise ModelError(
                f"{self.directory}: the experts of {name!r} differ in their tensors' shapes "
                f"({experts[0][0]!r} ...)"
            )
        rows = sum(s[0] for s in next(iter(shapes)))
        return (len(experts), rows, columns.pop())

    def dtype(self, name: str) -> str:
        return self.reader.dtype(self.sources[name][0][0] if name in self.sources else name)

    def get(self, name: str) -> np.ndarray:
        if name not in self.sources:
            return self.reader.get(name)
        return np.stack(
            [np.concatenate([self.reader.get(n) for n in parts]) for parts in self.sources[name]]
        )


def per_expert(name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` as the checkpoint stores it: a stacked experts parameter
    (``[E, rows, cols]``, :data:`STACKED_EXPERTS`) as each expert's parts (the rows split
    equally between them), any other as it is."""
    found = _layout_of(name) if array.ndim == 3 else None
    if found is None:
        yield name, array
        return
    layout, prefix = found
    for expert, rows in enumerate(array):
        for part, block in zip(layout.parts, np.split(rows, len(layout.parts)), strict=True):
            yield layout.source(prefix, expert, part), block
