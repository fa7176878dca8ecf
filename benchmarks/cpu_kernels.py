"""The CPU kernel figures the cost model's CPU pricing rests on (costmodel.compute
`CPU_ELEMENT_BYTES`, `cross_entropy_s`; the README's closed-loop section), measured on this
machine with one thread, as `planner run` gives each CPU rank:

    python benchmarks/cpu_kernels.py

1. An elementwise multiply and a SiLU in bf16 against fp32, per element, at 98K-1.5M elements:
   a ratio near 1 means a 16-bit element costs what an fp32 one does (elements counted at fp32's
   width).
2. The loss as the runtime takes it (`F.cross_entropy(logits.float())`, forward and backward) over
   256 tokens x 6,000 words, the closed loop's hidden model, fresh logits every call.
3. bf16 and fp32 `linear` rates over 128-2,048 rows for the hidden model's MLP and head weights,
   and a fresh bf16 weight every call (as FSDP's cast makes one each step) against the same one.
4. A full recomputation of the hidden model's four layers (1,024 tokens a micro-batch) as the
   runtime checkpoints them (`runtime.parallel.apply_recompute`), with torch's early stop (its
   default) and without: the recomputed forward's own time against the plain model's training
   forward, which the cost model prices (costmodel.frameworks `recompute_early_stop`), and,
   noisier, the step's extra time over the plain step in units of that forward. The three
   alternate step by step, medians of 6 after 2.
5. What the held-out GPT model (benchmarks/closed_loop.py --model held-out-gpt) runs beside its
   GEMMs, per element against an add (median of 30): `F.dropout` (p 0.1) and its `bernoulli_`
   draw over 512 x 320 (costmodel.compute.dropout_s), tanh GeLU over 512 x 1,280 and LayerNorm
   over 512 x 320, forward and forward + backward (priced as bytes); then causal SDPA forward
   and forward + backward at 2 x heads x 256 x head dim, with dropout 0.1 and without, for that
   model's 4 heads of 80 and the hidden model's 6 of 64 (median of 10).

6. Context parallelism's attention as the runtime calls it on a rank of cp 2 (two chunk calls
   under a lower-right causal mask) against one causal call over the whole sequence, with and
   without dropout: the measured SDPA curves (causal calls) price the chunks by their query-key
   pairs (costmodel.compute `_measured_sdpa_s`).

7. The profile's GEMM curve times `a @ b`; training runs a linear's forward and its two backward
   GEMMs in other layouts: their rates, fp32 and bf16, at the probes' and the models' shapes.

8. Causal SDPA per query-key pair, forward and backward, by sequence (128-512) and head dim
   (16-80), fp32 and bf16: the time per pair falls with the sequence and does not grow in
   proportion to the head dim (costmodel.compute.sdpa_head_s).

    python benchmarks/cpu_kernels.py [--only 5]        # one or more sections
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from costmodel.compute import cp_chunk_scores
from costmodel.plan import Recompute
from runtime.model import Transformer
from runtime.parallel import apply_recompute


def best_s(fn, repeat: int = 20, pick=min) -> float:
    """`pick` (the best, by default) of `repeat` timed calls after one untimed."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return pick(times)


def elementwise() -> None:
    print("1. elementwise, bf16 time over fp32 time at equal elements")
    for elems in (98_304, 262_144, 1_536_000):
        ratios = {}
        for name, op in (("mul", lambda x, y: x * y), ("silu", lambda x, y: F.silu(x))):
            t = {}
            for dt in (torch.float32, torch.bfloat16):
                x, y = torch.randn(elems, dtype=dt), torch.randn(elems, dtype=dt)
                t[dt] = best_s(lambda: op(x, y))
            ratios[name] = t[torch.bfloat16] / t[torch.float32]
        print(f"   {elems:>9,} elements: mul {ratios['mul']:.2f}x, silu {ratios['silu']:.2f}x")


