"""Measure the machine this runs on: what `planner profile` writes into a device profile.

- GEMM throughput over the shapes transformer layers use (tokens x hidden x {hidden, 3 hidden,
  4 hidden}) and square ones, per dtype: a curve of achieved FLOP/s against FLOPs per call.
- Memory-bound kernels (elementwise add, RMS norm, softmax) over sizes, as one mix per size:
  achieved bytes/s (read + write) against bytes moved per kernel.
- Attention (torch's scaled_dot_product_attention, causal) at a few sizes: on a GPU as the
  fraction of the GEMM rate it reaches; on a CPU timed outright, forward and backward, without
  dropout and with it (torch's math path there).
- Per-operator overhead: a one-element add, the floor under every small kernel.
- An AdamW step as the runtime takes one, per parameter; torch's dropout, per element (a CPU
  draws its random numbers in software: ~40x an add), and on a CPU its GeLU (transcendental
  work, ~10x an add).
- Collectives among N local ranks (gloo on CPU, NCCL on GPU): all-reduce, all-gather,
  reduce-scatter and send/recv over message sizes, fitted to the alpha-beta ring model of
  costmodel.comm (latency per step, bandwidth per rank per direction).
- On a CPU, one probe layer's forward and backward with each kernel timed where it runs
  (runtime.layer_ops): how fast each kind of kernel goes inside a training step.
- Training steps of small probe plans (`probe_rank`): what a step adds to the kernels above.
Each figure is the best of a few repetitions after a warm-up (the achievable rate, as a
training step that repeats the same kernels sees it); on a CPU, the best of two passes, the
second after the probes (second_pass_rank: a shared machine slows for seconds at a time).

Every curve obeys a `Budget`: sizes grow only while the next point's expected time (from the
rate just measured) stays under the per-point budget and the phase's share of the total, so a
dtype the hardware does not accelerate (bf16 on a CPU without AMX: ~1 GFLOP/s) stops at small
sizes instead of taking minutes. All ranks stop together (`_agree`).
"""
from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from costmodel.hardware import GELU_APPROXIMATIONS, fsdp_sync_key, sdpa_key
from costmodel.kernels import flash_tile_efficiency, interpolate, sdpa_head_s
from costmodel.params import bucket_layers
from costmodel.specs import LayerProbe
from runtime.layer_ops import layer_op_seconds
from runtime.model import DROPOUT_P

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYER_HIDDEN = (64, 128, 256, 512, 1024)
LAYER_TOKENS = (128, 512, 2048)
SQUARE = (16, 32, 64, 1536)
GEMM_MAX_FLOPS = 2e10
MEMORY_ELEMS = tuple(4**k for k in range(5, 13))          # 1 Ki .. 16 Mi elements
# A GPU reaches its GEMM peak only from ~1e11-1e12 FLOPs per call (the layers of a 1-70B model:
# 4-16K tokens x 2-8K hidden), and its memory-bound rate only well beyond its L2 (50 MB on an
# H100): the curves go that far there, so the layers a plan prices are measured, not extrapolated.
# The budget still stops a curve early on a slow device.
GPU_LAYER_HIDDEN = LAYER_HIDDEN + (2048, 4096, 8192)
GPU_LAYER_TOKENS = LAYER_TOKENS + (8192,)
GPU_SQUARE = SQUARE + (4096, 8192)
GPU_GEMM_MAX_FLOPS = 2.5e12
GPU_MEMORY_ELEMS = MEMORY_ELEMS + (4**13, 4**14)          # .. 256 Mi elements (1 GiB in fp32)
COLLECTIVE_BYTES = tuple(4**k for k in range(1, 12))      # 4 B .. 16 MiB
CALLS_PER_POINT = 4                                       # best_s: one warm-up + three timed
# Training-step probes: the median of PROBE_STEPS after PROBE_WARMUP (a shared 2-core machine
# moved single steps by 10-30 %; the fitted per-kernel cost moved 13 -> 60 us between profiles
# with 3 steps after 1).
PROBE_STEPS, PROBE_WARMUP = 5, 2
# Below this share of fp32's rate at equal FLOPs a dtype is "not accelerated" here.
ACCELERATED_RATIO = 0.5
# ... judged at calls this large and up: smaller ones are dominated by dispatch and conversions
# (bf16 on an AMX CPU reaches fp32's rate only from ~1e7 FLOPs, and twice it beyond).
ACCELERATED_CHECK_FLOPS = 3e7

# Each phase's share of the total budget; what is left covers process start-up and the fit.
PHASE_SHARES = {"gemm": 0.27, "memory": 0.06, "attention": 0.08, "collectives": 0.10, "probes": 0.37}
CURVE_PHASES = ("gemm", "memory", "attention")   # what a CPU's second pass measures again


@dataclass(frozen=True)
class Budget:
    """How long a profile may take (`total_s`) and one curve point (`point_s`: warm-up and
    repetitions together)."""
    total_s: float
    point_s: float

    def phase_s(self, phase: str) -> float:
        return self.total_s * PHASE_SHARES[phase]


# (total_s, point_s) per mode and device kind: the ceilings are 60 s on a 2-core CPU and
# 120 s on one GPU for the default; the totals leave room for start-up and the fit.
BUDGETS = {("quick", "cpu"): Budget(30.0, 0.15), ("default", "cpu"): Budget(45.0, 0.4),
           ("thorough", "cpu"): Budget(240.0, 2.0), ("quick", "cuda"): Budget(45.0, 0.2),
           ("default", "cuda"): Budget(90.0, 0.5), ("thorough", "cuda"): Budget(400.0, 2.0)}


