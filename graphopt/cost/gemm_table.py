"""Measured GEMM throughput by shape, for pricing tensor-parallel shards at their own size.

One efficiency per device prices a GEMM whose N or K tensor parallelism cut 8-fold at the
efficiency of the whole GEMM; on an H100 a bf16 GEMM with 16k rows reaches 808 TFLOP/s at
N = K = 4096 but 622 at N = 256, K = 4096 and 206 at N = K = 256 (below). This module
interpolates such a table so the planner prices each GEMM of a layer at its per-rank shape.

Data: OpenXLA's default matmul performance table for sm_90 (H100), measured by the XLA team
and shipped for its GPU cost model: ``xla/service/gpu/model/matmul_interpolator_data.h``
(tensorflow/tensorflow commit 372d578b, ``third_party/xla/...``; Apache 2.0), the
``bf16xbf16->bf16`` FLOP/s of its entries with m = 4096 rows and batch b = 1, 2, 4 (read
here as 4096, 8192 and 16,384 rows: a batched GEMM has b times the tiles of one), N and K
256 .. 4096. Values below are TFLOP/s rounded to 0.01; ``GEMM_TABLES["sm90-bf16"]``.

Lookup (:func:`relative_rate`): the GEMM's largest dimension is the row count (clamped to
4096 .. 16,384), the other two are N and K, averaged over both orders (the table is not
symmetric in N and K by up to ~15%, and a weight gradient's two output dimensions are
neither); piecewise-linear in log2 of each dimension, extrapolated below 256 with the first
segment's slope (the TFLOP/s keep falling with the size) and clamped above 4096 (flat there
within ~5%). Dimensions are clamped to >= 16. Pure Python; ~2 us a lookup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SIZES = (256, 512, 1024, 2048, 4096)
"""The table's N and K values (and their order in each row / column)."""

GEMM_TABLES: dict[str, dict[int, tuple[tuple[float, ...], ...]]] = {
    "sm90-bf16": {
        # rows: N = 256 .. 4096; columns: K = 256 .. 4096; TFLOP/s at 4096 x b rows
        4096: ((82.24, 137.24, 217.18, 304.69, 376.22),
               (142.48, 238.82, 370.77, 521.74, 649.96),
               (216.48, 343.71, 488.06, 631.98, 738.47),
               (304.00, 447.02, 593.23, 716.07, 758.43),
               (392.16, 543.12, 677.44, 738.74, 783.33)),
        8192: ((135.03, 234.65, 366.21, 508.40, 584.19),
               (211.03, 340.65, 487.18, 622.82, 729.69),
               (301.61, 445.54, 598.18, 713.45, 750.61),
               (394.47, 546.43, 680.88, 733.30, 783.19),
               (464.02, 607.67, 692.97, 763.01, 807.67)),
        16384: ((206.49, 335.13, 477.64, 588.67, 622.46),
                (298.59, 441.51, 589.00, 703.63, 728.59),
                (393.31, 542.04, 673.84, 720.52, 777.59),
                (458.47, 607.49, 687.86, 759.30, 808.70),
                (503.87, 619.86, 725.51, 764.58, 793.13)),
    },
}


def _axis(x: float) -> tuple[int, float]:
    """(segment index, fraction) of ``x`` on SIZES in log2; below the first size the first
    segment extrapolates (fraction < 0), above the last it clamps."""
    pos = math.log2(max(x, 16.0) / SIZES[0])
    if pos >= len(SIZES) - 1:
        return len(SIZES) - 2, 1.0
    if pos < 0:
        return 0, pos
    i = int(pos)
    return i, pos - i


def _grid(rows: Sequence[Sequence[float]], n: float, k: float) -> float:
    """Bilinear in (log2 N, log2 K) on one table slice; the result is kept positive."""
    i, fi = _axis(n)
    j, fj = _axis(k)
    lo = rows[i][j] + fj * (rows[i][j + 1] - rows[i][j])
    hi = rows[i + 1][j] + fj * (rows[i + 1][j + 1] - rows[i + 1][j])
    return max(lo + fi * (hi - lo), 1e-3)


def rate(table: str, m: float, n: float, k: float) -> float:
    """Interpolated TFLOP/s of an (m x k) @ (k x n) GEMM in ``table`` (see the module
    docstring for how the dimensions are read).

    Raises:
        KeyError: an unknown table name (profiles validate theirs when they are built).
    """
    slices = GEMM_TABLES[table]
    dims = sorted((float(m), float(n), float(k)))
    rows, a, c = dims[2], dims[0], dims[1]
    keys = sorted(slices)

    def sym(key: int) -> float:
        grid = slices[key]
        return (_grid(grid, a, c) + _grid(grid, c, a)) / 2

    r = min(max(rows, keys[0]), keys[-1])
    for lo, hi in zip(keys, keys[1:]):
        if r <= hi:
            f = math.log2(r / lo) / math.log2(hi / lo)
            return sym(lo) + f * (sym(hi) - sym(lo))
    return sym(keys[-1])


def peak_rate(table: str) -> float:
    """The table's highest TFLOP/s (the shape :func:`relative_rate` calls 1.0).

    Raises:
        KeyError: an unknown table name.
    """
    return max(v for grid in GEMM_TABLES[table].values() for row in grid for v in row)


def relative_rate(table: str, m: float, n: float, k: float) -> float:
    """:func:`rate` over :func:`peak_rate`: the GEMM's efficiency relative to the best shape
    measured (in (0, 1]). A profile's ``matmul_efficiency`` is the efficiency of that best
    shape; a GEMM of this shape reaches ``matmul_efficiency * relative_rate``. ``m``,
    ``n``, ``k``: the GEMM's dimensions (elements, any order; see the module docstring).

    Raises:
        KeyError: an unknown table name.
    """
    return min(rate(table, m, n, k) / peak_rate(table), 1.0)
