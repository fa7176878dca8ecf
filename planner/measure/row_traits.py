"""The traits a runs-table row is priced with: its framework's (costmodel.frameworks), with the
settings the row states that the framework leaves to its user (optional columns dispatcher,
fp8_param_gather, compiled, async_tp, dp_overlap, grad_accumulation_fusion, vendor_attention, attention = flash1,
ep_overlap, recompute_modules, zero3_prefetch_bucket, zero3_max_live, rms_norm, cuda_graph), each checked as the framework
checks it, in one line naming the row."""
from __future__ import annotations

from dataclasses import replace

from costmodel.frameworks import (
    COMPILED_SWIGLU_SAVED,
    EAGER_SWIGLU_SAVED,
    FrameworkTraits,
    framework_traits,
    with_ep_overlap,
)
from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError
from costmodel.rank_time.ep_overlap import overlap_problems
from costmodel.selective_modules import module_problems
from costmodel.specs import DType, ModelSpec, NormKind
from costmodel.zero3_coordinator import DEEPSPEED_MAX_LIVE, DEEPSPEED_PREFETCH_BUCKET
from planner.measure.cells import choice_cell, flag_cell, int_cell, number_cell, published_before
from planner.specs import FP8

# the dispatcher column's values: Megatron-Core's all-to-all, or its flex dispatcher with DeepEP or
# HybridEP, which send a token once to each node holding some of its experts
DISPATCHERS = ("alltoall", "deepep", "hybridep")
# the rms_norm column's values: one fused kernel (apex's FusedRMSNorm, Transformer Engine's), or
# torch's ops in fp32 (transformers' LlamaRMSNorm, Megatron-LM's own megatron/model/rms_norm.py)
RMS_NORMS = ("fused", "torch")
# the attention cell's value for FlashAttention's first generation: a fused kernel, priced as one
# (runs_table.attention_kernel) at that generation's speed (_first_flash)
FLASH_1 = "flash1"
# the cuda_graph column's values: each whole iteration captured in one CUDA graph (frameworks
# `iteration_graph`), or none; graphs of parts of a layer (Transformer Engine's scopes attn,
# moe_router) are not priced and are stated as none
CUDA_GRAPHS = ("full", "none")
# arXiv ids before this one describe Megatron runs on a Megatron-LM without the gradient
# accumulation fusion (NVIDIA/Megatron-LM 9c5a830f25 merged it into the main branch in 2202)
FUSED_GRAD_ACCUMULATION_ARXIV_ID = (2203, 0)


def row_traits(row: dict[str, str], cluster: ClusterSpec, model: ModelSpec) -> FrameworkTraits:
    """The traits of the framework that ran the row, with the settings the row states that the
    framework leaves to its user (costmodel.frameworks): optional columns fp8_param_gather (float8
    weights gathered in float8), compiled (_compiled), async_tp (_async_tp), dispatcher (the
    expert all-to-all: a per-node one, `dispatch_per_node`, unless alltoall), dp_overlap
    (_dp_overlap), grad_accumulation_fusion (_grad_accumulation_fusion), vendor_attention
    (_vendor_attention), attention (_first_flash), ep_overlap (_ep_overlap), recompute_modules
    (_recompute_modules), rms_norm (_rms_norm) and cuda_graph (`full`: each whole iteration a
    CUDA graph, `iteration_graph`)."""
    traits = framework_traits(row.get("framework"))
    if (row.get("dispatcher") or "").strip():
        dispatcher = choice_cell(row, "dispatcher", DISPATCHERS, "alltoall")
        traits = replace(traits, dispatch_per_node=dispatcher != "alltoall")
    if (row.get("fp8_param_gather") or "").strip():
        traits = replace(traits, float8_param_gather=flag_cell(row, "fp8_param_gather", False))
    if (row.get("compiled") or "").strip():
        traits = _compiled(traits, flag_cell(row, "compiled", False))
    # the expert all-to-all overlap as its recipes run it (frameworks.with_ep_overlap: no TP overlap
    # beside it), unless the row states its TP overlap (async_tp)
    if (row.get("ep_overlap") or "").strip() and _ep_overlap(row, traits, model):
        traits = with_ep_overlap(traits)
    if (row.get("async_tp") or "").strip():
        traits = _async_tp(row, traits, cluster)
    if (row.get("dp_overlap") or "").strip():
        traits = _dp_overlap(row, traits)
    if (row.get("grad_accumulation_fusion") or "").strip():
        traits = _grad_accumulation_fusion(row, traits)
    elif traits.fused_grad_accumulation and published_before(row, FUSED_GRAD_ACCUMULATION_ARXIV_ID):
        traits = replace(traits, fused_grad_accumulation=False)
    if (row.get("vendor_attention") or "").strip():
        traits = _vendor_attention(row, traits)
    if (row.get("attention") or "").strip().lower() == FLASH_1:
        traits = _first_flash(row, traits)
    if (row.get("recompute_modules") or "").strip():
        traits = replace(traits, selective_modules=_recompute_modules(row, traits, model))
    if (row.get("rms_norm") or "").strip():
        traits = _rms_norm(row, traits, model)
    if (row.get("cuda_graph") or "").strip():
        traits = replace(traits, iteration_graph=choice_cell(row, "cuda_graph", CUDA_GRAPHS, "none") == "full")
    return _zero3_prefetch(row, traits)


