"""Megatron-Core's MoE parallel folding (costmodel.frameworks `ep_folds_over_tp`), as `validate`
prices Megatron-Core's Mixtral 8x22B mapping on 128 H100 (tp2 pp8 dp8 ep8): its EP groups are
two TP ranks and four data-parallel ones, inside a node, and each expert's states are sharded
over the two ranks holding it; carved from data parallelism (our runtime), EP crosses nodes and
each rank's expert states are whole."""
from dataclasses import replace

from costmodel.estimate import estimate
from costmodel.frameworks import RUNTIME, framework_traits
from costmodel.hardware import parse_cluster
from costmodel.params import expert_dp, folds_ep
from costmodel.rank_time import spans
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("mixtral-8x22b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=256)


def _priced(traits):
    cluster = replace(parse_cluster("16x8xH100"), framework=traits)
    plan = build_plan(MODEL, TRAIN, cluster, Choice(tp=2, pp=8, ep=8, zero_stage=1, micro_batch_size=1))
    return cluster, plan, estimate(MODEL, TRAIN, cluster, plan)


def test_megatron_folds_expert_parallelism_over_tensor_parallelism():
    megatron = framework_traits("megatron-core")
    cluster, plan, folded = _priced(megatron)
    assert folds_ep(plan, megatron) and not folds_ep(plan, RUNTIME)
    assert (expert_dp(plan, megatron), expert_dp(plan, RUNTIME)) == (2, 1)
    sp = spans(plan, cluster)
    assert (sp.ep.size, sp.ep.num_nodes, sp.edp.size) == (8, 1, 2)
    _, _, carved = _priced(RUNTIME)
    # half the experts' optimizer states, and an all-to-all on NVLink rather than InfiniBand
    assert folded.max_peak_memory_bytes < carved.max_peak_memory_bytes - 5 * 2**30
    assert folded.time_breakdown_s["comm/ep_exposed"] < carved.time_breakdown_s["comm/ep_exposed"] / 2
    assert folded.fits   # the published run ran, so its plan must be predicted to fit
