"""Executing parallel plans: one DeviceMesh, torch.distributed's engines, derived TP layout.

    mesh = graphopt.parallel.build_mesh(plan)          # under torchrun
    model = graphopt.parallelize(model, plan, mesh)     # TP/SP, FSDP/HSDP (ZeRO), DDP
    opt = graphopt.parallel.build_optimizer(model, plan, mesh, torch.optim.AdamW, lr=...)

See docs/parallel.md.
"""

from graphopt.parallel.apply import ParallelReport, build_optimizer, parallelize
from graphopt.parallel.mesh import build_mesh
from graphopt.parallel.tp_layout import TPLayout, derive_tp_layout

__all__ = ["ParallelReport", "TPLayout", "build_mesh", "build_optimizer", "derive_tp_layout",
           "parallelize"]