def _rms_norm(row: dict[str, str], traits: FrameworkTraits, model: ModelSpec) -> FrameworkTraits:
    """Optional column rms_norm: how the run's eager layer computed RMSNorm, where its framework
    leaves that to the model's code (`eager_rms_norm_composite`): `fused`, one kernel each way
    (apex's FusedRMSNorm, as BAAI's FlagScale fork of Megatron-LM runs it), or `torch`, its ops
    in fp32. Refused on a model without RMSNorm, and under a framework whose layer is fused or
    compiled (its norm is one kernel whatever the row says)."""
    how = choice_cell(row, "rms_norm", RMS_NORMS, "fused")
    if model.norm_kind is not NormKind.RMSNORM:
        raise UserError(f"row {row['id']!r}: rms_norm = {how}, but the model's norm is {model.norm_kind}")
    if not (traits.eager_layer or traits.llama_ops_eager) or traits.compiled_layer:
        raise UserError(f"row {row['id']!r}: rms_norm = {how}, but framework {traits.name!r} runs a fused "
                        "layer, its RMSNorm one kernel")
    return replace(traits, eager_rms_norm_composite=how == "torch")


# the cells of DeepSpeed's ZeRO-3 prefetch knobs (costmodel.zero3_coordinator)
ZERO3_CELLS = ("zero3_prefetch_bucket", "zero3_max_live")


def _zero3_prefetch(row: dict[str, str], traits: FrameworkTraits) -> FrameworkTraits:
    """A DeepSpeed (or Megatron-DeepSpeed) run's ZeRO-3 gathers as its coordinator ran them:
    optional columns zero3_prefetch_bucket (stage3_prefetch_bucket_size, elements) and
    zero3_max_live (stage3_max_live_parameters); empty: DeepSpeed's defaults, which a run that
    set neither ran. Only DeepSpeed has them: another framework's row stating one is refused."""
    stated = [c for c in ZERO3_CELLS if (row.get(c) or "").strip()]
    if not traits.zero3_gathers_per_param:   # not DeepSpeed's ZeRO-3
        if stated:
            raise UserError(f"row {row['id']!r}: {stated[0]} is DeepSpeed's ZeRO-3 setting; framework "
                            f"{traits.name!r} has none")
        return traits
    bucket = number_cell(row, "zero3_prefetch_bucket", float, DEEPSPEED_PREFETCH_BUCKET, 0.0, None)   # 0: no prefetch
    max_live = number_cell(row, "zero3_max_live", float, DEEPSPEED_MAX_LIVE, 1.0, None)
    return replace(traits, zero3_prefetch_bucket=bucket, zero3_max_live=max_live)


def _compiled(traits: FrameworkTraits, compiled: bool) -> FrameworkTraits:
    """Optional column compiled: whether the run's transformer layers ran under torch.compile
    (torchtitan's --training.compile). yes: inductor fuses each layer's memory-bound work and the
    float8 casts (`compiled_layer`, `float8_casts_fused`); no: torch's eager layer, its norms, RoPE,
    SwiGLU and casts each their own kernels (`eager_layer`, as fms-fsdp's runs). A compiled
    SwiGLU keeps what a fused one does (COMPILED_SWIGLU_SAVED), an eager one eager PyTorch's
    (EAGER_SWIGLU_SAVED), whatever the framework's own layer keeps."""
    saved = min(traits.swiglu_saved_tensors, COMPILED_SWIGLU_SAVED) if compiled else EAGER_SWIGLU_SAVED
    return replace(traits, compiled_layer=compiled, eager_layer=not compiled, float8_casts_fused=compiled,
                   swiglu_saved_tensors=saved)


