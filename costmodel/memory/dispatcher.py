"""What the per-node expert dispatcher holds outside torch's allocator: DeepEP's communication
buffers, which Megatron-Core's flex dispatcher allocates once for the expert group
(megatron/core/transformer/moe/fused_a2a.py get_buffer: the larger of DeepEP's size hints for its
dispatch and combine configurations, hidden_bytes = hidden x the larger of a value's bytes and 2).

DeepEP's legacy Buffer (deep_ep/buffers/legacy.py, csrc/legacy/config.hpp and buffer.hpp, at
dd758ca) sizes them from its recommended configuration for the group's size, on Megatron-Core's
20 SMs (10 channels; moe_flex_dispatcher_num_sms unset):
- an NVLink buffer (cudaMalloc, shared over IPC) for every group: per channel and NVLink peer
  (up to 8), `nvl_recv_tokens` rows of the hidden vector, an 8-byte source record, 128 top-k
  indices (int64), 128 weights and 128 scales (float32);
- across nodes (a group of more than 8 ranks, DeepEP's internode kernels), an RDMA buffer from
  NVSHMEM's symmetric heap: per channel and node, `rdma_recv_tokens` of the same rows, send and
  receive halves; the heap grows in NVSHMEM_CUMEM_GRANULARITY steps, which DeepEP sets to 512 MiB
  ("NVSHMEM initialization requires at least 256 MiB");
- a 32 MiB workspace.
DeepSeek-V3's EP 64 (hidden 7168): 0.35 GiB over NVLink, 0.31 GiB for RDMA taking 0.5 GiB of heap,
0.88 GiB in all. DeepEP has configurations for groups of 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144
and 160 ranks, and refuses others ('Unsupported number of EP ranks')."""
from __future__ import annotations

from math import ceil

from costmodel.frameworks import FrameworkTraits
from costmodel.moe_dispatch import traits_need_per_node_dispatcher
from costmodel.placement import AxisSpan
from costmodel.specs import ModelSpec, TrainSpec

# group size -> (NVLink receive rows, RDMA receive rows): the larger of DeepEP's dispatch and
# combine configurations (Buffer.get_dispatch_config / get_combine_config), the RDMA rows aligned
# up to their send chunk as Config's constructor does
DEEPEP_RECV_ROWS: dict[int, tuple[int, int]] = {
    2: (256, 132), 4: (256, 132), 8: (256, 132), 16: (288, 140), 24: (288, 128), 32: (288, 128),
    48: (288, 128), 64: (288, 128), 96: (480, 132), 128: (560, 132), 144: (720, 132), 160: (720, 132)}
DEEPEP_CHANNELS = 10                 # Megatron-Core's 20 SMs, two a channel
DEEPEP_NVL_PEERS = 8                 # LEGACY_NUM_MAX_NVL_PEERS
DEEPEP_WORKSPACE_BYTES = 32 * 2**20  # LEGACY_NUM_WORKSPACE_BYTES
NVSHMEM_GRANULARITY_BYTES = 2**29    # NVSHMEM_CUMEM_GRANULARITY as DeepEP sets it
_TOPK, _SCALES, _SOURCE_META, _INT4 = 128, 128, 8, 16   # kNumMaxTopK, kNumMaxScales, sizeof(SourceMeta)
_ALIGNMENT = 128                     # LEGACY_NUM_BUFFER_ALIGNMENT_BYTES


def uses_per_node_dispatcher(model: ModelSpec, traits: FrameworkTraits, group_size: int,
                             devices_per_node: int) -> bool:
    """Whether the framework runs the expert group of `group_size` ranks (ep x etp) with DeepEP
    (moe_dispatch.needs_per_node_dispatcher, for the group packed into as few nodes as it takes:
    what the reserve depends on, the same for every mesh order the search lays out)."""
    if group_size == 1:
        return False
    per_node = min(group_size, devices_per_node)
    span = AxisSpan(size=group_size, members_per_node=per_node, num_nodes=ceil(group_size / per_node))
    return traits_need_per_node_dispatcher(model, traits, span)


def deepep_buffer_bytes(hidden_size: int, group_size: int, value_bytes: int = 2) -> float:
    """DeepEP's buffers for an expert group of `group_size` ranks dispatching values of
    `value_bytes` (Megatron-Core's hidden_bytes: hidden x the larger of that and 2; the module's
    docstring); a size DeepEP has no configuration for is refused before it is priced
    (check_degrees.dispatcher_problems)."""
    nvl_rows, rdma_rows = DEEPEP_RECV_ROWS[group_size]
    hidden_bytes = max(value_bytes, 2) * hidden_size
    nvl_ranks = min(group_size, DEEPEP_NVL_PEERS)
    rdma_ranks = max(group_size // DEEPEP_NVL_PEERS, 1)
    row = hidden_bytes + _SOURCE_META + _TOPK * 8 + _TOPK * 4 + _SCALES * 4
    nvl = _aligned(DEEPEP_CHANNELS * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + nvl_rows * row))
    if group_size <= DEEPEP_NVL_PEERS:
        return nvl + DEEPEP_WORKSPACE_BYTES
    rdma = _aligned(DEEPEP_CHANNELS * rdma_ranks * ((2 * DEEPEP_NVL_PEERS + 2) * 2 * 4
                                                   + rdma_rows * 2 * (row + _INT4)))
    heap = ceil(rdma / NVSHMEM_GRANULARITY_BYTES) * NVSHMEM_GRANULARITY_BYTES
    return nvl + DEEPEP_WORKSPACE_BYTES + heap


def _aligned(num_bytes: int) -> int:
    """A size hint rounded up to DeepEP's 128-byte buffer alignment."""
    return ceil(num_bytes / _ALIGNMENT) * _ALIGNMENT


def dispatcher_buffer_bytes(model: ModelSpec, train: TrainSpec, traits: FrameworkTraits, ep: int, etp: int,
                            devices_per_node: int) -> float:
    """What the plan's expert dispatcher holds outside torch's allocator: DeepEP's buffers where
    the framework runs the group with it, nothing for an all-to-all over NCCL (whose buffers are
    the device's reserve)."""
    group = ep * etp
    if not uses_per_node_dispatcher(model, traits, group, devices_per_node):
        return 0.0
    return deepep_buffer_bytes(model.hidden_size, group, train.compute_dtype.num_bytes)
