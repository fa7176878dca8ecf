"""Float8 linears under tensor parallelism gather float8: each sequence-parallel all-gather (the
input forward, the output gradient backward) moves a byte an element where the framework's
float8 TP casts before it gathers (torchao's float8 TP styles in torchtitan, Transformer
Engine in Megatron-Core), while the reduce-scatters keep the compute dtype
(costmodel.rank_time.layer_comm._float8_gathers)."""
from dataclasses import replace

import pytest

from costmodel.comm import Collective, collective_time_s
from costmodel.frameworks import RUNTIME, framework_traits
from costmodel.hardware import parse_cluster
from costmodel.layout import dense_blocks
from costmodel.rank_time import spans
from costmodel.rank_time.layer_comm import _tp_layer_comm_s
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

LLAMA = resolve_model("llama3-8b")
TRAIN = TrainSpec(seq_len=8192, global_batch_size=8, float8=True)


def _layer_comm(framework, **choice) -> tuple[float, float, float]:
    """A layer's TP collectives one way, and one all-gather and one reduce-scatter of the
    micro-batch's hidden states in the compute dtype, over the plan's TP group."""
    cluster = replace(parse_cluster("1x8xH100"), framework=framework)
    plan = build_plan(LLAMA, TRAIN, cluster, Choice(tp=8, sequence_parallel=True, **choice))
    span = spans(plan, cluster).tp
    hidden_bytes = TRAIN.compute_dtype.num_bytes * plan.micro_batch_size * TRAIN.seq_len * LLAMA.hidden_size
    return (_tp_layer_comm_s(LLAMA, TRAIN, plan, cluster, span),
            collective_time_s(Collective.ALL_GATHER, hidden_bytes, span, cluster),
            collective_time_s(Collective.REDUCE_SCATTER, hidden_bytes, span, cluster))


def test_float8_tp_gathers_a_byte_an_element_and_reduces_in_the_compute_dtype():
    """Llama 3 8B at TP 8 with SP: per dense block one all-gather at half the bf16 bytes and one
    reduce-scatter at the bf16 bytes, each way."""
    torchtitan = framework_traits("torchtitan")
    blocks = len(dense_blocks(LLAMA))
    fp8, _, scatter = _layer_comm(torchtitan, fp8_linears=True)
    bf16, gather, _ = _layer_comm(torchtitan)
    cluster = replace(parse_cluster("1x8xH100"), framework=torchtitan)
    plan = build_plan(LLAMA, TRAIN, cluster, Choice(tp=8, sequence_parallel=True, fp8_linears=True))
    span = spans(plan, cluster).tp
    float8_bytes = plan.micro_batch_size * TRAIN.seq_len * LLAMA.hidden_size   # one byte an element
    assert fp8 == pytest.approx(blocks * (collective_time_s(Collective.ALL_GATHER, float8_bytes, span, cluster) + scatter))
    assert bf16 == pytest.approx(blocks * (gather + scatter))
    assert fp8 < bf16


def test_a_framework_without_float8_tp_gathers_the_compute_dtype():
    """Our runtime applies no float8 TP styles (float8_with_tp off): its gathers stay bf16."""
    assert not RUNTIME.float8_with_tp
    fp8, gather, scatter = _layer_comm(RUNTIME, fp8_linears=True)
    assert fp8 == pytest.approx(len(dense_blocks(LLAMA)) * (gather + scatter))