def _async_tp(row: dict[str, str], traits: FrameworkTraits, cluster: ClusterSpec) -> FrameworkTraits:
    """Optional column async_tp: whether the run overlapped its sequence-parallel collectives with
    their GEMMs (`tp_comm_overlap`). torch's async TP (torchtitan's
    --parallelism.enable_async_tensor_parallel) decomposes each all-gather and reduce-scatter
    into tp steps over symmetric memory, each behind the matmul of a chunk already there, as
    Transformer Engine's userbuffers do; it is an inductor pass (torchtitan refuses it without
    --training.compile) and runs on SM90 and later, so a row stating it says compiled, and its
    device's profile has `tp_comm_gemm_overlap`. `no` also states a Megatron-Core run without
    --tp-comm-overlap (Transformer Engine's userbuffers), which the framework's traits assume."""
    overlap = flag_cell(row, "async_tp", False)
    if overlap and not cluster.device.tp_comm_gemm_overlap:
        raise UserError(f"row {row['id']!r}: async_tp = yes on {cluster.device.name}, whose profile "
                         "runs no TP collective-GEMM overlap (tp_comm_gemm_overlap)")
    if overlap and (row.get("compiled") or "").strip() and not flag_cell(row, "compiled", False):
        raise UserError(f"row {row['id']!r}: async_tp = yes needs compiled = yes (torch's async TP is an inductor pass)")
    return replace(traits, tp_comm_overlap=overlap)


def _dp_overlap(row: dict[str, str], traits: FrameworkTraits) -> FrameworkTraits:
    """Optional column dp_overlap: whether the run hid its data-parallel collectives behind
    compute, the gradients' reduction during backward and the updated weights' gather during the
    next forward (`dp_grad_overlap`, `dp_param_overlap`). `no` states a Megatron-Core run without
    --overlap-grad-reduce and --overlap-param-gather (off by default), whose reduce-scatter or
    all-reduce follows the backward and whose all-gather follows the optimizer step; the
    framework's traits assume both. `yes` under Megatron-LM before Megatron-Core states its torch
    DDP (`torch_ddp_option`: --DDP-impl torch), which hides the all-reduce behind the last
    backward only without a pipeline (Megatron-LM's pipeline schedules never enter no_sync: an
    all-reduce every micro-batch, not priced) and without sharded states (its distributed
    optimizer asserts its own DDP). `yes` on a framework that cannot overlap is refused."""
    overlap = flag_cell(row, "dp_overlap", False)
    if overlap and traits.torch_ddp_option and not traits.dp_grad_overlap:
        if (row.get("zero_stage") or "").strip() != "0" or (row.get("pp") or "").strip() != "1":
            raise UserError(f"row {row['id']!r}: dp_overlap = yes, but framework {traits.name!r} overlaps only "
                            "torch DDP's all-reduce (--DDP-impl torch), which needs zero_stage 0 and pp 1 stated")
        return replace(traits, dp_grad_overlap=True)
    if overlap and not (traits.dp_grad_overlap and traits.dp_param_overlap):
        raise UserError(f"row {row['id']!r}: dp_overlap = yes, but framework {traits.name!r} does not "
                        "hide its data-parallel collectives")
    return replace(traits, dp_grad_overlap=overlap, dp_param_overlap=overlap)


def _grad_accumulation_fusion(row: dict[str, str], traits: FrameworkTraits) -> FrameworkTraits:
    """Optional column grad_accumulation_fusion: whether the run's weight-gradient GEMMs added into
    the step's gradient buffer themselves (`fused_grad_accumulation`: Megatron's
    gradient_accumulation_fusion, on by default since NVIDIA/Megatron-LM 9c5a830f25). `no` states
    a Megatron run without it (a Megatron-LM before that commit, or
    --no-gradient-accumulation-fusion): each micro-batch's gradients are added into the buffer
    by a kernel of their own, a pass over the rank's gradients (costmodel.rank_time.
    grad_accumulation_s). Empty: the framework's, less the fusion for a run an arXiv paper from
    before it describes (FUSED_GRAD_ACCUMULATION_ARXIV_ID). `yes` under a framework without the
    fusion is refused."""
    fused = flag_cell(row, "grad_accumulation_fusion", False)
    if fused and not traits.fused_grad_accumulation:
        raise UserError(f"row {row['id']!r}: grad_accumulation_fusion = yes, but framework {traits.name!r} "
                        "adds each micro-batch's gradients in a pass of their own")
    return replace(traits, fused_grad_accumulation=fused)


