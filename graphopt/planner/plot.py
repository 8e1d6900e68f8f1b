"""A picture of a planner search: per plan, the step time split into compute, pipeline bubble
and exposed TP/CP/EP/PP/DP communication (stacked bars), and the memory per device next to
the usable capacity, for the top plans and the hand/published configurations (matplotlib,
Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphopt.planner.perf import USABLE_MEMORY

PARTS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp")


def plot_plans(result: Any, path: str | Path, title: str = "") -> Path:
    """Write the figure of ``result`` (a :class:`graphopt.planner.search.SearchResult`).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'graphopt[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("graphopt plan --plot needs matplotlib: pip install "
                          "'graphopt[plot]'") from exc
    rows = [(f"#{i} {p.describe()}", p) for i, p in enumerate(result.top, 1)]
    rows += [(f"{name}: {p.describe()}", p) for name, p, _ in result.hand]
    labels = [_wrap(label) for label, _ in rows]
    preds = [p.prediction for _, p in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(16, 1.0 + 0.7 * len(rows)),
                                     gridspec_kw={"width_ratios": [3, 1]}, sharey=True)
    left = [0.0] * len(rows)
    for part in PARTS:
        values = [(pr.compute_s if part == "compute" else pr.bubble_s if part == "bubble"
                   else pr.comm_s.get(part, 0.0)) for pr in preds]
        ax_t.barh(range(len(rows)), values, left=left, label=part)
        left = [a + b for a, b in zip(left, values)]
    ax_t.set_yticks(range(len(rows)), labels, fontsize=7)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("step time (s): compute, bubble, exposed communication")
    ax_t.legend(ncol=len(PARTS), fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    memory = [pr.memory_bytes / 2**30 for pr in preds]
    capacity = USABLE_MEMORY * _device_memory(result) / 2**30
    over = [i for i, m in enumerate(memory) if capacity and m > capacity]
    for i in over:  # a review: an OOM hand config's short bar read as the fastest plan
        ax_t.text(left[i], i, "  out of memory: does not run", va="center", color="red",
                  fontsize=7)
    ax_m.barh(range(len(rows)), memory,
              color=["red" if i in over else "gray" for i in range(len(rows))])
    if capacity:
        ax_m.axvline(capacity, color="red", linestyle="--", label="usable")
        ax_m.legend(loc="lower right", fontsize=7)
    ax_m.set_xlabel("memory per device (GiB)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120, bbox_inches="tight")  # long labels are not cut off
    plt.close(fig)
    return out


def _device_memory(result: Any) -> float:
    return float(getattr(result, "device_memory_bytes", 0.0) or 0.0)


def _wrap(label: str, width: int = 70) -> str:
    return label if len(label) <= width else label[:width - 3] + "..."