def _agree(stop: bool) -> bool:
    """True on every rank when any rank wants to stop (their clocks differ slightly)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stop
    flag = torch.tensor([1 if stop else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _over(expected_s: float, phase_start: float, phase_s: float, point_s: float) -> bool:
    return expected_s > point_s or time.perf_counter() - phase_start + expected_s > phase_s


def best_s(fn: Callable[[], object], repeat: int = 3, sync: Callable[[], None] = lambda: None,
           batch_s: float = 0.0) -> float:
    """The best of `repeat` timings of `fn` after one warm-up call. batch_s > 0: each timing is
    of as many calls back to back as fill batch_s (at most MAX_BATCH), divided by their number."""
    fn()
    sync()
    calls = 1
    if batch_s > 0:
        start = time.perf_counter()
        fn()
        sync()
        calls = max(1, min(MAX_BATCH, int(batch_s / max(time.perf_counter() - start, 1e-9))))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return min(times)


# A GPU runs the kernels a training step queues back to back; one call between two
# synchronisations times the launch and the synchronisation instead (~15 us on an H100 with
# torch 2.11, more than a small kernel's own work), so its points are timed in batches.
GPU_BATCH_S, MAX_BATCH = 2e-3, 64


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _timed(device: torch.device) -> dict:
    """best_s's keywords for kernels on `device`."""
    return {"sync": _sync(device), "batch_s": GPU_BATCH_S if device.type == "cuda" else 0.0}


def gemm_shapes(device_type: str = "cpu") -> list[tuple[int, int, int]]:
    """(tokens, hidden, out) of the layers' GEMMs and a few squares, ascending FLOPs."""
    gpu = device_type == "cuda"
    hidden, tokens, square = (GPU_LAYER_HIDDEN, GPU_LAYER_TOKENS, GPU_SQUARE) if gpu else \
        (LAYER_HIDDEN, LAYER_TOKENS, SQUARE)
    shapes = {(t, h, n * h) for h in hidden for t in tokens for n in (1, 3, 4)}
    shapes |= {(s, s, s) for s in square}
    cap = GPU_GEMM_MAX_FLOPS if gpu else GEMM_MAX_FLOPS
    return sorted((s for s in shapes if 2 * s[0] * s[1] * s[2] <= cap), key=lambda s: s[0] * s[1] * s[2])