def _first_flash(row: dict[str, str], traits: FrameworkTraits) -> FrameworkTraits:
    """attention = flash1: the run's fused attention was FlashAttention's first generation
    (`flash_attention_1`): flash-attn 1.x, or torch's scaled_dot_product_attention before 2.2,
    whose release brought FlashAttention-2 to it ("around 2x" faster: the PyTorch 2.2 release
    notes). Not Transformer Engine's cuDNN kernel, so a row stating vendor_attention = yes with
    it is refused."""
    if flag_cell(row, "vendor_attention", False):
        raise UserError(f"row {row['id']!r}: attention = {FLASH_1} is FlashAttention's first generation, not "
                        "Transformer Engine's fused attention (vendor_attention = yes)")
    return replace(traits, flash_attention_1=True, flash_attention_triton=False, vendor_attention=False)


def _vendor_attention(row: dict[str, str], traits: FrameworkTraits) -> FrameworkTraits:
    """Optional column vendor_attention: whether the run's attention was Transformer Engine's
    cuDNN fused kernel (`vendor_attention`), which Megatron-Core's traits assume. `no` states a
    run that turned it off (NVTE_FUSED_ATTN=0: TE then calls flash-attn's FlashAttention-2);
    `yes` on a framework without Transformer Engine's attention is refused."""
    fused = flag_cell(row, "vendor_attention", False)
    if fused and not traits.vendor_attention:
        raise UserError(f"row {row['id']!r}: vendor_attention = yes, but framework {traits.name!r} does not "
                        "call Transformer Engine's fused attention")
    return replace(traits, vendor_attention=fused)


# the plan cells a row overlapping its expert all-to-alls states: the search that fills the others
# prices a plan's layers before its micro-batch and stage counts, which the overlap reads
_EP_OVERLAP_STATED = ("micro_batch", "recompute", "vpp", "zero_stage")


def _ep_overlap(row: dict[str, str], traits: FrameworkTraits, model: ModelSpec) -> bool:
    """Optional column ep_overlap: whether the run overlapped its expert all-to-alls with another
    micro-batch's compute (Megatron-Core's --overlap-moe-expert-parallel-comm,
    `ep_a2a_overlap`), with the checks Megatron-Core's TransformerConfig makes of it
    (overlap_problems)."""
    overlap = flag_cell(row, "ep_overlap", False)
    if not overlap:
        return False
    where = f"row {row['id']!r}: ep_overlap = yes"
    if traits.name != "megatron-core":
        raise UserError(f"{where} is Megatron-Core's --overlap-moe-expert-parallel-comm; framework "
                        f"{row.get('framework')!r} has no such overlap")
    needed = _EP_OVERLAP_STATED + (("sp",) if int_cell(row, "tp", 1) > 1 else ())
    missing = [c for c in needed if not (row.get(c) or "").strip()]
    if missing:
        raise UserError(f"{where} needs {', '.join(missing)} stated: the search does not price the overlap")
    precision = choice_cell(row, "precision", (*(d.value for d in DType), FP8), "bf16")
    dtype = DType.BF16 if precision == FP8 else DType(precision)   # float8 linears compute in bf16
    if problems := overlap_problems(model, dtype, ep=int_cell(row, "ep", 1),
                                    full_recompute=row["recompute"].strip().lower() == "full",
                                    pp=int_cell(row, "pp", 1), vpp=int_cell(row, "vpp", 1)):
        raise UserError(f"{where} {problems[0]}")
    return True


def _recompute_modules(row: dict[str, str], traits: FrameworkTraits, model: ModelSpec) -> tuple[str, ...]:
    """Optional column recompute_modules: the modules the run's selective recomputation re-ran,
    joined by '+' (Megatron-Core's --recompute-modules, e.g. mla_up_proj+mlp; frameworks
    `selective_modules`), with the checks Megatron-Core makes of them (module_problems)."""
    names = tuple(n.strip() for n in row["recompute_modules"].split("+"))
    where = f"row {row['id']!r}: recompute_modules = {row['recompute_modules'].strip()!r}"
    if problems := module_problems(names, traits.name, model):
        raise UserError(f"{where}: {problems[0]}")
    if (row.get("recompute") or "").strip().lower() != "selective":
        raise UserError(f"{where} needs recompute = selective (Megatron-Core reads the modules under "
                        "--recompute-granularity selective only)")
    return names
