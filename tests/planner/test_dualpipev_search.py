"""DualPipeV in the search: a schedule without a closed form competes as a simulated variant of
the best closed-form plans (planner.repricing._simulated_variants), priced as `estimate` prices it."""
from __future__ import annotations

from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster
from costmodel.registry import resolve_model
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from planner.search import SearchOptions, search


def test_the_search_emits_dualpipev_priced_by_simulation():
    """llama-70b on 64 A100s (seq 2048, 512 sequences) in four pipeline stages: the pipeline's
    plans gain a DualPipeV variant (two stages per rank in a V, at least 2p micro-batches), which
    the ranking sees with the estimate of that plan. (A variant keeps its plan's recomputation
    and the best plans fill the memory: at seq 4096 every variant overflows by tenths of a GiB.)"""
    model, cluster = resolve_model("llama-70b"), parse_cluster("8x8xA100")
    train = TrainSpec(seq_len=2048, global_batch_size=512)
    found = [f for f in search(model, train, cluster, SearchOptions(top_k=10, fixed={"pp": 4})).evaluated if f.plan.schedule is Schedule.DUALPIPEV]
    assert found
    for f in found:
        plan = f.plan
        assert plan.vpp == 2 and plan.num_micro_batches >= 2 * plan.pp
        assert plan.stage_rank(plan.num_virtual_stages - 1) == 0   # the V ends where it starts
        assert f.estimate.step_time_s == estimate(model, train, cluster, plan).step_time_s


def test_predict_takes_the_v_schedules_two_stages_per_rank_without_vpp(capsys):
    """`--schedule dualpipev` (or zbv) says how many virtual stages a rank holds: two; --vpp
    given otherwise is still checked against it."""
    import json

    from planner.cli import main
    argv = ["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--pp", "2", "--tp", "4", "--schedule", "dualpipev",
            "--seq-len", "4096", "--global-batch", "64", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["vpp"] == 2
    assert main([*argv, "--vpp", "3"]) == 2
    assert "needs vpp = 2" in capsys.readouterr().err