def loss() -> None:
    print("2. cross entropy forward + backward, 256 tokens x 6,000 words (median of 30, fresh logits)")
    labels = torch.randint(0, 6000, (256,))
    for dt in (torch.float32, torch.bfloat16):
        times = []
        for _ in range(30):
            logits = torch.randn(256, 6000, dtype=dt, requires_grad=True)
            start = time.perf_counter()
            F.cross_entropy(logits.float(), labels).backward()
            times.append(time.perf_counter() - start)
        print(f"   {str(dt)[6:]:>8}: {statistics.median(times) * 1e3:.2f} ms")


def linears() -> None:
    print("3. linear rates, GFLOP/s, by rows (k x n the weight)")
    for k, n in ((384, 1024), (384, 6000), (1024, 384)):
        for rows in (128, 256, 512, 1024, 2048):
            a32, w32 = torch.randn(rows, k), torch.randn(n, k)
            a16, w16 = a32.bfloat16(), w32.bfloat16()
            flops = 2 * rows * k * n
            fp32 = flops / best_s(lambda: F.linear(a32, w32), 5) / 1e9
            bf16 = flops / best_s(lambda: F.linear(a16, w16), 5) / 1e9
            fresh = [w32.bfloat16() for _ in range(6)]
            fresh_s = min(best_s(lambda w=w: F.linear(a16, w), 1) for w in fresh)
            same_s = best_s(lambda: F.linear(a16, w16), 5)
            print(f"   {k}x{n} rows {rows:>5}: bf16 {bf16:6.1f}, fp32 {fp32:6.1f}; "
                  f"a fresh bf16 weight {fresh_s / same_s:.2f}x the time")


def _hidden_model():
    """The closed loop's hidden model (benchmarks/closed_loop.py HIDDEN), read as `planner` reads it."""
    import json
    import tempfile
    from pathlib import Path

    from closed_loop import HIDDEN as CONFIG   # benchmarks/ is on the path when run as a script
    from costmodel.hf_config import model_from_hf_config
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIG))
        return model_from_hf_config(path)


class _FullRecompute:   # what apply_recompute reads of a plan
    recompute = Recompute.FULL


def _timed_layers(model: Transformer, seconds: dict[str, float], phase: dict[str, str]) -> None:
    """Each layer's forward timed into seconds[phase["now"]] (its first run and its recomputation,
    which torch's early stop ends with an exception inside the layer)."""
    for layer in model.layers.values():
        def timed(x, forward=layer.forward):
            start = time.perf_counter()
            try:   # an early-stopping recomputation leaves the layer by an exception
                return forward(x)
            finally:
                seconds[phase["now"]] += time.perf_counter() - start
        layer.forward = timed


def _recompute_steps(model_spec, dtype: torch.dtype) -> dict[str, tuple[float, float, float]]:
    """Per variant (plain, early stop on, early stop off), the medians of (step, layers' forward,
    recomputed forward) seconds; the variants alternate step by step, so the machine's drift
    (10-30 % over minutes here) falls on all three alike."""
    variants = {"plain": None, "on": True, "off": False}
    models, clocks = {}, {}
    for name, early_stop in variants.items():
        model = Transformer(model_spec)
        model.init_weights(0)
        model = model.to(dtype)
        clocks[name] = ({"forward": 0.0, "again": 0.0}, {"now": "forward"})
        _timed_layers(model, *clocks[name])
        if early_stop is not None:
            apply_recompute(model, _FullRecompute, list(range(model_spec.num_layers)))
        models[name] = model
    tokens = torch.randint(0, model_spec.vocab_size, (4, 256))
    rows = {name: [] for name in variants}
    for step in range(8):
        for name, model in models.items():
            seconds, phase = clocks[name]
            seconds.update(forward=0.0, again=0.0)
            phase["now"] = "forward"
            start = time.perf_counter()
            with torch_checkpoint.set_checkpoint_early_stop(variants[name] is not False):   # read as each checkpoint starts
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
            phase["now"] = "again"
            loss.backward()
            if step >= 2:
                rows[name].append((time.perf_counter() - start, seconds["forward"], seconds["again"]))
            model.zero_grad(set_to_none=True)
    return {name: tuple(statistics.median(col) for col in zip(*r)) for name, r in rows.items()}


