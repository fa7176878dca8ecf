"""FSDP units of a bucket's layers below ZeRO-3 (runtime.parallel.fsdp_units,
costmodel.fsdp_units.fsdp_unit_layers): the units the runtime wraps are the ones the cost model prices,
and a plan whose units hold several layers still trains as one process does."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from parity import assert_parity, plan_file
from torch import nn

import costmodel.fsdp_units as fsdp_units
from costmodel.comm import Collective, collective_time_s
from costmodel.fsdp_units import fsdp_unit_layers, whole_stage_units
from costmodel.params import layer_params, rank_params
from costmodel.rank_time import dp_exposed_s, dp_terms, rank_times, spans
from costmodel.registry import resolve_model
from costmodel.specs import DType
from planner.space import Choice


def test_units_are_taken_from_the_last_layer_and_the_rest_left_to_the_root():
    from runtime.parallel import fsdp_units
    layers = [nn.Linear(1, 1) for _ in range(5)]
    assert fsdp_units(layers, 1) == [[m] for m in layers]           # a layer each, as FSDP wraps blocks
    assert fsdp_units(layers, 2) == [layers[1:3], layers[3:5]]       # layer 0 in the root
    assert fsdp_units(layers, 5) == fsdp_units(layers, 812) == []    # all of them in the root


def test_a_unit_reaches_megatron_cores_bucket_below_zero3():
    tiny, big = resolve_model("debug-tiny"), resolve_model("llama2-70b")
    pf = plan_file(Choice(zero_stage=1), world=2)
    assert fsdp_unit_layers(tiny, pf.plan) == -(-40_000_000 // layer_params(tiny)) > tiny.num_layers
    assert whole_stage_units(tiny, pf.plan)
    assert fsdp_unit_layers(tiny, replace(pf.plan, dp=64)) == -(-64_000_000 // layer_params(tiny))
    assert fsdp_unit_layers(tiny, replace(pf.plan, zero_stage=3)) == 1   # ZeRO-3's units bound gathered weights
    assert fsdp_unit_layers(tiny, replace(pf.plan, ep=2)) == 1
    assert fsdp_unit_layers(big, pf.plan) == 1                             # 856M parameters a layer


def _units_per_stage(pf) -> list[int]:
    """Distinct FSDP parameter groups of each stage module on rank 0, as build_job wraps them:
    in a forked child (the parent's monkeypatches inherited), since a fake process group built
    in the test's own process leaves torch's state such that a later DCP save in ranks forked
    from it fails ("invalid fill")."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(_units_in_this_process, pf).result()


def _units_in_this_process(pf) -> list[int]:
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.job import build_job
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pf.plan.world_size)
    try:
        job = build_job(pf, torch.device("cpu"), seed=0, materialize=False)
        return [len({id(m._get_fsdp_state()._fsdp_param_group) for m in mod.modules()
                     if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None})
                for _, mod in sorted(job.modules.items())]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("zero,bucket,units", [(1, None, 1), (0, None, 1), (3, None, 5), (2, 3, 2)],
                         ids=["zero1_one_unit", "zero0_one_unit", "zero3_a_layer_each", "zero2_units_of_three"])
def test_the_runtime_wraps_the_units_the_model_prices(monkeypatch, zero, bucket, units):
    """debug-tiny (4 layers of 49k parameters) on two ranks; `bucket`: layers a unit takes, by
    shrinking the bucket (three: layers 1-3 one unit, layer 0 with the root)."""
    if bucket:
        monkeypatch.setattr(fsdp_units, "FSDP_UNIT_MIN_PARAMS", bucket * layer_params(resolve_model("debug-tiny")))
        monkeypatch.setattr(fsdp_units, "FSDP_UNIT_MIN_PARAMS_PER_RANK", 1)
    pf = plan_file(Choice(zero_stage=zero), world=2, compute_dtype=DType.BF16)
    assert _units_per_stage(pf) == [units]
    term = dp_terms(pf.model, pf.train, pf.plan, pf.cluster)[0]
    priced = (term.units if not term.pieces_per_layer
              else rank_params(pf.model, pf.plan, 0).total / (fsdp_unit_layers(pf.model, pf.plan)
                                                             * layer_params(pf.model)))
    # a stage one unit exactly; units of layers within one unit's latency (the root's embedding
    # and head counted by their parameters over a unit's)
    assert priced == pytest.approx(units, abs=0.0 if whole_stage_units(pf.model, pf.plan) else 1.0)


def test_a_stage_that_is_one_unit_pays_one_collectives_latency():
    pf = plan_file(Choice(zero_stage=0), world=2, compute_dtype=DType.BF16)
    model, train, plan, cluster = pf.model, pf.train, pf.plan, pf.cluster
    sp = spans(plan, cluster)
    held = rank_params(model, plan, 0)
    one = collective_time_s(Collective.ALL_REDUCE, held.total * train.grad_dtype.num_bytes, sp.dp, cluster)
    times = rank_times(model, train, plan, cluster, sp, 0)
    assert dp_exposed_s(model, train, plan, cluster, sp, 0, times) == pytest.approx(
        one / cluster.device.efficiency.dp_comm)


@pytest.mark.parametrize("zero", [1, 2])
def test_units_of_several_layers_train_as_one_process(monkeypatch, zero):
    """Layers 1-3 one FSDP unit (a list of modules), layer 0 with the embedding in the root."""
    monkeypatch.setattr(fsdp_units, "FSDP_UNIT_MIN_PARAMS", 3 * layer_params(resolve_model("debug-tiny")))
    monkeypatch.setattr(fsdp_units, "FSDP_UNIT_MIN_PARAMS_PER_RANK", 1)
    pf = plan_file(Choice(zero_stage=zero, micro_batch_size=2), world=2)
    assert fsdp_unit_layers(pf.model, pf.plan) == 3
    assert_parity(pf)
