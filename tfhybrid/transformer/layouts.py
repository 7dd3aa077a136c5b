"""Activation layouts along the model axis and the conversions between them
(pure Python).

A tensor of a transformed model is held by the ranks of a model group in one
of four layouts:

===========  ==========================================================  ==========
kind         what each rank of the model group holds                     strategies
===========  ==========================================================  ==========
rows         its own rows of the batch, all features (batch split over   d, gmp
             every rank of the world)
replicated   the model group's rows, all features, identical on every    f c s df
             rank (R); ``grouped`` marks the union of the group's rows   ds gmp
             gathered by a ModuloLayer (gmp's model-parallel region)
channel      the group's rows, its block of the last (feature) axis      f c df gmp
space        the group's rows, its block of height/width                 s ds
===========  ==========================================================  ==========

:data:`CONVERSIONS` names the boundary layer the rewrite inserts for each
change of layout (SplitBrain's ModuloLayer and its inverse, the spatial
scatter/gather, a feature all-gather).
"""
from __future__ import annotations

import dataclasses

ACTIVATION_LAYOUT_KINDS = ("rows", "replicated", "channel", "space")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Layout of one activation tensor along the model axis.

    Attributes:
        kind: One of :data:`ACTIVATION_LAYOUT_KINDS`.
        grouped: True for tensors holding the rows of the whole model group
            (after a ModuloLayer); weights that consume them get gradient
            scale 1/K because the group's K losses are summed.

    Example:
        >>> Layout("replicated", grouped=True).with_kind("channel")
        Layout(kind='channel', grouped=True)
    """

    kind: str
    grouped: bool = False

    def __post_init__(self):
        if self.kind not in ACTIVATION_LAYOUT_KINDS:
            raise ValueError(f"Received an invalid layout kind {self.kind!r}; expected one of "
                             f"{ACTIVATION_LAYOUT_KINDS}.")

    def with_kind(self, kind: str) -> "Layout":
        """The same rows, held as ``kind``."""
        return Layout(kind, self.grouped)

    @property
    def full(self) -> bool:
        """True when every rank holds all features and all space of its rows."""
        return self.kind in ("rows", "replicated")


ROWS = Layout("rows")
REPLICATED_ACTIVATION = Layout("replicated")
CHANNEL = Layout("channel")
SPACE = Layout("space")
GROUPED = Layout("replicated", grouped=True)

# (from kind, to kind) -> name of the boundary inserted by the rewrite.
CONVERSIONS = {
    ("rows", "replicated"): "modulo",          # SplitBrain Lm: gather the group's rows
    ("replicated", "rows"): "unmodulo",        # its inverse: back to own rows
    ("space", "replicated"): "space_gather",   # SpatialGather before Flatten/Dense
    ("replicated", "space"): "space_scatter",  # SpatialScatter of the input
    ("channel", "replicated"): "channel_gather",
}


def convert(src: Layout, kind: str):
    """(conversion name or None, resulting layout) to hold ``src`` as ``kind``.

    Raises:
        ValueError: when no single boundary layer performs the change.

    Example:
        >>> convert(ROWS, "replicated")
        ('modulo', Layout(kind='replicated', grouped=True))
    """
    if src.kind == kind:
        return None, src
    name = CONVERSIONS.get((src.kind, kind))
    if name is None:
        raise ValueError(f"No boundary layer converts a {src.kind!r} tensor to {kind!r}.")
    if name == "modulo":
        return name, GROUPED
    if name == "unmodulo":
        return name, ROWS
    return name, src.with_kind(kind)
