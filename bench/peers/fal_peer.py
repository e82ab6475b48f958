"""Times what a PyTorch user would run for the FAL ops, beside `lintape bench fal` and `fal-causal`.

noncausal: plain PyTorch (eager and torch.compile) for acts + cosine LRPE + kv state + gate.
causal:    torch.compile for the acts, cosine LRPE and gate around the `chunk_simple_gla` kernel of
           flash-linear-attention (package fla-core) with a per-head decay (g_gamma = log lambda),
           and that kernel alone on q, k of width 2D.

Shapes and acts as bench/bench_fal.cpp: B = H = 12, D = E = 128, bf16. Medians of CUDA-event timings
after a warm-up; backward is timed alone, on a fresh graph per run (an untimed forward before each).
Usage: python3 bench/peers/fal_peer.py [--quick] [--causal-only | --noncausal-only] [--ns N,...] [--shape BxH]
                                      [--kernel-only] [--json FILE]
--kernel-only times the causal fla kernel alone (no torch.compile around it).
"""
import argparse
import json

import torch
import torch.nn.functional as F

from timing import median_ms

B, H, D = 12, 12, 128
DT = torch.bfloat16


def theta(dev):
    return 10000.0 ** (-torch.arange(D, device=dev, dtype=torch.float32) / D)


def lrpe_cosine(x, th, offset=0):
    n = x.shape[1]
    angle = (torch.arange(n, device=x.device, dtype=torch.float32) + offset)[:, None, None] * th  # (n, 1, D)
    return torch.cat([x * torch.cos(angle).to(x.dtype), x * torch.sin(angle).to(x.dtype)], dim=-1)


def fal_noncausal(q, k, v, g, th, q_softmax):
    qa = torch.softmax(q.float(), -1).to(q.dtype) if q_softmax else F.silu(q)
    qb, kb = lrpe_cosine(qa, th), lrpe_cosine(F.silu(k), th)
    kv = torch.einsum("bmhp,bmhe->bhpe", kb, v)
    return F.silu(g) * torch.einsum("bnhp,bhpe->bnhe", qb, kv)


def prologue(q, k, th):
    return lrpe_cosine(F.silu(q), th), lrpe_cosine(F.silu(k), th)


def epilogue(g, o):
    return F.silu(g) * o


def time_case(fn, inputs, mode, reps=20, warmup=3):
    if mode == "fwd":
        return median_ms(lambda: fn(*inputs))
    # Backward alone: a fresh graph for every timed backward (untimed forward), since torch.compile's
    # backward frees its saved tensors and cannot run twice on one graph (retain_graph is not honoured).
    do = torch.randn_like(fn(*inputs))
    times = []
    for i in range(warmup + reps):
        out = fn(*inputs)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.autograd.grad(out, inputs, do)
        b.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
        del out
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default="")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--causal-only", action="store_true", help="skip the noncausal tables")
    only.add_argument("--noncausal-only", action="store_true", help="skip the causal table")
    ap.add_argument("--ns", default="", help="comma-separated sequence lengths replacing the defaults")
    ap.add_argument("--shape", default="", help="BxH replacing the seeds' 12x12, e.g. 16x6 (the language model)")
    ap.add_argument("--kernel-only", action="store_true", help="causal: the fla kernel alone, no torch.compile")
    args = ap.parse_args()
    global B, H
    if args.shape:
        B, H = (int(x) for x in args.shape.lower().split("x"))
    chosen = [int(x) for x in args.ns.split(",") if x]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    th = theta(dev)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; B = {B}, H = {H}, D = E = {D}")
    rows = []

    def report(table, n, provider, mode, ms, extra=""):
        rows.append({"table": table, "n": n, "provider": provider, "mode": mode, "ms": ms})
        print(f"{table:28s} {mode:3s} n={n:6d} {provider:28s} {ms:9.3f} ms {extra}", flush=True)

    def timed(table, n, provider, mode, fn, inputs, peak=False):
        # A failing case reports -1 and says why; the others still run.
        try:
            ms = time_case(fn, inputs, mode)
            extra = f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if peak else ""
            report(table, n, provider, mode, ms, extra)
        except Exception as e:  # noqa: BLE001
            report(table, n, provider, mode, -1.0, f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")

    # -- noncausal
    compiled = torch.compile(fal_noncausal)
    ns = chosen or ([1024, 4096, 8192] if args.quick else [256, 1024, 4096, 8192, 16384, 32768])
    for q_softmax in () if args.causal_only else (False, True):
        table = "fal " + ("q softmax" if q_softmax else "silu")
        for n in ns:
            mk = lambda w: torch.randn(B, n, H, w, device=dev, dtype=DT, requires_grad=True)  # noqa: E731
            inputs = [mk(D), mk(D), mk(D), mk(D)]
            for mode in ("fwd", "bwd"):
                for name, fn in (("torch", fal_noncausal), ("torch.compile", compiled)):
                    f = lambda *x, fn=fn: fn(*x, th, q_softmax)  # noqa: E731
                    timed(table, n, name, mode, f, inputs)
                    torch.cuda.empty_cache()

    # -- causal
    if args.noncausal_only:
        return finish(rows, args)
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # noqa: BLE001
        print(f"flash-linear-attention not importable ({e}); causal peers skipped")
        return finish(rows, args)
    pro, epi = torch.compile(prologue), torch.compile(epilogue)
    lam = 1.0 - 2.0 ** -(5.0 + torch.arange(H, device=dev, dtype=torch.float32) / 2)
    g_gamma = torch.log(lam)

    def causal(q, k, v, g):
        qb, kb = pro(q, k, th)
        o, _ = chunk_simple_gla(qb, kb, v, g_gamma=g_gamma, scale=1.0)
        return epi(g, o)

    def kernel_only(qb, kb, v):
        return chunk_simple_gla(qb, kb, v, g_gamma=g_gamma, scale=1.0)[0]

    ns = chosen or ([1024, 4096, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384])
    for n in ns:
        mk = lambda w: torch.randn(B, n, H, w, device=dev, dtype=DT, requires_grad=True)  # noqa: E731
        inputs = [mk(D), mk(D), mk(D), mk(D)]
        wide = [mk(2 * D), mk(2 * D), mk(D)]
        for mode in ("fwd", "bwd"):
            torch.cuda.reset_peak_memory_stats()
            if not args.kernel_only:
                timed("fal_causal", n, "torch.compile + fla", mode, causal, inputs, peak=True)
            timed("fal_causal", n, "fla kernel (q, k width 2D)", mode, kernel_only, wide)
        torch.cuda.empty_cache()
    return finish(rows, args)


def finish(rows, args):
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
