"""Per pipeline rank: the time of one micro-batch (compute and the communication on its critical
path, `times`, `layer_comm`), the groups each axis spans (`spans`), and the data-parallel
synchronisation left exposed after overlap (`dp_terms`), and what runs once a step beside the
pipeline (`after_pipeline`).
"""
from costmodel.rank_time.after_pipeline import (
    after_pipeline_s,
    grad_accumulation_s,
    one_replica_fsdp_parts_s,
    one_replica_fsdp_s,
    tp_replica_sync_s,
)
from costmodel.rank_time.dp_terms import (
    DpTerm,
    dp_bucket_s,
    dp_exposed_parts_s,
    dp_exposed_s,
    dp_groups,
    dp_hidden_s,
    dp_term_comm_s,
    dp_terms,
    dp_unit_layers,
    dp_window_s,
)
from costmodel.rank_time.layer_comm import pp_sends_s
from costmodel.rank_time.spans import Spans, link_costs, spans, split_dp_axis, stage_pair_all_reduce_s
from costmodel.rank_time.times import ZERO_TIMES, RankTimeModel, RankTimes, fastest_of, rank_time_model, rank_times

__all__ = [
    "DpTerm", "RankTimeModel", "RankTimes", "Spans", "ZERO_TIMES", "after_pipeline_s", "dp_bucket_s",
    "dp_exposed_parts_s", "dp_exposed_s", "dp_groups", "dp_hidden_s", "dp_term_comm_s", "dp_terms", "dp_unit_layers", "dp_window_s",
    "fastest_of", "grad_accumulation_s", "link_costs", "one_replica_fsdp_parts_s", "one_replica_fsdp_s",
    "pp_sends_s", "rank_time_model", "rank_times", "spans", "split_dp_axis", "stage_pair_all_reduce_s", "tp_replica_sync_s"]
