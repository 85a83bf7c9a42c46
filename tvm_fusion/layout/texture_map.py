"""The image2d (2.5-D texture) mapping of a tensor (SmartMem §3.2.3, Fig. 5).

A texture holds texels of 4 lanes (RGBA) on a width × height grid, optionally in array slices.
SmartMem maps a tensor onto it from its consumers' reduction dimensions: the first (heaviest
consumer's) reduction dimension is split by 4 into the RGBA lanes, a second one runs along the
width (x), and every other dimension goes to the height (y), row-major, with slices (z) taken
from the outermost ones only when the height would exceed the device limit. With k = 2 such
dimensions one layout serves consumers reducing along either (L0 in Fig. 5); with one, its
blocks of 4 run along x (MACE's channel-major image). For conv2d NCHW with the channel packed
and the kernel width along x this is NCHW4c, TVM's own texture layout.

The logical → physical map is a :class:`tvm.tirx.IndexMap` onto ``[Z,] Y, X, 4``, which TVM's
``global.texture`` flattening turns into ``(x, y, z)`` image coordinates (depth = Z, height =
Y, width = X). Only packed dimensions divisible by 4 are used: a padded lane would need masked
reductions (softmax, max) that we do not generate.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

LANES = 4
BLOCK = "block"  # marks the packed dimension's block index (i_p // 4) in an axis list


@dataclass(frozen=True)
class Limits:
    """Image size limits of the target (``texture_spatial_limit``, ``texture_depth_limit``)."""

    spatial: int = 16384
    depth: int = 2048

    @classmethod
    def from_target(cls, target) -> Limits:
        attrs = target.attrs if target is not None else {}
        return cls(int(attrs.get("texture_spatial_limit", 16384)),
                   int(attrs.get("texture_depth_limit", 2048)))


@dataclass(frozen=True)
class TextureLayout:
    """Where every logical element lives: ``lane = i_p % 4``, ``x``, ``y`` and ``z`` are
    row-major combinations of the listed axes (a dimension index, or :data:`BLOCK` for
    ``i_p // 4``)."""

    shape: tuple[int, ...]
    packed: int
    x: tuple
    y: tuple
    z: tuple = ()

    def extent(self, axes) -> int:
        total = 1
        for axis in axes:
            total *= self.shape[self.packed] // LANES if axis == BLOCK else self.shape[axis]
        return total

    @property
    def width(self) -> int:
        return self.extent(self.x)

    @property
    def height(self) -> int:
        return self.extent(self.y)

    @property
    def depth(self) -> int:
        return self.extent(self.z)

    @property
    def physical_shape(self) -> tuple[int, ...]:
        head = (self.depth,) if self.z else ()
        return (*head, self.height, self.width, LANES)

    def index_map(self) -> tirx.IndexMap:
        """Logical indices → ``[z,] y, x, lane``."""
        packed, shape = self.packed, self.shape

        def value(axis, idx):
            return idx[packed] // LANES if axis == BLOCK else idx[axis]

        def combine(axes, idx):
            expr = None
            for axis in axes:
                size = shape[packed] // LANES if axis == BLOCK else shape[axis]
                term = value(axis, idx)
                expr = term if expr is None else expr * size + term
            # no axis (a single row, e.g. a [1, C] tensor whose blocks run along x): row 0
            return expr if expr is not None else tirx.const(0, "int64")

        def fn(*idx):
            head = [combine(self.z, idx)] if self.z else []
            return [*head, combine(self.y, idx), combine(self.x, idx), idx[packed] % LANES]

        return tirx.IndexMap.from_func(fn, ndim=len(shape), index_dtype="int64")

    def describe(self) -> str:
        def name(axes):
            return "·".join(f"d{self.packed}/4" if a == BLOCK else f"d{a}" for a in axes) or "1"

        z = f"z={name(self.z)}, " if self.z else ""
        return (f"{'x'.join(map(str, self.shape))} → image {self.width}×{self.height}"
                f"{'×' + str(self.depth) if self.z else ''}: lanes=d{self.packed}%4, "
                f"x={name(self.x)}, y={name(self.y)}, {z}".rstrip(", "))


def texture_layout(shape, reduction_dims, limits: Limits = Limits()) -> TextureLayout | None:
    """The texture layout of a tensor of ``shape`` whose consumers reduce along
    ``reduction_dims`` (logical dimension indices, most important first), or None when no
    layout fits (no dimension divisible by 4, or the image exceeds the limits).

    The first usable reduction dimension goes into the lanes, the next distinct one along x;
    without a second one, the packed dimension's blocks run along x. Without any, the innermost
    dimension divisible by 4 is packed (the producer's natural write order).
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        return None
    usable = [d for d in dict.fromkeys(reduction_dims) if 0 <= d < len(shape)]
    candidates = [d for d in usable if shape[d] % LANES == 0 and shape[d] >= LANES]
    if not candidates:
        candidates = [d for d in reversed(range(len(shape))) if shape[d] % LANES == 0
                      and shape[d] >= LANES][:1]
    if not candidates:
        return None
    packed = candidates[0]
    second = next((d for d in usable if d != packed and shape[d] > 1), None)
    x = (second,) if second is not None else (BLOCK,)
    rest = [BLOCK if d == packed else d for d in range(len(shape))]
    y = [a for a in rest if a not in x and (a == BLOCK or shape[a] > 1)]
    layout = TextureLayout(shape, packed, x, tuple(y))
    z: list = []
    while layout.height > limits.spatial and y:
        z.append(y.pop(0))
        layout = TextureLayout(shape, packed, x, tuple(y), tuple(z))
    if layout.width > limits.spatial or layout.height > limits.spatial or (
            layout.z and layout.depth > limits.depth):
        return None
    return layout
