"""Predicted time of one expert-parallel MoE layer per all-to-all schedule, and the choice
of schedule and chunk count for ``options={"moe": {"all_to_all": "auto", "chunks": "auto"}}``.

Setting: an EP group of P ranks, L of them per node (L = P inside one node or one
supernode); every rank dispatches m bytes (its T*K token rows of H elements) and gets m
bytes of results back; routing is taken as uniform, so 1/P of the rows stay on the rank,
(L-1)/P go to same-node peers over the inner link (alpha_i, B_i) and (P-L)/P to other nodes
over the outer link (alpha_o, B_o). ``compute`` is the rank's expert time.

    a2a(m)      = (L-1) alpha_i + (P-L) alpha_o + max((L-1)/P m / B_i, (P-L)/P m / B_o)
                  (pairwise exchange; intra- and inter-node traffic on their own links)
    flat        = a2a(m) + compute + a2a(m)                       (bulk-synchronous phases)
    chunked(C)  = d + (C-1) max(c, 2d) + c + d,  d = a2a(m / C), c = compute / C
                  (two-stage pipeline: the link carries dispatch i+1 and combine i-1 while
                  the experts run piece i; ScheMoE sec. 4, Tutel's overlap)
    hierarchical= h + compute + h,  h = (L-1) alpha_i + (L-1)/L m / B_i
                                        + (N-1) alpha_o + (N-1)/N m / B_o,  N = P / L
                  (2-D a2a: one aggregated message per node pair; ScheMoE's 2D-hierarchical
                  and Tutel's 2DH all-to-all)
    peer        = no barrier between phases: rows of the rank itself are computed at once,
                  same-node rows when the inner link delivers them, remote rows when the
                  outer link does; each block's results leave as soon as it is computed;
                  time = when the last results arrive (UBEP: barrier-free, distance-ordered
                  peer scheduling). Computed by :func:`_peer_time` as a list schedule.

The chunk count "auto" is the C in {1, 2, 4, 8, 16} that minimizes chunked(C).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphopt.cost.profiles import ClusterProfile, load_profile
from graphopt.errors import ConfigError

CHUNK_CHOICES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class MoELayerShape:
    """One MoE layer on one EP rank: ``tokens`` T (this rank's), ``top_k`` K, ``hidden`` H,
    ``ffn`` F (expert intermediate size), ``dtype_bytes`` of the rows (2 for bf16)."""

    tokens: int
    top_k: int
    hidden: int
    ffn: int
    dtype_bytes: int = 2
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("tokens", "top_k", "hidden", "ffn", "dtype_bytes"):
            value = getattr(self, name)  # (a symbolic size passes: it has no value yet)
            least = 0 if name == "tokens" else 1
            if isinstance(value, bool) or (isinstance(value, (int, float)) and value < least):
                raise ConfigError(f"MoELayerShape.{name} must be a number >= {least}, got "
                                  f"{value!r}")

    @property
    def dispatch_bytes(self) -> float:
        """Bytes one rank dispatches per direction: T * K rows of H elements."""
        return float(self.tokens * self.top_k * self.hidden * self.dtype_bytes)

    @property
    def expert_flops(self) -> float:
        """Forward FLOPs of the SwiGLU experts on T*K rows: 2 * rows * (H*2F + F*H)."""
        return 6.0 * self.tokens * self.top_k * self.hidden * self.ffn


def _a2a(m: float, p: int, lpn: int, cluster: ClusterProfile) -> float:
    if p <= 1:
        return 0.0
    inner, outer = cluster.levels[0].link, cluster.levels[-1].link
    lpn = min(lpn, p)
    latency = (lpn - 1) * inner.latency + (p - lpn) * outer.latency
    return latency + max((lpn - 1) / p * m / inner.bandwidth, (p - lpn) / p * m / outer.bandwidth)


def _hierarchical_a2a(m: float, p: int, lpn: int, cluster: ClusterProfile) -> float:
    nodes = p // lpn
    if nodes <= 1 or lpn <= 1:
        return _a2a(m, p, lpn, cluster)
    inner, outer = cluster.levels[0].link, cluster.levels[-1].link
    return ((lpn - 1) * inner.latency + (lpn - 1) / lpn * m / inner.bandwidth
            + (nodes - 1) * outer.latency + (nodes - 1) / nodes * m / outer.bandwidth)


def _peer_time(m: float, compute: float, p: int, lpn: int, cluster: ClusterProfile) -> float:
    inner, outer = cluster.levels[0].link, cluster.levels[-1].link
    lpn = min(lpn, p)
    blocks = [(0.0, 1 / p, 0.0)]  # (arrival, share of rows, time to return the results)
    if lpn > 1:
        t = inner.latency + (lpn - 1) / p * m / inner.bandwidth
        blocks.append((t, (lpn - 1) / p, t))
    if p > lpn:
        t = outer.latency + (p - lpn) / p * m / outer.bandwidth
        blocks.append((t, (p - lpn) / p, t))
    clock, done = 0.0, 0.0
    for arrival, share, back in sorted(blocks):
        clock = max(clock, arrival) + share * compute
        done = max(done, clock + back)
    return done


def _chunked(m: float, compute: float, p: int, lpn: int, cluster: ClusterProfile,
             chunks: int) -> float:
    d, c = _a2a(m / chunks, p, lpn, cluster), compute / chunks
    return d + (chunks - 1) * max(c, 2 * d) + c + d


def schedule_times(shape: MoELayerShape, ep: int, cluster: ClusterProfile | str,
                   ranks_per_node: int | None = None, backward: bool = False
                   ) -> dict[str, tuple[float, int]]:
    """Predicted seconds of the layer's forward, or forward + backward (a second round trip
    carrying the gradient rows, 2x the forward expert FLOPs), per schedule:
    {schedule: (seconds, chunks)}. ``ranks_per_node`` defaults to the cluster's node size.

    Raises:
        ConfigError: ep or ranks_per_node not an int >= 1, an EP group larger than the
            cluster, a ranks_per_node not dividing ep.
    """
    profile = load_profile(cluster) if isinstance(cluster, str) else cluster
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"ep must be an int >= 1 (ranks in the EP group), got {ep!r}")
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(
            ranks_per_node, int) or ranks_per_node < 1):
        raise ConfigError(f"ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
    if ep > profile.max_devices:
        raise ConfigError(f"ep={ep} exceeds cluster {profile.name!r} "
                          f"({profile.max_devices} devices)")
    lpn = ranks_per_node or min(ep, profile.devices_per(0))
    if ep % lpn:
        raise ConfigError(f"ranks_per_node ({lpn}) must divide the EP size ({ep})")
    device = profile.device
    forward = shape.expert_flops / (device.flops_for(shape.dtype) * device.matmul_efficiency)
    trips = [forward, 2 * forward] if backward else [forward]
    m = shape.dispatch_bytes
    chunked = {c: sum(_chunked(m, t, ep, lpn, profile, c) for t in trips)
               for c in CHUNK_CHOICES}
    best_c = min(chunked, key=lambda c: chunked[c])
    return {
        "flat": (sum(2 * _a2a(m, ep, lpn, profile) + t for t in trips), 1),
        "chunked": (chunked[best_c], best_c),
        "hierarchical": (sum(2 * _hierarchical_a2a(m, ep, lpn, profile) + t for t in trips), 1),
        "peer": (sum(_peer_time(m, t, ep, lpn, profile) for t in trips), 1),
    }


def a2a_latency(shape: MoELayerShape, ep: int, cluster: ClusterProfile | str,
                ranks_per_node: int | None = None) -> dict[str, float]:
    """Predicted communication time of one dispatch + combine (no compute) per schedule:
    flat and chunked pay two pairwise all-to-alls, hierarchical two 2-D ones, peer the time
    until the last results arrive when compute is free (barrier-free peer transfers)."""
    profile = load_profile(cluster) if isinstance(cluster, str) else cluster
    lpn = ranks_per_node or min(ep, profile.devices_per(0))
    m = shape.dispatch_bytes
    return {"flat": 2 * _a2a(m, ep, lpn, profile),
            "hierarchical": 2 * _hierarchical_a2a(m, ep, lpn, profile),
            "peer": _peer_time(m, 0.0, ep, lpn, profile)}


def choose_schedule(shape: MoELayerShape, ep: int, cluster: ClusterProfile | str,
                    ranks_per_node: int | None = None) -> tuple[str, int, dict[str, float]]:
    """(schedule, chunks, predicted forward+backward seconds per schedule) minimizing the
    predicted time; ties go to the simpler schedule (flat < chunked < hierarchical < peer)."""
    times = schedule_times(shape, ep, cluster, ranks_per_node, backward=True)
    best = min(times, key=lambda s: (times[s][0], list(times).index(s)))
    return best, times[best][1], {s: t for s, (t, _) in times.items()}