def gemm_point(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    flops = 2.0 * m * k * n
    return flops, flops / best_s(lambda: a @ b, **_timed(device))


@dataclass(frozen=True)
class Curve:
    """A measured curve and where the budget stopped it (None: every size measured)."""
    points: tuple[tuple[float, float], ...]
    stopped_before: float | None = None
    accelerated: bool = True


def gemm_curve(shapes, dtype: torch.dtype, device: torch.device, phase_s: float, point_s: float,
               reference: tuple[tuple[float, float], ...] = (), report=lambda frac, what: None) -> Curve:
    """GEMM rates over `shapes` (ascending FLOPs) until the next point would break the budget,
    in the shapes' order (a second pass pairs its points with them: best_of).
    Against `reference` (fp32's curve), a dtype below ACCELERATED_RATIO of it
    (at ACCELERATED_CHECK_FLOPS and up) is marked not accelerated and measured with a quarter
    of the point budget from then on."""
    start, points, accelerated = time.perf_counter(), [], True
    for i, (m, k, n) in enumerate(shapes):
        flops = 2.0 * m * k * n
        expected = CALLS_PER_POINT * flops / points[-1][1] if points else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            return Curve(tuple(points), flops, accelerated)
        points.append(gemm_point(m, k, n, dtype, device))
        if reference and accelerated and flops >= ACCELERATED_CHECK_FLOPS and \
                _agree(points[-1][1] < ACCELERATED_RATIO * interpolate(reference, flops)):
            accelerated, point_s = False, point_s / 4
        report((i + 1) / len(shapes), f"GEMM {m}x{k}x{n}")
    return Curve(tuple(points), None, accelerated)


def memory_points(elems: int, device: torch.device) -> list[tuple[float, float]]:
    """One point of the memory-bound curve: an add (read 2, write 1), an RMS norm and a softmax
    (read 1, write 1) over fp32 rows of 256, as one mix (bytes per kernel, bytes/s): their bytes
    over their seconds. A training step's memory-bound kernels are of many kinds, and a softmax
    or a norm moves bytes at a quarter of an add's rate (2026-11-27, AMD EPYC); a curve of the
    kinds' points apart zigzags between them (the fastest at 12 bytes per element, the slowest
    at 8): a held-out model's residual add was priced at 63 GB/s at micro-batch 1 and 25 at 2
    (closed-loop run BN)."""
    x = torch.randn(elems // 256, 256, device=device)
    y = torch.randn_like(x)
    w = torch.ones(256, device=device)
    timed = _timed(device)
    b = x.numel() * 4
    kernels = [(3.0 * b, lambda: x + y), (2.0 * b, lambda: F.rms_norm(x, (256,), w)),
               (2.0 * b, lambda: x.softmax(-1))]
    moved = sum(n for n, _ in kernels)
    seconds = sum(best_s(fn, **timed) for _, fn in kernels)
    return [(moved / len(kernels), moved / seconds)]


def memory_curve(device: torch.device, phase_s: float, point_s: float, report, count: int | None = None) -> Curve:
    """memory_points over the sizes (the first `count` of them) until the next would break the budget."""
    start, points = time.perf_counter(), []
    sizes = (GPU_MEMORY_ELEMS if device.type == "cuda" else MEMORY_ELEMS)[:count]
    for i, elems in enumerate(sizes):
        bytes_ = 7.0 * 4 * elems   # the three kernels' traffic together
        expected = CALLS_PER_POINT * bytes_ / points[-1][1] if points else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            return Curve(tuple(points), bytes_ / 3)
        points += memory_points(elems, device)
        report((i + 1) / len(sizes), f"memory-bound kernels, {elems:,} elements")
    return Curve(tuple(points))


def op_overhead_s(device: torch.device) -> float:
    x = torch.ones(1, device=device)
    return best_s(lambda: [x + x for _ in range(1000)], repeat=5, sync=_sync(device)) / 1000


# AdamW timed over 4M fp32 parameters in 16 tensors (64 MiB of weights, gradients and moments:
# beyond the caches, as a model's are); on a GPU over 128M in 32 (2 GiB): at 4M the step is
# its launches (an H100 measured 107 ps per parameter there, against 35 over a 0.85B model's
# 150 tensors in its runs)
OPTIMIZER_PARAMS, OPTIMIZER_TENSORS, OPTIMIZER_ALLOCATIONS = 1 << 22, 16, 3
GPU_OPTIMIZER_PARAMS, GPU_OPTIMIZER_TENSORS = 1 << 27, 32


def persisting_params(device_type: str) -> tuple[int, int]:
    """(parameters, tensors) the per-parameter costs are timed over on this kind of device."""
    return (GPU_OPTIMIZER_PARAMS, GPU_OPTIMIZER_TENSORS) if device_type == "cuda" else \
        (OPTIMIZER_PARAMS, OPTIMIZER_TENSORS)


def optimizer_s_per_param(device: torch.device) -> float:
    """Seconds per parameter of an AdamW step as the runtime takes one on the device
    (runtime.train.make_optimizer: foreach, fp32 weights; FSDP2 keeps the master weights in
    fp32 for every compute dtype). Timed on tensors that persist from step to step: the
    memory-bound curve's kernels write fresh outputs, whose first touch (page faults, on a CPU)
    an in-place optimizer never pays. The mean over OPTIMIZER_ALLOCATIONS fresh sets of tensors:
    on a CPU the same step takes 2 or 4 ns per parameter by where its pages land, stable within
    one allocation (a training run's are as likely to land either way)."""
    count, tensors = persisting_params(device.type)

    def once() -> float:   # one allocation's tensors, freed on return
        params = [torch.nn.Parameter(torch.randn(count // tensors, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        optimizer.step()   # the moments are allocated on the first step
        return best_s(optimizer.step, repeat=3, sync=_sync(device))

    return _mean_over_allocations(once) / count


def _mean_over_allocations(once: Callable[[], float]) -> float:
    """The mean of `once()` (seconds, timed on tensors it allocates and frees) over
    OPTIMIZER_ALLOCATIONS allocations: where the pages land moves a CPU's per-parameter costs."""
    return sum(once() for _ in range(OPTIMIZER_ALLOCATIONS)) / OPTIMIZER_ALLOCATIONS


def _measured_dtypes(dtypes: list[str]) -> list[str]:
    """fp32 and the profile's other dtypes, each once: the per-dtype per-parameter costs' keys."""
    return list(dict.fromkeys(["fp32", *dtypes]))


def grad_accumulate_s_per_param(device: torch.device, dtypes: list[str]) -> dict[str, float]:
    """Seconds per parameter of adding one micro-batch's gradients into the step's fp32 ones, in
    place, per dtype the new gradients come in ({"fp32": ..., "bf16": ...}): autograd's own
    accumulation (`grad += new`) where the gradients are fp32, FSDP2's into its fp32
    `unsharded_accumulated_grad` where they are 16-bit (mixed precision with an fp32
    reduce_dtype). Timed as the optimizer's step is, on OPTIMIZER_PARAMS persisting parameters in
    OPTIMIZER_TENSORS tensors, the mean over OPTIMIZER_ALLOCATIONS allocations (the memory-bound
    curve's kernels write fresh outputs, which an in-place add never touches). On a 2-core EPYC
    (2026-11-28, closed loop GC's `planner profile`) fp32 += fp32 took 3.1e-10 s a parameter (39
    GB/s), fp32 += bf16 3.4e-10 (29 GB/s): the mixed add is not the same kernel at fewer bytes.
    The adds inside a training step (`python benchmarks/step_trace.py PLAN --steps 2 --rows 400
    --shapes` on a closed loop's one-rank fp32 plan of 10.9M parameters) read 34 GB/s with their per-tensor dispatch: these 32 MB may partly sit in
    a large last-level cache, which the cost model then prices slightly fast."""
    count, tensors = persisting_params(device.type)

    def once(dtype: torch.dtype) -> float:   # one allocation's tensors, freed on return
        acc = [torch.randn(count // tensors, device=device) for _ in range(tensors)]
        new = [torch.randn(count // tensors, device=device, dtype=dtype) for _ in range(tensors)]
        return best_s(lambda: [a.add_(b) for a, b in zip(acc, new)], repeat=3, sync=_sync(device))

    return {name: _mean_over_allocations(lambda: once(DTYPES[name])) / count for name in _measured_dtypes(dtypes)}


# FSDP2's one-rank reduce and gather: a stack of GPT-shaped layers (QKV, output, FFN up and down;
# 14 h^2 parameters each) at a few tokens, so the passes' GEMMs are small beside FSDP's copies:
# 11.3M parameters in 32 tensors on a CPU (45 MB in fp32, past a 32 MB last-level cache, as the
# closed loops' models are), 235M on a GPU; one warm-up round, then the median of four
FSDP_HIDDEN, FSDP_LAYERS, FSDP_TOKENS, FSDP_ROUNDS = {"cpu": 448, "cuda": 2048}, 4, 8, 5


def fsdp_sync_s_per_param(device: torch.device, dtypes: list[str]) -> dict[str, float]:
    """Seconds per parameter of FSDP2's reduce and gather on a one-rank group, per compute dtype
    ({"reduce.bf16": ..., "gather.bf16": ..., "reduce.fp32": ...}), wrapped as the runtime wraps
    a one-replica plan below ZeRO-3 (runtime.parallel.apply_data_parallel: units of a bucket's
    layers and the root on a one-dimensional mesh, parameters in the compute dtype, reductions in
    fp32): the reduce is the last micro-batch's backward with gradient sync on less one with it
    off (its fp32 accumulated gradients copied; a reduce every micro-batch copies 16-bit ones, a little less),
    the gather the first forward after the parameters were resharded less a forward on whole ones;
    the medians over FSDP_ROUNDS rounds of three micro-batches after the first (0 where the
    difference drowns in noise; measured once, not again in the second pass). Each rank times its
    own one-rank group, all at once, as a run's ranks share the cores. On a 2-core Zen 5 EPYC
    (`python benchmarks/fsdp_sync_cost.py`, 2026-11-28, 10.2M parameters) the bf16 reduce took
    0.7-0.9 ns a parameter and the gather 0.35-0.5, and this measurement inside `planner profile`
    0.65-0.87 and 0.32-0.46;
    the cost model had priced both at nothing (costmodel.rank_time.one_replica_fsdp_s)."""
    from torch.distributed.device_mesh import DeviceMesh
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]   # every rank creates every group
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], device.type)
    h = FSDP_HIDDEN[device.type]
    out = {}
    for name in _measured_dtypes(dtypes):
        model = fsdp_stack(h, FSDP_LAYERS, DTYPES[name], mesh, device)
        x = torch.randn(FSDP_TOKENS, h, device=device)
        rounds = [fsdp_round(model, x, device) for _ in range(FSDP_ROUNDS)][1:]
        params = sum(p.numel() for p in model.parameters())
        for kind, (a, b) in (("reduce", ("synced backward", "unsynced backward")),
                             ("gather", ("first forward", "later forward"))):
            seconds = float(np.median([r[a] - r[b] for r in rounds]))
            out[fsdp_sync_key(kind, name)] = max(0.0, seconds) / params
        del model, x
        gc.collect()   # FSDP's hooks hold the model in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for group in groups:
        dist.destroy_process_group(group)
    return out


def fsdp_stack(hidden: int, layers: int, dtype: torch.dtype, mesh, device: torch.device,
               vocab: int = 0) -> torch.nn.Module:
    """`layers` GPT-shaped linear stacks (QKV, output, FFN up and down: 14 hidden^2 parameters
    each), and an output projection to `vocab` words if any, under FSDP2 as
    runtime.parallel.apply_data_parallel wraps a one-replica plan below ZeRO-3: units of a
    bucket's layers (costmodel.params.bucket_layers: on a CPU's stack all in the root, on a GPU's
    a layer each) and the root on `mesh`, parameters kept whole after the forward, in `dtype`,
    reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    h = hidden
    stack = [torch.nn.Sequential(*[torch.nn.Linear(a, b, device=device)
                                   for a, b in ((h, 3 * h), (3 * h, h), (h, 4 * h), (4 * h, h))])
             for _ in range(layers)]
    model = torch.nn.Sequential(*stack, *([torch.nn.Linear(h, vocab, device=device)] if vocab else []))
    mp = MixedPrecisionPolicy() if dtype == torch.float32 else \
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    from runtime.parallel import shard_layer_units
    shard_layer_units(stack, bucket_layers(sum(p.numel() for p in stack[0].parameters()), 1), mesh=mesh,
                      reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def fsdp_round(model, x: torch.Tensor, device: torch.device, micro_batches: int = 3) -> dict[str, float]:
    """Seconds of the "first forward" (after the parameters were resharded), a "later forward",
    an "unsynced backward" (the second micro-batch's) and the "synced backward" (the last's,
    gradient sync on, as runtime.train sets it) of `micro_batches` micro-batches; then the
    parameters resharded and the gradients dropped, as a step's end leaves them."""
    sync = _sync(device)
    times = []
    for k in range(micro_batches):
        final = k == micro_batches - 1
        model.set_requires_gradient_sync(final)
        model.set_reshard_after_backward(final)
        sync()
        t0 = time.perf_counter()
        y = model(x)
        sync()
        t1 = time.perf_counter()
        y.float().square().mean().backward()
        sync()
        times.append((t1 - t0, time.perf_counter() - t1))
    model.zero_grad(set_to_none=True)
    return {"first forward": times[0][0], "later forward": times[1][0], "unsynced backward": times[1][1],
            "synced backward": times[-1][1]}


DROPOUT_ELEMENTS = 1 << 20


def dropout_s_per_element(device: torch.device) -> float:
    """Seconds per element of torch's dropout as the runtime calls it (`F.dropout`, p 0.1, fp32,
    best of three): on a CPU it draws a mask (`bernoulli_`, each random number in software), scales
    it and multiplies: 9.6-10.2 ns an element on a 2-core EPYC (2026-11-27, one thread; its
    `bernoulli_` alone 5.9-8.5), some 40x an elementwise add, where the cost model had priced
    dropout as the multiply's bytes alone and a GPT-style model's plans 18-35 % too fast
    (benchmarks/closed_loop.py --model held-out-gpt, run AH). 0 on a GPU: CUDA's dropout (`native_dropout`) draws inside the multiply's kernel, whose bytes
    the memory-bound count already prices."""
    if device.type == "cuda":
        return 0.0
    x = torch.randn(DROPOUT_ELEMENTS, device=device)
    return best_s(lambda: F.dropout(x, DROPOUT_P, training=True), repeat=3, sync=_sync(device)) / DROPOUT_ELEMENTS


def gelu_s_per_element(device: torch.device) -> dict[str, list[float]]:
    """On a CPU, torch's GeLU (`F.gelu`, fp32) per element, forward and backward (forward +
    backward less the forward), per approximation: {"tanh": [fwd, bwd], "none": [...]}. Its
    transcendental work, not its bytes, bounds it there: tanh's 1.7-2.0 ns an element forward and
    4.0 with its backward against an add's 0.14-0.2 (2-core EPYC, one thread, 2026-11-27 15:21:
    `python benchmarks/cpu_kernels.py --only 5`). Empty on a GPU, where it is memory-bound
    like the other elementwise kernels."""
    if device.type == "cuda":
        return {}
    x = torch.randn(DROPOUT_ELEMENTS, device=device)
    xg, grad = x.clone().requires_grad_(True), torch.ones_like(x)
    out = {}
    for approximate in GELU_APPROXIMATIONS:
        fwd = best_s(lambda: F.gelu(x, approximate=approximate))
        # autograd.grad: the gradient alone, as the MLP's backward takes it (.backward() would
        # add it into xg.grad, one more pass over the elements)
        both = best_s(lambda: torch.autograd.grad(F.gelu(xg, approximate=approximate), xg, grad))
        out[approximate] = [fwd / DROPOUT_ELEMENTS, backward_s(both, fwd) / DROPOUT_ELEMENTS]
    return out


def backward_s(forward_and_backward_s: float, forward_s: float) -> float:
    """A backward's time from best-of timings of the forward with it and alone, floored at a
    tenth of the forward (two best-of timings can cross)."""
    return max(forward_and_backward_s - forward_s, 0.1 * forward_s)


# (batch, heads, sequence, head dim) as GPU plans run them: FlashAttention's share of the GEMM
# rate grows with the sequence and head dim (FA2 paper, fig. 4), so the small shapes alone
# would misprice a 2-8K sequence
GPU_ATTENTION_SHAPES = ((2, 16, 1024, 128), (1, 16, 2048, 128), (1, 16, 4096, 128), (1, 32, 8192, 128))


# (batch, heads, sequence, head dim) of a CPU's SDPA points: each sequence at two head dims (the
# time per pair is not proportional to the dim, costmodel.kernels.sdpa_head_s), from debug-tiny's
# 32 to a 1k sequence; batch x heads large enough that a call's own cost is a small part of it
CPU_SDPA_SHAPES = tuple((b, h, s, d) for b, h, s in ((8, 4, 32), (2, 4, 128), (1, 4, 256), (1, 8, 512), (2, 8, 1024))
                        for d in (16, 64))
# the two shortest sequences are measured whatever the budget: the pricing's least, a per-pair time
# that moves with the sequence and with the head dim
SDPA_ALWAYS_SEQ = sorted({s for _, _, s, _ in CPU_SDPA_SHAPES})[1]


def sdpa_curves(name: str, device: torch.device, phase_s: float, point_s: float,
                shapes: tuple[tuple[int, int, int, int], ...] | None = None) -> dict[str, list]:
    """On a CPU, causal SDPA as the runtime calls it, timed outright rather than priced from the
    GEMM curve: its backward took 2.9-3.3x its forward here where FlashAttention's FLOP count
    says 2.5x, bf16's ran at fp32's speed where its GEMMs run faster (and its backward at a 128
    sequence 5-6x fp32's at head dim 16: `--only 8`), and with dropout torch runs its math path,
    3-6x the flash kernel's forward (2-core EPYC, 2026-11-27: `python benchmarks/cpu_kernels.py
    --only 5`).
    Per sequence the budget allows (the two shortest always), every head dim of it, without
    dropout and with the runtime's, the forward alone and the backward (forward + backward less
    the forward): (sequence, head dim, seconds per head), keyed costmodel.hardware.sdpa_key."""
    keys = {(drop, back): sdpa_key(name, drop, back) for drop in (False, True) for back in (False, True)}
    out: dict[str, list] = {k: [] for k in keys.values()}
    start = time.perf_counter()
    by_seq: dict[int, list[tuple[int, int, int, int]]] = {}
    for shape in CPU_SDPA_SHAPES if shapes is None else shapes:
        by_seq.setdefault(shape[2], []).append(shape)
    for s, group in by_seq.items():
        # a sequence whole or not at all (a lone head dim would price the other in proportion);
        # at the times just measured: each pass's best_s calls the forward alone, then with the
        # backward, CALLS_PER_POINT times each. Every rank agrees on the shapes and the verdict.
        if s > SDPA_ALWAYS_SEQ:
            expected = CALLS_PER_POINT * sum((2 if "forward" in k else 1) * b * h * sdpa_head_s(tuple(sorted(v)), s, d)
                                             for k, v in out.items() for b, h, _, d in group)
            if _agree(_over(expected, start, phase_s, point_s * len(out) * len(group))):
                break
        for b, h, _, d in group:
            _sdpa_point(name, device, (b, h, s, d), out, keys)
    return out


def _sdpa_point(name: str, device: torch.device, shape: tuple[int, int, int, int], out: dict, keys: dict) -> None:
    """One shape's four points (forward, backward; without dropout and with) appended to `out`."""
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, dtype=DTYPES[name], device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, dtype=DTYPES[name], device=device)
    for drop in (False, True):
        p = DROPOUT_P if drop else 0.0
        fwd = best_s(lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), dropout_p=p,
                                                            is_causal=True))
        both = best_s(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True), (q, k, v), grad))
        out[keys[drop, False]].append((s, d, fwd / (b * h)))
        out[keys[drop, True]].append((s, d, backward_s(both, fwd) / (b * h)))


def sdpa_gemm_ratio(forward: list[tuple[float, float, float]], gemm: tuple[tuple[float, float], ...]) -> float:
    """attention_efficiency's figure from a CPU's forward SDPA points: what [efficiency] attention
    still holds there, though the pricing reads the points. Per point past the always-measured
    sequences' shortest (whose calls are mostly their own cost), a causal call's half of its
    4·b·h·s²·d FLOPs over its time against the GEMM rate at those FLOPs (b·h of the shape the
    point was timed at, CPU_SDPA_SHAPES); the median over them."""
    heads = {(s, d): b * h for b, h, s, d in CPU_SDPA_SHAPES}
    longer = [p for p in forward if p[0] >= SDPA_ALWAYS_SEQ] or forward
    return float(np.median([2.0 * s * s * d / t / interpolate(gemm, 2.0 * heads[s, d] * s * s * d)
                            for s, d, t in longer]))


def attention_efficiency(dtype: torch.dtype, device: torch.device, gemm: tuple[tuple[float, float], ...],
                         phase_s: float, point_s: float) -> float:
    """On a GPU: causal SDPA rate over the GEMM rate at the same FLOPs (counting the half a causal
    kernel computes), the median over the shapes the budget allows (the smallest always), each
    shape's ratio divided by the flash kernel's tile efficiency at its length
    (costmodel.kernels.flash_tile_efficiency), which the pricing applies per plan: the profile
    holds a long sequence's ratio, as the datasheet profiles do. (A CPU's SDPA is timed outright:
    sdpa_curves.)"""
    start, ratios = time.perf_counter(), []
    for b, h, s, d in GPU_ATTENTION_SHAPES:
        tile = flash_tile_efficiency(s)
        flops = 0.5 * 4.0 * b * h * s * s * d
        expected = CALLS_PER_POINT * flops / (interpolate(gemm, flops) * min(ratios) * tile) if ratios else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            break
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device) for _ in range(3))
        t = best_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), **_timed(device))
        ratios.append(flops / t / interpolate(gemm, flops) / tile)
    return float(np.median(ratios))


