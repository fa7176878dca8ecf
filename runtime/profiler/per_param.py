"""Costs per parameter and per element that a step adds to its kernels: the AdamW step, the
gradient accumulation, FSDP2's one-rank reduce and gather, dropout and GeLU."""
from __future__ import annotations

import gc
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from costmodel.fsdp_units import bucket_layers
from costmodel.hardware import GELU_APPROXIMATIONS, fsdp_sync_key
from runtime.model import DROPOUT_P
from runtime.optimizer import adamw
from runtime.profiler.attention import backward_s
from runtime.profiler.curves import op_overhead_s
from runtime.profiler.timing import DTYPES, _agree, _sync, best_s

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
    (runtime.optimizer.adamw: fused where torch runs it, fp32 weights; FSDP2 keeps the master weights in
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
        optimizer, _ = adamw(params, lr=1e-4)
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
    curve's kernels write fresh outputs, which an in-place add never touches). The mixed add
    (fp32 += bf16) is not the same kernel at fewer bytes: per byte it runs slower than fp32 +=
    fp32, hence a rate per dtype. The adds inside a training step (`python
    benchmarks/step_trace.py PLAN --steps 2 --rows 400 --shapes` on benchmarks/closed_loop.py's
    one-rank fp32 plan) run a little slower with their per-tensor dispatch: this measurement's
    32 MB may partly sit in a large last-level cache, which the cost model then prices slightly
    fast."""
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
FSDP_MIN_ROUNDS = 2   # the first warms up: one measured at least (a slow dtype's round takes a second)


def fsdp_sync_s_per_param(device: torch.device, dtypes: list[str], phase_s: float = float("inf")) -> dict[str, float]:
    """Seconds per parameter of FSDP2's reduce and gather on a one-rank group, per compute dtype
    ({"reduce.bf16": ..., "gather.bf16": ..., "reduce.fp32": ...}), wrapped as the runtime wraps
    a one-replica plan below ZeRO-3 (runtime.parallel.apply_data_parallel: units of a bucket's
    layers and the root on a one-dimensional mesh, parameters in the compute dtype, reductions in
    fp32): the reduce is the last micro-batch's backward with gradient sync on less one with it
    off (its fp32 accumulated gradients copied; a reduce every micro-batch copies 16-bit ones, a little less),
    the gather the first forward after the parameters were resharded less a forward on whole ones;
    the medians over the rounds of three micro-batches after the first (0 where the difference
    drowns in noise; measured once, not again in the second pass): FSDP_ROUNDS, or as many as an
    even share of `phase_s` per dtype leaves time for, FSDP_MIN_ROUNDS at least. Each rank times its
    own one-rank group, all at once, as a run's ranks share the cores. With no collective on a
    one-rank group these copies are what its sync costs (costmodel.rank_time.one_replica_fsdp_s
    prices them from this)."""
    from torch.distributed.device_mesh import DeviceMesh
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]   # every rank creates every group
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], device.type)
    h = FSDP_HIDDEN[device.type]
    out, names, start = {}, _measured_dtypes(dtypes), time.perf_counter()
    for i, name in enumerate(names):
        model = fsdp_stack(h, FSDP_LAYERS, DTYPES[name], mesh, device)
        x = torch.randn(FSDP_TOKENS, h, device=device)
        rounds = _fsdp_rounds(model, x, device, start + phase_s * (i + 1) / len(names))[1:]
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


def _fsdp_rounds(model, x: torch.Tensor, device: torch.device, end_s: float) -> list[dict[str, float]]:
    """fsdp_round repeated up to FSDP_ROUNDS times while the next round, as long as the last,
    ends before `end_s` (perf_counter), FSDP_MIN_ROUNDS whatever the time; every rank stops
    with the others."""
    rounds, last_s = [], 0.0
    while len(rounds) < FSDP_ROUNDS and not _agree(len(rounds) >= FSDP_MIN_ROUNDS
                                                  and time.perf_counter() + last_s > end_s):
        t0 = time.perf_counter()
        rounds.append(fsdp_round(model, x, device))
        last_s = time.perf_counter() - t0
    return rounds


def fsdp_stack(hidden: int, layers: int, dtype: torch.dtype, mesh, device: torch.device,
               vocab: int = 0) -> torch.nn.Module:
    """`layers` GPT-shaped linear stacks (QKV, output, FFN up and down: 14 hidden^2 parameters
    each), and an output projection to `vocab` words if any, under FSDP2 as
    runtime.parallel.apply_data_parallel wraps a one-replica plan below ZeRO-3: units of a
    bucket's layers (costmodel.fsdp_units.bucket_layers: on a CPU's stack all in the root, on a GPU's
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
    it and multiplies, most of its time in `bernoulli_` and some tens of times an elementwise
    add's: priced as the multiply's bytes alone, dropout would price a GPT-style model's plans
    (benchmarks/closed_loop.py --model held-out-gpt) too fast. 0 on a GPU: CUDA's dropout
    (`native_dropout`) draws inside the multiply's kernel, whose bytes the memory-bound count
    already prices."""
    if device.type == "cuda":
        return 0.0
    x = torch.randn(DROPOUT_ELEMENTS, device=device)
    return best_s(lambda: F.dropout(x, DROPOUT_P, training=True), repeat=3, sync=_sync(device)) / DROPOUT_ELEMENTS


def gelu_s_per_element(device: torch.device) -> dict[str, list[float]]:
    """On a CPU, torch's GeLU (`F.gelu`, fp32) per element, forward and backward (forward +
    backward less the forward), per approximation: {"tanh": [fwd, bwd], "none": [...]}. Its
    transcendental work, not its bytes, bounds it there: about ten times an add's time an
    element. Empty on a GPU, where it is memory-bound like the other elementwise kernels."""
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


def per_unit_costs(device: torch.device, dtypes: list[str], phase_s: float = float("inf")) -> dict:
    """The profile's per-operator, per-parameter and per-element costs (seconds); FSDP's one-rank
    costs, the only ones that take seconds, within what `phase_s` leaves of the others."""
    start = time.perf_counter()
    out = {"overhead_s": op_overhead_s(device), "optimizer_s_per_param": optimizer_s_per_param(device),
           "grad_accumulate_s_per_param": grad_accumulate_s_per_param(device, dtypes),
           "dropout_s_per_element": dropout_s_per_element(device),
           "gelu_s_per_element": gelu_s_per_element(device)}
    left_s = phase_s - (time.perf_counter() - start)
    return {**out, "fsdp_sync_s_per_param": fsdp_sync_s_per_param(device, dtypes, left_s)}
