import pytest

from planner.measure.runs_table import read_runs
from planner.measure.unknown_framework import price_as_unknown, summary_line
from planner.measure.validate import validate_row

HEADER = ("id,source,framework,arch,layers,hidden,ffn_hidden,heads,kv_heads,vocab,seq_len,gpu,num_gpus,"
          "gpus_per_node,tp,pp,dp,vpp,sp,cp,zero_stage,recompute,micro_batch,global_batch,precision,"
          "metric_name,metric_value,dp_replicate")


def test_rows_are_priced_with_generic_traits_and_a_framework_s_own_setting_is_refused(tmp_path):
    """A Megatron-Core row is priced again as an unknown framework's (its error differs: generic
    traits do not overlap TP or fuse the gradient accumulation); a row stating hybrid sharding,
    which generic traits do not do, is counted as refused; an OOM row is not priced."""
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "\n"
                    "core,x,megatron-core,llama,32,4096,14336,32,8,128256,8192,H100-SXM5-80GB,64,8,4,2,8,,yes,1,1,"
                    "selective,1,256,bf16,iteration_time_s,4.0,\n"
                    "hsdp,x,torchtitan,llama,32,4096,14336,32,8,128256,8192,H100-SXM5-80GB,64,8,1,1,64,,,1,3,"
                    "full,1,64,bf16,iteration_time_s,2.0,8\n"
                    "oom,x,megatron-core,gpt,80,8192,,64,64,51200,2048,A100-SXM4-80GB,8,8,1,1,8,,,1,0,none,1,8,bf16,"
                    "status,OOM,\n")
    rows = read_runs(path)
    results = [validate_row(r) for r in rows]
    priced = price_as_unknown(rows)
    assert (priced.n, priced.refused) == (1, 1)
    assert list(priced.mean_error_by_framework_pct) == ["megatron-core"]
    own = results[0].error_pct
    assert priced.mape_pct == pytest.approx(abs(priced.mean_error_by_framework_pct["megatron-core"]))
    assert priced.mean_error_by_framework_pct["megatron-core"] > own   # generic traits price it slower
    line = summary_line(priced)
    assert "rows 1 (1 refused" in line and "megatron-core +" in line