def recompute() -> None:
    print("4. full recomputation of four layers, 1,024 tokens: the recomputed forward against a training forward")
    spec = _hidden_model()
    for dt in (torch.float32, torch.bfloat16):
        med = _recompute_steps(spec, dt)
        plain, forward = med["plain"][0], med["plain"][1]   # the forward the cost model prices
        again = {k: med[k][2] / forward for k in ("on", "off")}
        extra = {k: (med[k][0] - plain) / forward for k in ("on", "off")}
        print(f"   {str(dt)[6:]:>8}: recomputed {again['on']:.2f}x the layers' training forward "
              f"({forward * 1e3:.0f} ms) with torch's early stop, {again['off']:.2f}x without; the step's "
              f"extra time over the plain step ({plain * 1e3:.0f} ms) {extra['on']:.2f}x and {extra['off']:.2f}x")


def median_s(fn, repeat: int = 30) -> float:
    return best_s(fn, repeat, pick=statistics.median)


def gpt_kernels() -> None:
    print("5. per element against an add (ns), the held-out GPT model's memory-bound work")
    for dt in (torch.float32, torch.bfloat16):
        x, y = torch.randn(512, 320, dtype=dt), torch.randn(512, 320, dtype=dt)
        h = torch.randn(512, 1280, dtype=dt, requires_grad=True)
        xg = torch.randn(512, 320, dtype=dt, requires_grad=True)
        norm = torch.nn.LayerNorm(320).to(dt)
        per = lambda t, n: f"{t / n * 1e9:.2f}"  # noqa: E731
        add = median_s(lambda: x + y)
        dropout = median_s(lambda: F.dropout(x, 0.1, training=True))
        draw = median_s(lambda: torch.empty_like(x).bernoulli_(0.9))
        gelu = median_s(lambda: F.gelu(h.detach(), approximate="tanh"))
        # autograd.grad: the gradients alone, as a layer's backward takes them (.backward() would
        # add them into .grad, one more pass)
        gelu_both = median_s(lambda: torch.autograd.grad(F.gelu(h, approximate="tanh"), h, torch.ones_like(h)))
        ln = median_s(lambda: norm(xg.detach()))
        ln_both = median_s(lambda: torch.autograd.grad(norm(xg), (xg, *norm.parameters()), torch.ones_like(xg)))
        print(f"   {str(dt)[6:]:>8}: add {per(add, x.numel())}, dropout {per(dropout, x.numel())} "
              f"(its draw {per(draw, x.numel())}), GeLU {per(gelu, h.numel())} / {per(gelu_both, h.numel())} "
              f"with backward, LayerNorm {per(ln, xg.numel())} / {per(ln_both, xg.numel())}")
    print("   causal SDPA, 2 x heads x 256 x head dim (ms, median of 10): forward, forward + backward")
    for heads, dim in ((4, 80), (6, 64)):
        for dt in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(2, heads, 256, dim, dtype=dt, requires_grad=True) for _ in range(3))
            cells = []
            for p in (0.0, 0.1):
                fwd = median_s(lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(),
                                                                      dropout_p=p, is_causal=True), 10)
                both = median_s(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
                                .sum().backward(), 10)
                cells.append(f"dropout {p}: {fwd * 1e3:.2f}, {both * 1e3:.2f}")
            print(f"   {heads} heads of {dim}, {str(dt)[6:]:>8}: " + "; ".join(cells))


def cp_chunks() -> None:
    print("6. context parallelism's two chunk calls on each rank of cp 2 (64 queries against the keys\n"
          "   up to their chunk's end: rank 0 64 and 256 keys, rank 1 128 and 192, under the runtime's\n"
          "   lower-right causal mask) against one causal call over 256, 2 x 4 heads of 80 (ms, median\n"
          f"   of 20; each rank's chunks hold {cp_chunk_scores(256, 2) / 256**2:.3f} of the square's query-key pairs)")
    for dt in (torch.float32, torch.bfloat16):
        for p in (0.0, 0.1):
            cells = []
            for grad in (False, True):
                square = _sdpa_s(256, 256, dt, p, grad)
                ranks = [_sdpa_s(64, a, dt, p, grad) + _sdpa_s(64, b, dt, p, grad) for a, b in ((64, 256), (128, 192))]
                cells.append(f"{'forward + backward' if grad else 'forward'} {square * 1e3:.2f} vs "
                             + " and ".join(f"{t * 1e3:.2f} ({t / square:.2f})" for t in ranks))
            print(f"   {str(dt)[6:]:>8}, dropout {p}: " + "; ".join(cells))


