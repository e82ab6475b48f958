"""Trains lintape and the PyTorch model of MODEL.md from the same checkpoint on the same batches, and
compares the losses step by step.

lintape trains `--start + --steps` steps with a checkpoint at step `--start` and a JSONL row per step;
PyTorch loads that checkpoint (parameters, AdamW moments, data position) and replays the next `--steps`
steps: the batches of `lintape train` (windows of seq + 1 tokens from the data position, the last 5% of
the file held out), its learning-rate schedule, global-norm clipping and AdamW (MODEL.md). The script
prints both losses per step and exits 1 when one differs by more than --tolerance (relative).

Free-running, the two trajectories part by rounding alone: early in training a one-step difference grows
about tenfold per step, so that two PyTorch float32 replays of the same checkpoint (its CPU results vary
from run to run) or PyTorch float32 against float64 differ by more than 1e-4 within 4 to 8 steps. --per-step
takes lintape's checkpoint of every step instead: each PyTorch step starts from lintape's parameters and
moments, the loss compares one forward, and "update diff" is |PyTorch's update - lintape's| / |lintape's|
over all parameters.

Usage: python3 bench/torch_ref/train_check.py --lintape build/lintape --data FILE [--preset tiny]
           [--device cpu|cuda] [--dtype f32|bf16] [--batch B] [--seq N] [--mixers fal,tpa] [--per-step]
           [--workdir DIR]
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_loss import load_tokens  # noqa: E402
from model import load_lintape_checkpoint  # noqa: E402


def learning_rate(step, cfg):
    """MODEL.md: linear warm-up, then cosine decay to min_lr_ratio of the peak."""
    peak, warmup, total, floor = cfg["lr"], cfg["warmup"], cfg["steps"], cfg["min_lr_ratio"]
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class Batches:
    """`lintape train`'s text batches: consecutive windows from a position, wrapping at the end."""

    def __init__(self, tokens, batch, seq_len, position, val_fraction=0.05):
        held_out = int(len(tokens) * val_fraction)
        self.train = torch.from_numpy(tokens[:len(tokens) - held_out].copy())
        self.batch, self.seq_len, self.cursor = batch, seq_len, position

    def next(self):
        rows = []
        for _ in range(self.batch):
            if self.cursor + self.seq_len + 1 > len(self.train):
                self.cursor = 0
            rows.append(self.train[self.cursor:self.cursor + self.seq_len + 1])
            self.cursor += self.seq_len
        w = torch.stack(rows)
        return w[:, :-1], w[:, 1:]


def lintape_train(args, ckpt, log, steps, checkpoint_every, config=""):
    cmd = [args.lintape, "train", "--data", args.data, "--device", args.device, "--steps", str(steps),
           "--checkpoint-dir", ckpt, "--checkpoint-every", str(checkpoint_every), "--log", log, "--seed", "0"]
    cmd += ["--config", config] if config else ["--preset", args.preset]
    for flag in ("batch", "seq", "mixers", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in open(log) if '"loss"' in line]
    return {r["step"]: r for r in rows}


def run_lintape(args, workdir):
    """lintape's log rows by step and its checkpoint directory: the start step's checkpoint, or with
    --per-step every step's (the command line keeps 3, so a config from a one-step run keeps them all)."""
    ckpt, log = os.path.join(workdir, "ckpt"), os.path.join(workdir, "train.jsonl")
    total = args.start + args.steps
    if not args.per_step:
        return ckpt, lintape_train(args, ckpt, log, total, args.start)
    probe = os.path.join(workdir, "probe")
    lintape_train(args, probe, os.path.join(workdir, "probe.jsonl"), 1, 1)
    with open(os.path.join(probe, "step_00000001", "state.json")) as f:
        config = json.load(f)["config"]
    config.update(steps=total, checkpoint_every=1, keep_checkpoints=total)
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    return ckpt, lintape_train(args, ckpt, log, total, 1, config_path)


def step_dir_of(ckpt, step):
    return os.path.join(ckpt, f"step_{step:08d}")