def collective_worker(sizes: tuple[int, ...], device: torch.device, phase_s: float = float("inf"),
                      point_s: float = float("inf")) -> dict[str, list[tuple[float, float]]] | None:
    """Run inside every rank of an initialised group: (bytes, seconds) per collective, rank 0."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in
                                                 ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    sync = _sync(device)
    start = time.perf_counter()
    for size in sizes:
        n = max(world, size // 4 // world * world)
        last = [t for v in out.values() for _, t in v[-1:]]
        # 6 calls per collective kind (best of 5 after one), times the growth of the message
        expected = 6 * sum(last) * 4 if last else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            break
        full = torch.ones(n, device=device)
        shard = torch.ones(n // world, device=device)
        dist.barrier()
        out["all_reduce"].append((n * 4.0, best_s(lambda: dist.all_reduce(full), 5, sync)))
        out["all_gather"].append((n * 4.0, best_s(lambda: dist.all_gather_into_tensor(full, shard), 5, sync)))
        out["reduce_scatter"].append((n * 4.0, best_s(lambda: dist.reduce_scatter_tensor(shard, full), 5, sync)))

        def ping() -> None:
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)
        out["p2p"].append((n * 4.0, best_s(ping, 5, sync) / 2))
    return out if rank == 0 else None


def _device(device_type: str) -> torch.device:
    device = torch.device(device_type, dist.get_rank() if device_type == "cuda" else 0)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    return device


def measure_rank(dtypes: list[str], device_type: str, threads: int, budget: Budget, report,
                 layer: LayerProbe | None = None) -> dict | None:
    """Every microbenchmark, on every rank of an initialised group at once: each rank is one
    "device" of the node and shares cores, caches and memory bandwidth with the others, as ranks
    of a run do. A barrier before each phase keeps the ranks measuring together; rank 0's figures
    are returned (and its progress reported through `report(phase, fraction, what)`). On a CPU
    they are a first pass: its GEMM points in the shapes' order and `second_pass_limit_s`, for the
    caller to hand to second_pass_rank (or, where nothing is left for one, sorted and no limit).
    `layer`: on a CPU, the layer whose kernels are timed in training (layer_ops)."""
    torch.set_num_threads(threads)
    device = _device(device_type)
    lead = dist.get_rank() == 0
    say = (lambda phase: (lambda frac, what: report(phase, frac, what))) if lead else \
        (lambda phase: (lambda frac, what: None))
    # a GPU's attention ratios are a long sequence's (attention_efficiency)
    out: dict = {"gemm": {}, "attention": {}, "attention_long_sequence": device.type == "cuda"}
    shapes, fp32, spent_s = gemm_shapes(device.type), (), 0.0
    curves_start = time.perf_counter()
    for i, name in enumerate(dtypes):
        dist.barrier()
        # an even share of what is left of the GEMM phase for each dtype still to measure
        share_s = (budget.phase_s("gemm") - spent_s) / (len(dtypes) - i)
        t0 = time.perf_counter()
        curve = gemm_curve(shapes, DTYPES[name], device, share_s, budget.point_s, fp32, say(f"gemm {name}"))
        spent_s += time.perf_counter() - t0
        out["gemm"][name] = curve
        fp32 = tuple(sorted(curve.points)) if name == "fp32" else fp32   # interpolate's order
    dist.barrier()
    out["memory"] = memory_curve(device, budget.phase_s("memory"), budget.point_s, say("memory"))
    out["sdpa"] = {}
    for name in dtypes:
        dist.barrier()
        share_s, gemm = budget.phase_s("attention") / len(dtypes), tuple(sorted(out["gemm"][name].points))
        if device.type == "cuda":
            out["attention"][name] = attention_efficiency(DTYPES[name], device, gemm, share_s, budget.point_s)
        else:
            curves = sdpa_curves(name, device, share_s, budget.point_s)
            out["sdpa"].update(curves)
            out["attention"][name] = sdpa_gemm_ratio(curves[sdpa_key(name, False, False)], gemm)
        say("attention")(1.0, f"attention {name}")
    if device.type == "cpu" and layer is not None:
        out["layer_ops"] = layer_ops(layer, out["gemm"], say("attention"))
    first_pass_s = time.perf_counter() - curves_start   # the curves' time: what a second pass may take again
    dist.barrier()
    out.update(per_unit_costs(device, dtypes))
    if dist.get_world_size() > 1:
        with warnings.catch_warnings():   # gloo's *_tensor collectives are "deprecated" in 2.13, still the API
            warnings.simplefilter("ignore", FutureWarning)
            out["collectives"] = collective_worker(COLLECTIVE_BYTES, device, budget.phase_s("collectives"),
                                                   budget.point_s)
        say("collectives")(1.0, f"collectives on {dist.get_world_size()} ranks")
    # a CPU's second pass (second_pass_rank, after the probes) draws on what the first left of
    # the curves' shares of the budget; until then the GEMM points stay in the shapes' order, by
    # which best_of pairs the passes' points
    limit_s = min(SECOND_PASS_SLACK * first_pass_s, sum(budget.phase_s(k) for k in CURVE_PHASES) - first_pass_s)
    if device.type == "cpu" and limit_s > 0:
        out["second_pass_limit_s"] = limit_s
    else:
        out["gemm"] = sorted_gemm(out["gemm"])
    return out if lead else None


def layer_ops(layer: LayerProbe, gemm: dict[str, Curve], report) -> dict[str, dict]:
    """The probe layer's kernels timed by kind in each measured dtype, on every rank at once
    (the curves are measured so; a fraction of a second a dtype)."""
    out = {}
    for name, curve in gemm.items():
        dist.barrier()
        model = layer.model if curve.accelerated else layer.small
        seconds = layer_op_seconds(model, DTYPES[name], layer.micro_batch_size, layer.seq_len)
        out[name] = {"model": model.name, "micro_batch_size": layer.micro_batch_size, "seq_len": layer.seq_len,
                     **{f"{k}_s": v for k, v in seconds.items()}}
        report(1.0, f"layer kernels {name}")
    return out


def faster_layer_ops(first: dict[str, dict], second: dict[str, dict]) -> dict[str, dict]:
    """Two passes' layer_ops, each kind at the faster pass (as best_of keeps each curve point)."""
    return {name: {k: min(v, second[name][k]) if k.endswith("_s") else v for k, v in ops.items()}
            for name, ops in first.items()}


