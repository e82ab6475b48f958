"""Times what a PyTorch user would run for the TPA ops, beside `lintape bench tpa-decode` and `tpa-attention`.

decode:    the seeds' shapes (batch 8 and 32, head 32, rank 16 for q, 1 for k and v, dim 128, bf16):
           naive (materialise q, k, v, then softmax(q k^T) v in eager PyTorch) and the same under
           torch.compile.
attention: batch 8, head 16 (--attention-shapes 8x16,16x6 adds the small model's), dim 128, ranks
           (6, 2, 2), causal: einsum for q, k, v then scaled_dot_product_attention, forward and
           forward + backward (reported as backward alone).

Medians of CUDA-event timings after a warm-up; peak memory from torch.cuda.max_memory_allocated, counted from
before the call's inputs are built (inputs, dout and fresh gradients included), as `lintape bench` counts it.
Usage: python3 bench/peers/tpa_peer.py [--quick] [--decode-ms 2048,32768] [--attention-ns 2048,8192]
       [--attention-shapes 8x16,16x6] [--no-decode] [--json FILE]
(torch.compile recompiles for every decode shape, so a short --decode-ms list keeps the run short.)
"""
import argparse
import json

import torch
import torch.nn.functional as F

from timing import median_ms

DT = torch.bfloat16


def peak_mib(make, run):
    """Peak MiB of run(make()), counted as `lintape bench --metric memory` counts: from before the inputs are
    built, so the inputs, dout and the gradients (fresh, none kept from an earlier call) are included."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    args = make()
    run(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del args
    return peak / 2**20


def naive_decode(aq, bq, ak, bk, av, bv):
    # aq (B, H, Rq), bq (B, Rq, D), ak (B, M, H), bk (B, M, D), av (B, M, H), bv (B, M, D)
    q = torch.einsum("bhr,brd->bhd", aq, bq) / aq.shape[-1]
    k = ak.unsqueeze(-1) * bk.unsqueeze(2)  # (B, M, H, D)
    v = av.unsqueeze(-1) * bv.unsqueeze(2)
    s = torch.einsum("bhd,bmhd->bhm", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhm,bmhd->bhd", torch.softmax(s.float(), -1).to(q.dtype), v)


def factors(B, N, H, D, ranks, grad):
    rq, rk, rv = ranks
    shapes = [(B, N, H, rq), (B, N, rq, D), (B, N, H, rk), (B, N, rk, D), (B, N, H, rv), (B, N, rv, D)]
    return [torch.randn(s, device="cuda", dtype=DT, requires_grad=grad) for s in shapes]


def einsum_sdpa(aq, bq, ak, bk, av, bv):
    q = torch.einsum("bnhr,bnrd->bhnd", aq, bq) / aq.shape[-1]
    k = torch.einsum("bnhr,bnrd->bhnd", ak, bk) / ak.shape[-1]
    v = torch.einsum("bnhr,bnrd->bhnd", av, bv) / av.shape[-1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-ms", help="comma-separated cache lengths (default: 256 ... 32768)")
    ap.add_argument("--attention-ns", help="comma-separated sequence lengths (default: 1024 ... 8192)")
    ap.add_argument("--attention-shapes", default="8x16",
                    help="comma-separated BxH shapes of the attention table (default 8x16; the model's: 16x6)")
    ap.add_argument("--no-decode", action="store_true", help="attention tables only")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("device:", torch.cuda.get_device_name())

    ns = [1024, 2048] if args.quick else [1024, 2048, 4096, 8192]
    if args.attention_ns:
        ns = [int(x) for x in args.attention_ns.split(",")]
    D = 128
    for shape in args.attention_shapes.split(","):
        B, H = (int(x) for x in shape.split("x"))
        print(f"\ntpa_attention batch{B}-head{H}-dim{D}-rank6_2_2-causal-bf16: einsum + SDPA")
        print(f"{'n':>6} {'fwd ms':>9} {'bwd ms':>9} {'fwd MiB':>9} {'fwd+bwd MiB':>12}")
        for n in ns:
            f = factors(B, n, H, D, (6, 2, 2), True)
            fwd = median_ms(lambda: einsum_sdpa(*f))
            dout = torch.randn(B, H, n, D, device="cuda", dtype=DT)

            def fwd_bwd():
                out = einsum_sdpa(*f)
                torch.autograd.backward(out, dout)

            both = median_ms(fwd_bwd)
            def fresh():
                return factors(B, n, H, D, (6, 2, 2), True), torch.randn(B, H, n, D, device="cuda", dtype=DT)

            def fwd_bwd_of(g, d):
                torch.autograd.backward(einsum_sdpa(*g), d)

            mem_f = peak_mib(fresh, lambda g, d: einsum_sdpa(*g))
            mem_b = peak_mib(fresh, fwd_bwd_of)
            print(f"{n:>6} {fwd:>9.3f} {both - fwd:>9.3f} {mem_f:>9.1f} {mem_b:>12.1f}")
            rows.append({"op": "tpa_attention", "batch": B, "head": H, "n": n, "fwd_ms": fwd, "bwd_ms": both - fwd,
                         "fwd_mib": mem_f, "fwd_bwd_mib": mem_b})

    # One compiled graph per decode shape: past dynamo's default limit of 8 the later shapes would run eagerly.
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)
    compiled = torch.compile(naive_decode, dynamic=False)
    ms = [256, 2048, 8192] if args.quick else [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    if args.decode_ms:
        ms = [int(x) for x in args.decode_ms.split(",")]
    if args.no_decode:
        ms = []
    for B in (8, 32) if ms else ():
        H, Rq, D = 32, 16, 128
        print(f"\ntpa_decode batch{B}-head{H}-rank{Rq}-dim{D}-bf16 (ms, MiB)")
        print(f"{'m':>6} {'naive':>9} {'compiled':>9} {'naive MiB':>10}")
        for m in ms:
            aq = torch.randn(B, H, Rq, device="cuda", dtype=DT)
            bq = torch.randn(B, Rq, D, device="cuda", dtype=DT)
            ak, av = (torch.randn(B, m, H, device="cuda", dtype=DT) for _ in range(2))
            bk, bv = (torch.randn(B, m, D, device="cuda", dtype=DT) for _ in range(2))
            a = (aq, bq, ak, bk, av, bv)
            t_naive = median_ms(lambda: naive_decode(*a))
            t_comp = median_ms(lambda: compiled(*a))
            mem = peak_mib(lambda: ([t.clone() for t in a],), lambda c: naive_decode(*c))
            print(f"{m:>6} {t_naive:>9.4f} {t_comp:>9.4f} {mem:>10.1f}")
            rows.append({"op": "tpa_decode", "batch": B, "m": m, "naive_ms": t_naive, "compiled_ms": t_comp,
                         "naive_mib": mem})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
