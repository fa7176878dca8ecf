"""torchtitan's per-op selective activation checkpointing (activation_checkpoint mode 'selective',
selective_ac_option 'op': torchtitan/parallelisms/parallelize_llama.py `_save_list` and
`_custom_policy` at 9dec370), the selective recomputation of frameworks `selective_op_policy`.

Inside each checkpointed block the policy keeps the outputs of the matrix multiplies but every
second one (counted in forward order), of the attention kernel and of TP's reduce-scatters, and
re-runs everything else when backward needs it. A Llama block multiplies wq, wk, wv, wo, w1, w3,
w2 in that order (layout.layer_blocks keeps it), so wq's, wv's, w1's and w2's outputs stay, and
backward re-runs wk, wo and w3 with the norms, RoPE, SwiGLU's elementwise ops and, under sequence
parallelism, the all-gathers of the blocks' inputs (their time: costmodel.kernels.recompute_modules).
A mixture's experts (grouped GEMMs) are priced as kept, as without recomputation. Float8 linears are counted as multiplies: torchtitan's
published 8B runs hold the same memory with and without them (docs/performance.md @ d4c86e375
Tables 1 and 3: 77.0 and 76.8 GiB, 62.0 and 61.8 GiB)."""
from __future__ import annotations

from costmodel.layout import Linear, Style, dense_linears, recomputed_linears
from costmodel.plan import Plan
from costmodel.selective_modules import OP_POLICY
from costmodel.specs import ModelSpec, PositionKind, TrainSpec


def kept_linears(model: ModelSpec) -> tuple[Linear, ...]:
    """The projections whose outputs the policy keeps: the first and every second after it (the
    others: layout.recomputed_linears)."""
    again = recomputed_linears(model, OP_POLICY)
    return tuple(lin for lin in dense_linears(model) if lin not in again)


def saved_bytes(model: ModelSpec, train: TrainSpec, plan: Plan) -> float:
    """What one block keeps for backward, one micro-batch on one device: its input (on this
    rank's sequence shard under SP), the kept projections' outputs (a column-parallel one's
    shard; a row-parallel one's partial sums whole), the reduce-scatters' outputs under SP, the
    attention kernel's output and fp32 log-sum-exp, and RoPE's tables. A mixture's MLP block is
    the caller's (costmodel.memory.activations)."""
    a = train.compute_dtype.num_bytes
    t, sp = plan.tp, plan.tp if plan.sequence_parallel else 1
    b, s = plan.micro_batch_size, train.seq_len // plan.cp
    tokens, h = b * s, model.hidden_size
    kept = sum(a * tokens * lin.out_features / (t if lin.style is Style.COLWISE else 1) for lin in kept_linears(model))
    rows = sum(lin.style is Style.ROWWISE for lin in dense_linears(model))
    scattered = rows * a * tokens * h / sp if sp > 1 else 0.0
    attention = a * tokens * model.attention_output_size / t + 4.0 * b * (model.num_heads // t) * s
    rope = 4 * a * s * model.rotary_dims if model.position_kind is PositionKind.ROPE else 0.0
    return a * tokens * h / sp + kept + scattered + attention + rope