def replay(args, step_dir, steps):
    """PyTorch's `steps` steps from a lintape checkpoint: {step: (loss, lr, grad norm)} and the parameters
    by MODEL.md name."""
    from safetensors.torch import load_file

    device = torch.device(args.device)
    model, state = load_lintape_checkpoint(step_dir, "fla" if args.fla else "torch", device)
    cfg, train = state["config"], state["train"]
    names = model.lintape_names()
    moments = load_file(os.path.join(step_dir, "optim.safetensors"))
    m = {n: moments["m." + n].to(device) for n in names}
    v = {n: moments["v." + n].to(device) for n in names}
    decays = {n: p.dim() >= 2 for n, p in names.items()}  # MODEL.md: matrices and wte only
    batches = Batches(load_tokens(args.data), cfg["batch"], model.cfg["seq_len"], train["data_position"])
    b1, b2, eps, wd = 0.9, 0.95, 1e-8, cfg["weight_decay"]
    losses = {}
    for step in range(train["step"], train["step"] + steps):
        tokens, targets = (t.to(device) for t in batches.next())
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model.loss(tokens, targets)
        loss.backward()
        params = list(names.values())
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params))
        scale = min(1.0, cfg["grad_clip"] / (norm.item() + 1e-6))
        lr = learning_rate(step, cfg)
        t = step + 1
        with torch.no_grad():
            for n, p in names.items():
                g = p.grad * scale
                if decays[n]:
                    p.mul_(1.0 - lr * wd)
                m[n].mul_(b1).add_(g, alpha=1 - b1)
                v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.sub_(lr * (m[n] / (1 - b1 ** t)) / (torch.sqrt(v[n] / (1 - b2 ** t)) + eps))
        losses[step + 1] = (loss.item(), lr, norm.item())
    return losses, names


def update_difference(ckpt, step, names):
    """|PyTorch's update from lintape's checkpoint at step - 1 - lintape's update| / |lintape's update|."""
    from safetensors.torch import load_file

    before, after = (load_file(os.path.join(step_dir_of(ckpt, s), "model.safetensors")) for s in (step - 1, step))
    diff = sum(((p.detach().cpu().double() - after[n].double()) ** 2).sum() for n, p in names.items())
    update = sum(((after[n].double() - before[n].double()) ** 2).sum() for n in names)
    return math.sqrt(diff / update)


def replay_each_step(args, ckpt):
    """One PyTorch step from lintape's checkpoint of each step: {step: (loss, lr, grad norm, update diff)}."""
    rows = {}
    for step in range(args.start, args.start + args.steps):
        losses, names = replay(args, step_dir_of(ckpt, step), 1)
        rows[step + 1] = losses[step + 1] + (update_difference(ckpt, step + 1, names),)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lintape", required=True)
    ap.add_argument("--data", required=True, help="a text file or an llm.c .bin")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="f32 or bf16 (passed to lintape train when given)")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--mixers", default="")
    ap.add_argument("--start", type=int, default=5, help="the checkpoint step both start from")
    ap.add_argument("--steps", type=int, default=10, help="steps compared")
    ap.add_argument("--fla", action="store_true", help="FAL mixer on flash-linear-attention's kernel")
    ap.add_argument("--per-step", action="store_true", help="each PyTorch step from lintape's parameters")
    ap.add_argument("--tolerance", type=float, default=0.0, help="relative; default 1e-4 (f32), 2e-2 (bf16)")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    tolerance = args.tolerance or (2e-2 if args.dtype == "bf16" else 1e-4)

    workdir = args.workdir or tempfile.mkdtemp(prefix="lintape-train-check-")
    try:
        ckpt, theirs = run_lintape(args, workdir)
        ours = replay_each_step(args, ckpt) if args.per_step else replay(args, step_dir_of(ckpt, args.start),
                                                                         args.steps)[0]
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    worst = 0.0
    print(f"{'step':>5} {'lintape loss':>13} {'pytorch loss':>13} {'rel diff':>9} {'lr (lintape, pytorch)':>26}"
          f" {'grad norm (lintape, pytorch)':>30}" + (f" {'update diff':>11}" if args.per_step else ""))
    for step, (loss, lr, norm, *update) in ours.items():
        row = theirs[step]
        rel = abs(loss - row["loss"]) / abs(row["loss"])
        worst = max(worst, rel)
        print(f"{step:5d} {row['loss']:13.6f} {loss:13.6f} {rel:9.2e} {row['lr']:12.4e} {lr:12.4e}"
              f" {row.get('grad_norm', float('nan')):14.7g} {norm:14.7g}" + "".join(f" {u:11.2e}" for u in update))
    ok = worst <= tolerance
    print(f"largest relative difference {worst:.2e} over {len(ours)} steps: "
          f"{'within' if ok else 'OUTSIDE'} {tolerance:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
