"""How far the cost model's step times are from measurements it was not fitted on.

`MODEL_ERROR_BAND` is the leave-one-source-out MAPE of step time over the published runs
(profiles/runs/published_runs.csv): each source's runs predicted by a fit on the other sources.
Measured by `python benchmarks/fidelity.py --fit`: 8.2 % on 2026-11-23 (73 runs, 7 sources); 8.1 %
on 2026-11-25 (77 runs, 8 sources, Megatron-Core's MoE folding a trait; 8.4 % before it); 5.2 %
on 2026-11-26 (NCCL's ring latency over every rank, flash attention's tile efficiency by
sequence length, the vendor attention speedup fitted, fms-fsdp's eager layer), 5.6 % after that
day's review (NCCL's tree on whole times, a ring CP kernel's tiles per hop) and refit; 5.9 % on
2026-11-28 (gradient accumulation priced, Megatron's fused into its GEMMs but for the embedding,
and the embedding's dense gradient table: `planner validate` 4.8 % in sample as before). Plans
whose predicted step times differ by less than this are not told apart by the evidence, so the
search treats them as equivalent and prefers the more robust one (planner.search).
"""
MODEL_ERROR_BAND = 0.059
