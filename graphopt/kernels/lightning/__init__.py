"""Lightning Attention kernels: quadratic reference, chunked PyTorch forward/backward with
selective state rematerialization, recurrent decode step, and the ``graphopt::`` custom op."""

from graphopt.kernels.lightning.op import lightning_attention
from graphopt.kernels.lightning.reference import (
    lightning_attention_reference,
    lightning_attention_step,
)

__all__ = ["lightning_attention", "lightning_attention_reference", "lightning_attention_step"]
