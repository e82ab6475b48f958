"""Times the PyTorch training step of MODEL.md's model: the peer of `lintape bench train`.

bf16 autocast, fused AdamW (MODEL.md's betas, eps and weight decay), global-norm clip 1.0, eager or under
torch.compile; the FAL mixer on flash-linear-attention's chunk_simple_gla (package fla-core) with the acts,
cosine LRPE and gate compiled around it, the TPA mixer as einsum + scaled_dot_product_attention. Mode
reduce-overhead is torch.compile(mode="reduce-overhead"): the compiled forward and backward replayed as CUDA
graphs, PyTorch's best mode for small, launch-bound models. Prints and optionally writes (JSON) tokens/s,
ms/step, MFU and peak MiB over warmed-up steps (reduce-overhead: over the warm-up too, which records the
graphs and allocates their memory).

MFU counts 6 x parameters x tokens plus the mixers' attention FLOPs (FAL: 2 x 2 x N x 2D x E per head and
sequence, the chunked form's products; TPA: causal softmax attention, 2 x 2 x N^2/2 x D per head) times
3 for forward + backward, over the dense bf16 peak given by --peak-tflops (H200/H100 SXM: 989).

Usage: python3 bench/torch_ref/bench_train.py [--preset small|tiny] [--mixers fal|tpa] [--batch 16] [--seq 2048]
           [--vocab 32768] [--steps 10] [--warmup 3] [--mode eager|compile|reduce-overhead|both]
           [--compile-scope blocks|model] [--json FILE]
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import LanguageModel  # noqa: E402

SMALL = {"vocab_size": 32768, "width": 768, "layers": 12, "heads": 6, "head_dim": 128, "mlp_hidden": 2048,
         "tpa_ranks": [6, 2, 2], "seq_len": 2048, "norm_eps": 1e-6}
# lintape's tiny preset (layers/language_model.cpp).
TINY = {"vocab_size": 256, "width": 128, "layers": 4, "heads": 2, "head_dim": 64, "mlp_hidden": 384,
        "tpa_ranks": [4, 2, 2], "seq_len": 256, "norm_eps": 1e-6}


def attention_flops(cfg, batch, seq):
    """Forward FLOPs of the mixers' token-mixing products (not counted by 6 x parameters)."""
    H, D, L = cfg["heads"], cfg["head_dim"], cfg["layers"]
    per_layer = []
    for i in range(L):
        if cfg["mixers"][i % len(cfg["mixers"])] == "fal":
            per_layer.append(2 * 2 * seq * 2 * D * D * H * batch)
        else:
            per_layer.append(2 * 2 * seq * seq / 2 * D * H * batch)
    return sum(per_layer)


def make_optimizer(model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def compiled_loss(model, scope, mode):
    """model.loss under torch.compile (mode None: the default, or "reduce-overhead"). scope "model": the whole
    loss as one graph (twelve blocks unrolled: minutes to compile); "blocks": each block compiled in place (one
    compiled graph serves all twelve, as their code and shapes are equal) and the final norm, head and loss
    compiled on their own."""
    if scope == "model":
        return torch.compile(model.loss, mode=mode)
    for block in model.blocks:
        block.compile(mode=mode)
    head_loss = torch.compile(model.head_loss, mode=mode)
    return lambda tokens, targets: head_loss(model.hidden(tokens), targets)


def time_steps(model, opt, args, mode):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    vocab = model.cfg["vocab_size"]
    graphs = mode == "reduce-overhead"
    loss_fn = model.loss if mode == "eager" else compiled_loss(model, args.compile_scope, mode if graphs else None)

    def step():
        if graphs:  # a new iteration: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), device=dev, generator=gen)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    # With CUDA graphs the step's tensors live in the graphs' pool, allocated while the warm-up recorded
    # them; a replay allocates almost nothing, so a peak reset here would miss the step's memory.
    if not graphs:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return elapsed / args.steps, loss.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=["small", "tiny"])
    ap.add_argument("--mixers", default="fal")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode", default="both", choices=["eager", "compile", "reduce-overhead", "both"])
    ap.add_argument("--compile-scope", default="blocks", choices=["blocks", "model"],
                    help="blocks: each block compiled once and reused, and the head and loss (default); "
                         "model: the whole loss as one graph")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    base = SMALL if args.preset == "small" else TINY
    cfg = dict(base, vocab_size=args.vocab, seq_len=args.seq, mixers=args.mixers.split(","))
    rows = []
    modes = ["eager", "compile"] if args.mode == "both" else [args.mode]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; mixers {args.mixers}; "
          f"batch {args.batch} x {args.seq}; vocab {args.vocab}", flush=True)
    for mode in modes:
        torch.manual_seed(0)
        model = LanguageModel(cfg, fal_backend="fla").cuda()
        params = sum(p.numel() for p in model.parameters())
        opt = make_optimizer(model, 3e-4)
        try:
            sec, loss = time_steps(model, opt, args, mode)
        except Exception as e:  # noqa: BLE001
            print(f"{mode}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
            continue
        tokens = args.batch * args.seq
        flops = 6 * params * tokens + 3 * attention_flops(cfg, args.batch, args.seq)
        row = {"provider": f"pytorch {mode}", "preset": args.preset, "mixers": args.mixers, "params": params,
               "batch": args.batch,
               "seq": args.seq, "tokens_per_s": tokens / sec, "step_ms": sec * 1e3,
               "mfu": flops / sec / (args.peak_tflops * 1e12),
               "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "loss": loss}
        rows.append(row)
        print(f"pytorch {mode:15s} {params / 1e6:6.1f} M params  {row['tokens_per_s'] / 1e3:8.1f} K tok/s  "
              f"{row['step_ms']:8.2f} ms/step  MFU {100 * row['mfu']:5.1f}%  peak {row['peak_mib']:8.0f} MiB",
              flush=True)
        del model, opt
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
