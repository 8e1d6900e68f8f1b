"""Expert-parallel "round trips": send every row to the rank that owns its expert, compute
there, send the result rows back; four schedules.

Vocabulary (P ranks in the EP group, rank r, E experts, El = E / P local experts; expert e
lives on rank e // El):
    counts [P, E] (int64, known to every rank): counts[s, e] = rows rank s sends to expert e.
    send rows [N_r, W]: rank r's rows sorted by expert (so the rows for one destination are
        contiguous and, inside, sorted by local expert).
    compute(key, rows [n, W], per_expert [El]) -> [n, W']: the owner's work on rows grouped by
        local expert (``per_expert`` rows each); ``key`` names the piece (chunk or source) so a
        backward round trip can find what its forward saved under the same key.
    result [N_r, W']: row i is compute's output for send row i.

Schedules (all exact: same rows, same per-row computation, only the order of transfers and
of compute differs):
    flat          one all-to-all each way (uneven splits; Megatron-Core's "alltoall"
                  dispatcher, DeepSpeed-MoE).
    chunked       every (source, destination) block is cut into C pieces; the all-to-alls of
                  all pieces are issued asynchronously up front and the owner computes piece
                  i while pieces i+1.. are in flight, then returns piece i asynchronously
                  (ScheMoE, Shi et al. EuroSys'24, sec. 4: pipelining a2a with expert
                  compute; Tutel's chunked overlap).
    hierarchical  2-D all-to-all over (node, local) ranks: an intra-node all-to-all that
                  collects, on local rank l', every row of the node bound for local index l'
                  on any node, then an inter-node all-to-all among ranks with the same local
                  index (ScheMoE's 2D-hierarchical a2a; Tutel's 2DH): one inter-node message
                  per node pair instead of L*L smaller ones.
    peer          per-peer point-to-point transfers, posted at once and consumed in order of
                  topology distance (own rows first, then same-node peers, then remote ones,
                  each ring-shifted so ranks do not all start on the same peer); the owner
                  computes a peer's rows as soon as they arrive and returns them at once,
                  without a barrier between the dispatch and combine phases (UBEP's
                  barrier-free, distance-ordered peer scheduling).

Errors: ValueError for an unknown schedule, chunks or ranks_per_node < 1, a group size that
``ranks_per_node`` does not divide, or counts whose shape does not match the group.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist
from torch import Tensor

Compute = Callable[[Hashable, Tensor, Tensor], Tensor]
SCHEDULES = ("flat", "chunked", "hierarchical", "peer")


def round_trip_keys(schedule: str, chunks: int, size: int) -> list[int]:
    """The keys a :class:`RoundTrip` over ``size`` ranks passes to ``compute``, in order: one
    piece (0) for flat and hierarchical, chunk indices 0..C-1 for chunked, source ranks
    0..P-1 for peer. Every key is computed on every call (empty pieces included), so the
    owner's saved state can be stored as one row block per key.

    Raises:
        ValueError: an unknown schedule, chunks < 1.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown all-to-all schedule {schedule!r}; valid: {SCHEDULES}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if size == 1 or schedule in ("flat", "hierarchical"):
        return [0]
    return list(range(chunks)) if schedule == "chunked" else list(range(size))


