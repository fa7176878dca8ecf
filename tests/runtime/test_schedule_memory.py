"""Memory of the schedules whose held activations were read off the simulator (DualPipeV) or
counted for dense layers first (zero bubble with experts): measured peak per stage against
the prediction, as tests/runtime/test_run_cli.py does for the other schedules (2 stages x 8
micro-batches, fp32, gloo ranks forked from this process)."""
from __future__ import annotations

import json

import pytest
import torch

from planner.cli import main

# A Mixtral-style mixture small enough for a CPU: 4 experts, 2 per token (the HF reader's path)
MIXTURE = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 256,
           "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "vocab_size": 2048, "max_position_embeddings": 512, "num_local_experts": 4, "num_experts_per_tok": 2,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "router_aux_loss_coef": 0.01}


def _one_thread_rank(pf):
    from runtime.train import RunConfig, run_rank
    torch.set_num_threads(1)   # as `planner run` gives each CPU rank (profile threads_per_rank)
    return run_rank(pf, RunConfig(steps=1, warmup=1, quiet=True))


def _measured(plan):
    from costmodel.plan import PlanFile
    from runtime.fork import run_forked
    from runtime.measure import measured_record
    pf = PlanFile.load(plan)
    raw = run_forked(pf.plan.world_size, _one_thread_rank, pf)[0]
    return measured_record(pf, raw, steps=1, warmup=1, wall_s=0.0)


@pytest.mark.parametrize("model,schedule,vpp", [("debug-small", "dualpipev", 2), ("mixture", "zb-h1", 1)])
def test_schedule_holds_the_memory_the_model_says(tmp_path, capsys, model, schedule, vpp):
    """DualPipeV holds 2p + 1 stage chunks on every rank and defers rank + 1 weight passes
    (costmodel.memory.in_flight_micro_batches): predicted -4 % and +6 % of measured per stage.
    ZB-H1 with experts defers the experts' weight passes with the rest of the layer's graph
    (torch's split backward; costmodel.memory.weight_grad_input_bytes): +16 % and +14 %, as
    1F1B on the same mixture (+15 %, +17 %)."""
    if model == "mixture":
        model = str(tmp_path / "config.json")
        (tmp_path / "config.json").write_text(json.dumps(MIXTURE))
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", model, "--cluster", "1x2xxeon-amx", "--dtype", "fp32", "--seq-len", "512",
                 "--global-batch", "16", "--mbs", "2", "--pp", "2", "--dp", "1", "--vpp", str(vpp), "--zero", "0",
                 "--schedule", schedule, "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    m = _measured(plan)
    for stage, (measured, predicted) in enumerate(zip(m.peak_memory_bytes, m.predicted_memory_compared_bytes)):
        assert -0.10 <= predicted / measured - 1 <= 0.25, f"stage {stage}: {predicted:.3g} vs {measured:.3g}"
