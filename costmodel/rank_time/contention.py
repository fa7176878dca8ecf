"""What communication costs a rank per second of it when part of it runs beside compute: the
exposed share whole, and the hidden rest at the device's `comm_contention` (NCCL's kernels take
SMs and memory bandwidth from the compute they overlap: profiles' [ranges] give its published
range). DP's hidden collectives (costmodel.rank_time.dp_terms prices them as contention terms),
TP's under an overlapping framework (parts), Megatron-Core's expert all-to-alls (ep_overlap) and
its interleaved pipeline's gradient sends (layer_comm) all cost this way."""
from __future__ import annotations


def partly_hidden_cost(exposed: float, contention: float) -> float:
    """Seconds a rank pays per second of communication of which `exposed` (a share, 0 to 1) waits
    for nothing to hide behind and the rest hides at `contention` a second."""
    return exposed + contention * (1.0 - exposed)