def sorted_gemm(gemm: dict[str, Curve]) -> dict[str, Curve]:
    return {k: replace(c, points=tuple(sorted(c.points))) for k, c in gemm.items()}


def second_pass_rank(micro: dict, threads: int, point_s: float, limit_s: float, report,
                     layer: LayerProbe | None = None) -> dict | None:
    """second_pass on every rank of an initialised group at once (as measure_rank measured the
    first), on rank 0's first-pass figures `micro`; rank 0's result is returned, its GEMM points
    sorted."""
    torch.set_num_threads(threads)
    device = _device("cpu")
    out = {**micro, "gemm": dict(micro["gemm"]), "sdpa": dict(micro["sdpa"]),
           "attention": dict(micro["attention"])}
    lead = dist.get_rank() == 0
    say = report if lead else (lambda frac, what: None)
    second_pass(out, list(out["gemm"]), gemm_shapes("cpu"), device, point_s, limit_s, say)
    if layer is not None and "layer_ops" in out:
        out["layer_ops"] = faster_layer_ops(out["layer_ops"], layer_ops(layer, out["gemm"], say))
    out["gemm"] = sorted_gemm(out["gemm"])
    return out if lead else None


# A CPU shared with other tenants slows by 20-50 % for one to several seconds at a time
# (`python benchmarks/cpu_steadiness.py --seconds 240`, 2-core EPYC, 2026-11-27 16:40: a
# 512x1024x1024 GEMM per core held 88-95 GFLOP/s, with 1-7 s stretches at 65-75 and one at 48,
# each core on its own; at 17:02, 90 s saw three slow seconds). A profile whose fp32 GEMMs fell in such a stretch priced
# every fp32 plan of closed loop BJ 8-37 % slow (its largest GEMMs at 50-75 GFLOP/s); BH's curve
# from the same machine in its place: MAPE 14.4 -> 6.3 %, max 36.8 -> 11.8 %. So on a CPU each
# curve and the per-operator, dropout and GeLU costs are measured twice, and each point keeps
# the faster pass: a stretch rarely spans both, and best-of is what each point already keeps (a
# whole profile in a slow stretch is not caught: the runs then beat it). The second pass runs
# after the probes, some 25 s after the first: 10 s apart, closed loop BO's fp32 GEMMs measured
# 55-65 GFLOP/s in both passes where the runs minutes later went at the usual 90-100 (2026-11-27
# 20:06). It may take this much of the first's time (it measures the same points, so it needs
# more only when slowed).
SECOND_PASS_SLACK = 1.25


