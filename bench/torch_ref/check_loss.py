"""Loads a lintape checkpoint into the PyTorch model of MODEL.md and compares its loss with lintape's.

The sequences are the ones `lintape eval` reads: windows of seq_len + 1 tokens of the file starting at
i * seq_len (tokens are the file's bytes, or an llm.c .bin's uint16 tokens), the loss averaged over the
sequences. With --lintape the script runs `lintape eval --json` on the same checkpoint and file and exits 1
when the two losses differ by more than --tolerance (relative).

Usage: python3 bench/torch_ref/check_loss.py --checkpoint DIR --data FILE [--batches K]
           [--lintape build/lintape] [--device cpu|cuda] [--fal torch|fla] [--dtype f32|bf16]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import load_lintape_checkpoint  # noqa: E402


def load_tokens(path):
    data = open(path, "rb").read()
    if path.endswith(".bin"):
        header = np.frombuffer(data[:1024], dtype="<i4")
        if header[0] != 20240520 or header[1] != 1:
            raise ValueError(f"{path}: not an llm.c .bin token file (magic {header[0]}, version {header[1]})")
        return np.frombuffer(data[1024:1024 + 2 * int(header[2])], dtype="<u2").astype(np.int64)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def torch_loss(model, tokens, seq_len, batches, device, dtype):
    windows = (len(tokens) - 1) // seq_len if len(tokens) > seq_len else 0
    count = min(batches, windows) if batches > 0 else windows
    if count == 0:
        raise ValueError(f"the data holds no sequence of {seq_len} + 1 tokens")
    total = 0.0
    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        for i in range(count):
            window = torch.from_numpy(tokens[i * seq_len:i * seq_len + seq_len + 1].copy()).to(device)
            total += model.loss(window[None, :-1], window[None, 1:]).item()
    return total / count, count


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--lintape", default="", help="the lintape executable, to compare with `lintape eval`")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fal", default="torch", choices=["torch", "fla"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()

    device = torch.device(args.device)
    model, state = load_lintape_checkpoint(args.checkpoint, args.fal, device)
    seq_len = model.cfg["seq_len"]
    loss, count = torch_loss(model, load_tokens(args.data), seq_len, args.batches, device, args.dtype)
    print(f"pytorch: mean loss {loss:.6f} over {count} sequences of {seq_len} tokens "
          f"(step {state['train']['step']}, fal {args.fal}, {args.dtype}, {device})")
    if not args.lintape:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "eval.json")
        subprocess.run([args.lintape, "eval", "--checkpoint", args.checkpoint, "--data", args.data,
                        "--batches", str(count), "--json", out, "--device", args.device], check=True)
        theirs = json.load(open(out))["loss"]
    rel = abs(loss - theirs) / abs(theirs)
    ok = rel <= args.tolerance
    print(f"lintape: mean loss {theirs:.6f}; relative difference {rel:.2e} "
          f"({'within' if ok else 'OUTSIDE'} {args.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
