"""Collective communication costs (alpha-beta model) with algorithm choice and topology.

A group of ``n`` ranks moving a message of ``m`` bytes per rank over links of latency
``alpha`` (s) and per-rank bandwidth ``beta_inv`` = bandwidth (bytes/s):

====================  =====================================  ==========================
collective            ring / direct                          tree / recursive
====================  =====================================  ==========================
all-reduce            2(n-1) alpha + 2 (n-1)/n m / B           2 log2(n) alpha + 2 m / B
all-gather            (n-1) alpha + (n-1)/n m_out / B          log2(n) alpha + (n-1)/n m_out / B
reduce-scatter        (n-1) alpha + (n-1)/n m_in / B           log2(n) alpha + (n-1)/n m_in / B
all-to-all            (n-1) alpha + (n-1)/n m / B  (pairwise)
broadcast             log2(n) alpha + m / B (pipelined tree)
point-to-point        alpha + m / B
====================  =====================================  ==========================

Sources: Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005), sec. 4; NCCL's bus-bandwidth convention (nccl-tests
doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n for all-gather /
reduce-scatter / all-to-all). ``m`` is the per-rank buffer: for all-gather the gathered output,
for reduce-scatter the input.

Hierarchical (2-D) versions for a group spanning several levels of the cluster (ScheMoE's
2-D all-to-all; NCCL's tree/hierarchical all-reduce): reduce-scatter inside the node, the
collective across nodes on 1/n_inner of the data, all-gather inside the node; for all-to-all:
an intra-node exchange that groups tokens by destination node, then an inter-node exchange of
the aggregated messages (fewer, larger messages: (N-1) alpha_inter instead of (n-1)).

All functions return seconds and raise ConfigError for a group larger than the cluster.
"""

from __future__ import annotations

import math

from graphopt.cost.profiles import ClusterProfile, LinkProfile
from graphopt.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "p2p")
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")


def flat_time(kind: str, n: int, nbytes: float, link: LinkProfile,
              algorithm: str = "ring") -> float:
    """Seconds for one collective of ``n`` ranks over one link class (see the table above)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    a, bw = link.latency, link.bandwidth
    frac = (n - 1) / n
    steps = math.ceil(math.log2(n))
    if kind == "all_reduce":
        if algorithm == "tree":
            return 2 * steps * a + 2 * nbytes / bw
        return 2 * (n - 1) * a + 2 * frac * nbytes / bw
    if kind in ("all_gather", "reduce_scatter"):
        lat = steps * a if algorithm == "tree" else (n - 1) * a
        return lat + frac * nbytes / bw
    if kind == "all_to_all":
        return (n - 1) * a + frac * nbytes / bw
    if kind == "broadcast":
        return steps * a + nbytes / bw
    if kind == "p2p":
        return a + nbytes / bw
    raise ConfigError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVES)}")


def collective_time(kind: str, nbytes: float, group_size: int, cluster: ClusterProfile,
                    algorithm: str = "auto", stride: int = 1) -> float:
    """Seconds for a collective over ``group_size`` ranks placed ``stride`` devices apart
    (stride 1: consecutive devices, as TP groups; stride 8: one rank per node, as DP groups
    of an 8-way TP job). ``algorithm``: ring | tree | hierarchical | auto (the fastest).

    Raises:
        ConfigError: unknown kind/algorithm, or the group spans more devices than the cluster.
    """
    if kind not in COLLECTIVES:
        raise ConfigError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVES)}")
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    for name, value in (("group_size", group_size), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ConfigError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    if group_size == 1:
        return 0.0
    span = group_size * stride
    if span > cluster.max_devices:
        raise ConfigError(f"a group of {group_size} ranks with stride {stride} spans {span} "
                          f"devices but cluster {cluster.name!r} has {cluster.max_devices}")
    outer = cluster.level_of(span)
    link = cluster.levels[outer].link
    # ranks of the group that share the innermost unit (e.g. a node); a group that does
    # not fill whole units (12 ranks of 8-device nodes) is split into equal parts that do
    # fit one (3 of 4): group_size // 8 nodes priced the second node's traffic as free (a
    # review: 12 ranks cost what 8 did, 16 ranks 1.6x-6x more)
    per_unit = max(1, min(group_size, cluster.devices_per(0) // max(stride, 1)))
    inner_size = math.gcd(group_size, per_unit)
    options = {}
    for algo in ("ring", "tree"):
        options[algo] = flat_time(kind, group_size, nbytes, link, algo)
    if outer > 0 and 1 < inner_size < group_size and kind in ("all_reduce", "all_to_all",
                                                              "all_gather", "reduce_scatter"):
        options["hierarchical"] = hierarchical_time(kind, nbytes, inner_size,
                                                    group_size // inner_size,
                                                    cluster.levels[0].link, link)
    if algorithm == "auto":
        return min(options.values())
    if algorithm not in options:
        return options["ring"]  # hierarchical on a single level is the flat ring
    return options[algorithm]


def hierarchical_time(kind: str, nbytes: float, inner: int, outer: int, inner_link: LinkProfile,
                      outer_link: LinkProfile) -> float:
    """2-D collective: ``inner`` ranks per node on ``inner_link``, ``outer`` nodes on
    ``outer_link`` (see the module docstring)."""
    if kind == "all_reduce":
        return (flat_time("reduce_scatter", inner, nbytes, inner_link)
                + flat_time("all_reduce", outer, nbytes / inner, outer_link)
                + flat_time("all_gather", inner, nbytes, inner_link))
    if kind in ("all_gather", "reduce_scatter"):
        return (flat_time(kind, outer, nbytes / inner, outer_link)
                + flat_time(kind, inner, nbytes, inner_link))
    if kind == "all_to_all":
        # phase 1: inside the node, gather what goes to each remote node (all of m but 1/n
        # of it stays); phase 2: one aggregated message per remote node.
        intra = flat_time("all_to_all", inner, nbytes, inner_link)
        inter = (outer - 1) * outer_link.latency + (outer - 1) / outer * nbytes / \
            outer_link.bandwidth
        return intra + inter
    raise ConfigError(f"no hierarchical form for {kind!r}")