def per_unit_costs(device: torch.device, dtypes: list[str]) -> dict:
    """The profile's per-operator, per-parameter and per-element costs (seconds)."""
    return {"overhead_s": op_overhead_s(device), "optimizer_s_per_param": optimizer_s_per_param(device),
            "grad_accumulate_s_per_param": grad_accumulate_s_per_param(device, dtypes),
            "fsdp_sync_s_per_param": fsdp_sync_s_per_param(device, dtypes),
            "dropout_s_per_element": dropout_s_per_element(device),
            "gelu_s_per_element": gelu_s_per_element(device)}


def best_of(first, second) -> tuple[tuple[float, float], ...]:
    """(size, rate) points of two passes over the same sizes in the same order, each at the
    faster; the first's points beyond the second's end (a budget stopped it) as they were."""
    out = list(first)
    for i, ((x, rate), (x2, rate2)) in enumerate(zip(first, second)):
        if x != x2:
            raise ValueError(f"second pass point {i} is at size {x2}, the first's at {x}")
        out[i] = (x, max(rate, rate2))
    return tuple(out)


def best_pass(first: tuple[list, list], second: tuple[list, list]) -> tuple[list, list]:
    """A forward SDPA curve and its backward (a difference of two timings, backward_s) from two
    passes: per point, both from the pass whose forward and backward together were faster. The
    faster of each alone could pair a pass whose forward alone fell in a slow stretch, its
    backward too cheap, with the other pass's forward."""
    fwd, bwd = list(first[0]), list(first[1])
    for i, ((s, d, f2), (_, _, b2)) in enumerate(zip(*second)):
        (s1, d1, f1), (_, _, b1) = fwd[i], bwd[i]
        if (s, d) != (s1, d1):
            raise ValueError(f"second pass point {i} is at sequence {s}, head dim {d}; the first's at {s1}, {d1}")
        if f2 + b2 < f1 + b1:
            fwd[i], bwd[i] = (s, d, f2), (s, d, b2)
    return fwd, bwd