def block_transpose(sizes: Tensor) -> Tensor:
    """Index that reorders rows laid out as blocks [a][b] (block (i, j) has sizes[i, j] rows,
    row-major) into the layout [b][a]. sizes [A, B] int64 -> index [sizes.sum()] (int64)."""
    a, b = sizes.shape
    starts = (torch.cumsum(sizes.reshape(-1), 0) - sizes.reshape(-1)).view(a, b)
    pieces = [torch.arange(int(starts[i, j]), int(starts[i, j] + sizes[i, j]))
              for j in range(b) for i in range(a)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _run_grouped(compute: Compute, key: Hashable, rows: Tensor, per_src_expert: Tensor) -> Tensor:
    """compute on rows laid out [source][local expert]: regroup expert-major, compute, undo."""
    if per_src_expert.shape[0] == 1:
        return compute(key, rows, per_src_expert[0])
    index = block_transpose(per_src_expert)
    out = compute(key, rows[index], per_src_expert.sum(0))
    result = out.new_empty(out.shape)
    result[index] = out
    return result


class RoundTrip:
    """One EP group's round trip for a given ``counts`` matrix (see the module docstring)."""

    def __init__(self, counts: Tensor, group: dist.ProcessGroup | None, schedule: str,
                 chunks: int = 1, ranks_per_node: int = 1) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown all-to-all schedule {schedule!r}; valid: {SCHEDULES}")
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if counts.dim() != 2 or counts.shape[0] != self.size or counts.shape[1] % self.size:
            raise ValueError(f"counts must be [P={self.size}, E] with E divisible by P, got "
                             f"{tuple(counts.shape)}")
        round_trip_keys(schedule, chunks, self.size)  # checks schedule and chunks
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or \
                ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
        if self.size % ranks_per_node:
            raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the EP group size "
                             f"({self.size})")
        self.schedule = schedule
        self.chunks = chunks
        self.ranks_per_node = ranks_per_node
        self.local = counts.shape[1] // self.size
        self.counts = counts.view(self.size, self.size, self.local)  # [src, dst, local expert]
        self.pair = self.counts.sum(-1)  # rows src -> dst
        self.tag = 0

    def __call__(self, rows: Tensor, compute: Compute, tag: int = 0) -> Tensor:
        """rows [N_r, W] sorted by expert -> [N_r, W'] (compute's output for each row)."""
        self.tag = tag
        if self.size == 1:
            return compute(0, rows, self.counts[0, 0])
        run = {"flat": self._flat, "chunked": self._chunked, "hierarchical": self._hierarchical,
               "peer": self._peer}[self.schedule]
        return run(rows, compute)

    def _a2a(self, x: Tensor, out_splits: list[int], in_splits: list[int],
             async_op: bool = False, group: dist.ProcessGroup | None = None
             ) -> tuple[Tensor, dist.Work | None]:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits,
                                      group=group or self.group, async_op=async_op)
        return out, work

    def _flat(self, rows: Tensor, compute: Compute) -> Tensor:
        r = self.rank
        received, _ = self._a2a(rows, self.pair[:, r].tolist(), self.pair[r].tolist())
        out = _run_grouped(compute, 0, received, self.counts[:, r])
        back, _ = self._a2a(out, self.pair[r].tolist(), self.pair[:, r].tolist())
        return back

    def _pieces(self) -> Tensor:
        """[C, src, dst, local] rows of each piece: every (src, dst) block cut into C nearly
        equal row ranges, split across local experts by the block's expert-sorted layout."""
        c = self.chunks
        total = self.pair  # [src, dst]
        bounds = torch.stack([total * i // c for i in range(c + 1)])  # [C+1, src, dst]
        ends = torch.cumsum(self.counts, -1)  # [src, dst, local]
        starts = ends - self.counts
        lo = bounds[:-1].unsqueeze(-1)
        hi = bounds[1:].unsqueeze(-1)
        return (torch.minimum(ends, hi) - torch.maximum(starts, lo)).clamp(min=0)

    def _chunked(self, rows: Tensor, compute: Compute) -> Tensor:
        r = self.rank
        pieces = self._pieces()  # [C, src, dst, local]
        sent = pieces[:, r].sum(-1)  # [C, dst]
        # send rows are [dst][piece]; reorder to [piece][dst] so each piece is one a2a
        order = block_transpose(sent.t().contiguous())
        send = rows[order]
        send_off = torch.cumsum(sent.sum(1), 0) - sent.sum(1)
        dispatch = []
        for i in range(self.chunks):
            part = send[int(send_off[i]): int(send_off[i] + sent[i].sum())]
            dispatch.append(self._a2a(part, pieces[i, :, r].sum(-1).tolist(), sent[i].tolist(),
                                      async_op=True))
        combine = []
        for i, (received, work) in enumerate(dispatch):
            assert work is not None
            work.wait()
            out = _run_grouped(compute, i, received, pieces[i, :, r])
            combine.append(self._a2a(out, sent[i].tolist(), pieces[i, :, r].sum(-1).tolist(),
                                     async_op=True))
        outs = []
        for back, work in combine:
            assert work is not None
            work.wait()
            outs.append(back)
        gathered = torch.cat(outs)
        result = gathered.new_empty(gathered.shape)
        result[order] = gathered
        return result

    def _hierarchical(self, rows: Tensor, compute: Compute) -> Tensor:
        nodes, lpn = self.size // self.ranks_per_node, self.ranks_per_node
        if nodes == 1 or lpn == 1:
            return self._flat(rows, compute)
        intra, inter = _node_groups(self.group, nodes, lpn)
        r = self.rank
        node, local = divmod(r, lpn)
        pair = self.pair.view(nodes, lpn, nodes, lpn)  # [src node, src l, dst node, dst l]
        # phase 1: to local peer l', the rows bound for (m, l') for every node m, m-major
        mine = pair[node, local]  # [m, l']
        order1 = block_transpose(mine)  # rows are [m][l'] -> [l'][m]
        in1 = mine.sum(0).tolist()
        got1 = pair[node, :, :, local]  # from each l: [l][m] blocks
        recv1, _ = self._a2a(rows[order1], got1.sum(1).tolist(), in1, group=intra)
        # phase 2: regroup [l][m] -> [m][l], one message per destination node
        order2 = block_transpose(got1)
        recv2, _ = self._a2a(recv1[order2], pair[:, :, node, local].sum(1).tolist(),
                             got1.sum(0).tolist(), group=inter)
        out = _run_grouped(compute, 0, recv2, self.counts[:, r])  # source-rank order
        back2, _ = self._a2a(out, got1.sum(0).tolist(), pair[:, :, node, local].sum(1).tolist(),
                             group=inter)
        undo2 = back2.new_empty(back2.shape)
        undo2[order2] = back2
        back1, _ = self._a2a(undo2, in1, got1.sum(1).tolist(), group=intra)
        result = back1.new_empty(back1.shape)
        result[order1] = back1
        return result

    def _peer_order(self) -> list[int]:
        """Peers by topology distance: own rank, same-node peers, then remote ones; each
        class ring-shifted from this rank so peers are not all contacted in the same order."""
        r, p, lpn = self.rank, self.size, self.ranks_per_node
        ring = [(r + i) % p for i in range(p)]
        return sorted(ring, key=lambda s: (s != r, s // lpn != r // lpn))

    def _peer(self, rows: Tensor, compute: Compute) -> Tensor:
        """compute must keep the row width and dtype (true for the expert forward and
        backward): every receive, including the results', is posted before any compute."""
        r = self.rank
        offsets = (torch.cumsum(self.pair[r], 0) - self.pair[r]).tolist()
        sizes = self.pair[r].tolist()
        to = [rows[offsets[d]: offsets[d] + sizes[d]] for d in range(self.size)]
        order = self._peer_order()
        peers = order[1:]
        glob = [dist.get_global_rank(self.group, s) for s in range(self.size)] \
            if self.group is not None else list(range(self.size))
        width = rows.shape[1:]
        recv = {s: rows.new_empty((int(self.pair[s, r]), *width)) for s in peers}
        back = {d: rows.new_empty((sizes[d], *width)) for d in peers}
        arrived = {s: self._p2p(dist.irecv, recv[s], glob[s], 0) for s in peers}
        returned = [self._p2p(dist.irecv, back[d], glob[d], 1) for d in peers]
        sends = [self._p2p(dist.isend, to[d].contiguous(), glob[d], 0) for d in peers]
        results = {r: compute(r, to[r], self.counts[r, r])}
        for s in peers:
            arrived[s].wait()
            out = compute(s, recv[s], self.counts[s, r]).contiguous()
            sends.append(self._p2p(dist.isend, out, glob[s], 1))
        for w in returned + sends:
            w.wait()
        results.update(back)
        return torch.cat([results[d] for d in range(self.size)])

    def _p2p(self, op: Callable[..., dist.Work | None], tensor: Tensor, peer: int,
             phase: int) -> dist.Work:
        work = op(tensor, peer, self.group, self.tag + phase)
        assert work is not None
        return work


def _node_groups(group: dist.ProcessGroup | None, nodes: int,
                 lpn: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(intra-node group, inter-node group) of this rank for a (nodes x lpn) layout of the EP
    group: the ``ep_local`` and ``ep_node`` axes of graphopt's EP DeviceMesh
    (:func:`graphopt.parallel.mesh.ep_mesh`), whose EP groups are consecutive ranks."""
    from graphopt.parallel.mesh import ep_mesh

    assert group is not None
    mesh = ep_mesh(nodes * lpn, lpn)
    if dist.get_process_group_ranks(mesh["ep"].get_group()) != \
            dist.get_process_group_ranks(group):
        raise ValueError("the hierarchical/peer schedules need EP groups of consecutive ranks "
                         "(graphopt's EP mesh); got ranks "
                         f"{dist.get_process_group_ranks(group)}")
    return mesh["ep_local"].get_group(), mesh["ep_node"].get_group()