def _sdpa_s(s_q: int, s_k: int, dt: torch.dtype, p: float, grad: bool) -> float:
    from runtime.model import core_attention
    from costmodel.specs import AttentionKernel
    q = torch.randn(2, 4, s_q, 80, dtype=dt, requires_grad=grad)
    k, v = (torch.randn(2, 4, s_k, 80, dtype=dt, requires_grad=grad) for _ in range(2))

    def call():
        out = core_attention(q, k, v, AttentionKernel.FLASH, p)
        if grad:
            out.sum().backward()
    return median_s(call, 20)


def gemm_layouts() -> None:
    print("7. GFLOP/s of the profile's GEMM (a @ b) against a linear's forward (x @ W.T) and its two\n"
          "   backward GEMMs (dY @ W, dY.T @ X), at the probes' and the closed-loop models' shapes (best of 7)")
    shapes = {"probe-narrow": (512, 64, 176), "probe-wide": (512, 256, 688), "probe-broad": (512, 512, 1376),
              "gpt fc1": (512, 320, 1280), "gpt fc2": (512, 1280, 320), "llama w1": (512, 384, 1024)}
    for name, (m, k, n) in shapes.items():
        cells = []
        for dt in (torch.float32, torch.bfloat16):
            a, b, w, dy = (torch.randn(*shape, dtype=dt) for shape in ((m, k), (k, n), (n, k), (m, n)))
            rates = [2.0 * m * k * n / best_s(f, 7) / 1e9 for f in
                     (lambda: a @ b, lambda: F.linear(a, w), lambda: dy @ w, lambda: dy.t() @ a)]
            cells.append(f"{str(dt)[6:]} " + " ".join(f"{r:4.0f}" for r in rates))
        print(f"   {name:>12} {m}x{k}x{n}: " + " | ".join(cells))


def sdpa_per_pair() -> None:
    print("8. causal SDPA's time per query-key pair (ns; the backward: forward + backward less the forward,\n"
          "   best of 10 after 3) by sequence and head dim, batch x heads as given: what the profile's\n"
          "   points (sequence, head dim, seconds per head) and costmodel.compute.sdpa_head_s assume")
    for dt in (torch.float32, torch.bfloat16):
        for b, h, s in ((4, 4, 128), (1, 4, 128), (1, 4, 256), (2, 6, 256), (1, 8, 512)):
            cells = []
            for d in (16, 32, 64, 80):
                q, k, v = (torch.randn(b, h, s, d, dtype=dt, requires_grad=True) for _ in range(3))
                fwd = best_s(lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(),
                                                                    is_causal=True), 10)
                both = best_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), 10)
                pairs = b * h * s * s
                cells.append(f"d{d} {fwd / pairs * 1e9:5.2f} / {(both - fwd) / pairs * 1e9:5.2f}")
            print(f"   {str(dt)[6:]:>8} {b}x{h}x{s}: " + "  ".join(cells))


SECTIONS = {1: elementwise, 2: loss, 3: linears, 4: recompute, 5: gpt_kernels, 6: cp_chunks, 7: gemm_layouts,
            8: sdpa_per_pair}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, nargs="+", choices=sorted(SECTIONS), help="sections to run (default all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    for number in args.only or sorted(SECTIONS):
        SECTIONS[number]()
    print(f"\n{time.perf_counter() - start:.0f} s; command: python benchmarks/cpu_kernels.py"
          + (f" --only {' '.join(map(str, args.only))}" if args.only else ""))


if __name__ == "__main__":
    main()