def second_pass(out: dict, dtypes: list[str], shapes, device: torch.device, point_s: float, limit_s: float,
                report) -> None:
    """Measure measure_rank's curves again, the points the first pass measured and no more, and
    keep each point's faster pass in `out` (SECOND_PASS_SLACK): within limit_s, except that the
    SDPA shapes of the two shortest sequences are always measured, and the per-operator, dropout
    and GeLU costs after them (a fraction of a second). The optimizer's and the gradient
    accumulation's costs are means over page placements by design (optimizer_s_per_param): the
    faster of two would pick placements, so they are not measured again; nor FSDP's one-rank costs,
    medians of their own (fsdp_sync_s_per_param), a second of the profile's budget each time."""
    start = time.perf_counter()

    def left_s() -> float:
        return max(limit_s - (time.perf_counter() - start), 0.0)

    for i, name in enumerate(dtypes):
        dist.barrier()
        first = out["gemm"][name]
        again = gemm_curve(shapes[:len(first.points)], DTYPES[name], device, left_s(),
                           point_s if first.accelerated else point_s / 4)
        out["gemm"][name] = replace(first, points=best_of(first.points, again.points))
        report(0.5 * (i + 1) / len(dtypes), f"GEMM {name} again")
    dist.barrier()
    first = out["memory"]
    again = memory_curve(device, left_s(), point_s, lambda frac, what: None, count=len(first.points))
    out["memory"] = replace(first, points=best_of(first.points, again.points))
    for i, name in enumerate(dtypes):
        dist.barrier()
        key = sdpa_key(name, False, False)
        again = sdpa_curves(name, device, left_s(), point_s, CPU_SDPA_SHAPES[:len(out["sdpa"][key])])
        for drop in (False, True):
            f, b = sdpa_key(name, drop, False), sdpa_key(name, drop, True)
            out["sdpa"][f], out["sdpa"][b] = best_pass((out["sdpa"][f], out["sdpa"][b]), (again[f], again[b]))
        out["attention"][name] = sdpa_gemm_ratio(out["sdpa"][key], tuple(sorted(out["gemm"][name].points)))
        report(0.5 + 0.45 * (i + 1) / len(dtypes), f"attention {name} again")
    dist.barrier()
    out["overhead_s"] = min(out["overhead_s"], op_overhead_s(device))
    out["dropout_s_per_element"] = min(out["dropout_s_per_element"], dropout_s_per_element(device))
    gelu = gelu_s_per_element(device)
    out["gelu_s_per_element"] = {k: min(v, gelu[k], key=sum) for k, v in out["gelu_s_per_element"].items()}
    report(1.0, "per-unit costs again")


def probe_rank(plans: list, threads: int, phase_s: float, report) -> list[dict | None]:
    """Training steps of small plans on this group (the plans of its world size), so the profile
    holds what a step adds to its kernels: autograd and module overhead per kernel, collectives
    inside FSDP / DTensor / pipelining, how much communication hides. PROBE_WARMUP warm-up and
    PROBE_STEPS timed steps each, the median kept; plans the phase budget leaves no time for are skipped
    (None) on every rank."""
    from runtime.train import RunConfig, run_rank   # the runtime's own step, as `planner run` runs it
    torch.set_num_threads(threads)
    start, results = time.perf_counter(), []
    for i, pf in enumerate(plans):
        spent = time.perf_counter() - start
        expected = spent / i if i else 0.0
        if _agree(spent + expected > phase_s):
            results.append(None)
            continue
        with warnings.catch_warnings():   # FSDP's and pipelining's notices are the user's business in a run
            warnings.simplefilter("ignore")
            raw = run_rank(pf, RunConfig(steps=PROBE_STEPS, warmup=PROBE_WARMUP, quiet=True))
        results.append(raw)
        if dist.get_rank() == 0:
            report((i + 1) / len(plans), f"probe step: {pf.plan.short()} {pf.train.compute_dtype}")
    return results


