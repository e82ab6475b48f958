"""The language model of MODEL.md in PyTorch, loading lintape checkpoints by MODEL.md's names.

An independent implementation of the contract: parameter names and shapes, the fixed buffers (LRPE cosine
theta, rotary theta, FAL decay), the forward and the loss are written from MODEL.md and OPS.md alone, so
that the same checkpoint and tokens give lintape's loss.

FAL mixer backends:
  "torch": chunked causal linear attention in plain PyTorch (any device; the reference on the CPU);
  "fla":   the chunk_simple_gla kernel of flash-linear-attention (package fla-core, CUDA) with the acts,
           cosine LRPE and gate around it, as a PyTorch user would write it.
TPA mixer: q, k, v built with einsum from the factors, then scaled_dot_product_attention (causal).
"""
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def model_config(config):
    """The model part of a checkpoint's state.json config (or a bare model config)."""
    return config["model"] if "model" in config else config


def at_least_f32(dtype):
    """The dtype of statistics, angles, states and the loss: f32, or f64 for an f64 model (MODEL.md's "in
    f32" is a floor, and an f64 run that rounds any of them to f32 is no f64 reference)."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x, w, eps):
    # Statistics in f32 (at least) whatever x's dtype (MODEL.md).
    xf = x.to(at_least_f32(x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w.to(x.dtype)


def lrpe_cosine(x, theta, offset=0):
    """x (B, N, H, D), theta (H, D): [x cos(angle), x sin(angle)] of width 2D, angle in f32 (at least)."""
    n, at = x.shape[1], at_least_f32(x.dtype)
    pos = torch.arange(n, device=x.device, dtype=at) + offset
    angle = pos[:, None, None] * theta[None].to(at)  # (N, H, D)
    return torch.cat([x * torch.cos(angle).to(x.dtype), x * torch.sin(angle).to(x.dtype)], dim=-1)


def rotary(x, theta):
    """Half-split rotary over the last dim of x (B, N, R, D) at positions 0..N-1; theta (D/2)."""
    n, half, at = x.shape[1], x.shape[-1] // 2, at_least_f32(x.dtype)
    angle = torch.arange(n, device=x.device, dtype=at)[:, None, None] * theta.to(at)  # (N, 1, D/2)
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_decayed_linear_attention(q, k, v, lam, chunk=64):
    """o_t = sum_{s <= t} lam^(t - s) (q_t . k_s) v_s per head; q, k (B, N, H, P), v (B, N, H, E), lam (H).

    Chunkwise: a masked decayed product inside each chunk and a P x E state in f32 (at least) across chunks.
    """
    B, N, H, P = q.shape
    E = v.shape[-1]
    dt, at = q.dtype, at_least_f32(q.dtype)
    qf, kf, vf = q.to(at).transpose(1, 2), k.to(at).transpose(1, 2), v.to(at).transpose(1, 2)  # (B, H, N, .)
    log_lam = torch.log(lam.to(at))[None, :, None]  # (1, H, 1)
    state = q.new_zeros(B, H, P, E, dtype=at)
    out = []
    for start in range(0, N, chunk):
        qc, kc, vc = qf[:, :, start:start + chunk], kf[:, :, start:start + chunk], vf[:, :, start:start + chunk]
        c = qc.shape[2]
        i = torch.arange(c, device=q.device, dtype=at)
        # lam^(t - s) for s <= t inside the chunk, 0 above the diagonal.
        diff = i[:, None] - i[None, :]
        decay = torch.where(diff >= 0, torch.exp(log_lam[..., None] * diff.clamp(min=0)), torch.zeros(()))
        intra = ((qc @ kc.transpose(-1, -2)) * decay) @ vc
        inter = (qc * torch.exp(log_lam * (i + 1))[..., None]) @ state
        out.append(intra + inter)
        k_weight = torch.exp(log_lam * (c - 1 - i))[..., None]  # lam^(c - 1 - s)
        state = torch.exp(log_lam * c)[..., None] * state + (kc * k_weight).transpose(-1, -2) @ vc
    return torch.cat(out, dim=2).transpose(1, 2).to(dt)


class FalMixer(nn.Module):
    def __init__(self, C, H, D, eps, backend):
        super().__init__()
        self.H, self.D, self.eps, self.backend = H, D, eps, backend
        self.qkvg = nn.Linear(C, 4 * H * D, bias=False)
        self.norm = nn.Parameter(torch.ones(D))
        self.out = nn.Linear(H * D, C, bias=False)
        j = torch.arange(D, dtype=torch.float64)
        self.register_buffer("theta", (10000.0 ** (-j / D)).float().repeat(H, 1), persistent=False)  # (H, D)
        lam = 1.0 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64))
        self.register_buffer("decay", lam.float(), persistent=False)

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v, g = self.qkvg(x).view(B, N, 4, self.H, self.D).unbind(2)
        qb, kb = lrpe_cosine(F.silu(q), self.theta), lrpe_cosine(F.silu(k), self.theta)
        if self.backend == "fla":
            from fla.ops.simple_gla import chunk_simple_gla
            o, _ = chunk_simple_gla(qb, kb, v, g_gamma=torch.log(self.decay), scale=1.0)
        else:
            o = causal_decayed_linear_attention(qb, kb, v, self.decay)
        o = F.silu(g) * o
        return self.out(rms_norm(o, self.norm, self.eps).reshape(B, N, self.H * self.D))


class TpaMixer(nn.Module):
    def __init__(self, C, H, D, ranks):
        super().__init__()
        self.H, self.D, self.ranks = H, D, ranks
        R = sum(ranks)
        self.a = nn.Linear(C, H * R, bias=False)
        self.b = nn.Linear(C, R * D, bias=False)
        self.out = nn.Linear(H * D, C, bias=False)
        j = torch.arange(D // 2, dtype=torch.float64)
        self.register_buffer("theta", (10000.0 ** (-2.0 * j / D)).float(), persistent=False)

    def forward(self, x):
        B, N, _ = x.shape
        rq, rk, rv = self.ranks
        fa = self.a(x).view(B, N, self.H, rq + rk + rv)
        fb = self.b(x).view(B, N, rq + rk + rv, self.D)
        aq, ak, av = fa.split([rq, rk, rv], dim=3)
        bq, bk, bv = fb.split([rq, rk, rv], dim=2)
        bq, bk = rotary(bq, self.theta), rotary(bk, self.theta)
        q = torch.einsum("bnhr,bnrd->bhnd", aq, bq) / rq
        k = torch.einsum("bnhr,bnrd->bhnd", ak, bk) / rk
        v = torch.einsum("bnhr,bnrd->bhnd", av, bv) / rv
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.D ** -0.5)
        return self.out(o.transpose(1, 2).reshape(B, N, self.H * self.D))


class Mlp(nn.Module):
    def __init__(self, C, F_):
        super().__init__()
        self.F = F_
        self.up = nn.Linear(C, 2 * F_, bias=False)
        self.down = nn.Linear(F_, C, bias=False)

    def forward(self, x):
        u, gate = self.up(x).split(self.F, dim=-1)
        return self.down(F.silu(gate) * u)


class Block(nn.Module):
    def __init__(self, cfg, mixer, fal_backend):
        super().__init__()
        C, H, D, eps = cfg["width"], cfg["heads"], cfg["head_dim"], cfg["norm_eps"]
        self.eps = eps
        self.norm1 = nn.Parameter(torch.ones(C))
        self.norm2 = nn.Parameter(torch.ones(C))
        self.mixer_name = mixer
        if mixer == "fal":
            self.fal = FalMixer(C, H, D, eps, fal_backend)
        elif mixer == "tpa":
            self.tpa = TpaMixer(C, H, D, cfg["tpa_ranks"])
        else:
            raise ValueError(f"unknown mixer '{mixer}'; expected fal or tpa")
        self.mlp = Mlp(C, cfg["mlp_hidden"])

    def forward(self, x):
        mixer = self.fal if self.mixer_name == "fal" else self.tpa
        x = x + mixer(rms_norm(x, self.norm1, self.eps))
        return x + self.mlp(rms_norm(x, self.norm2, self.eps))


class LanguageModel(nn.Module):
    def __init__(self, cfg, fal_backend="torch"):
        super().__init__()
        self.cfg = cfg
        mixers = cfg["mixers"]
        self.wte = nn.Parameter(torch.zeros(cfg["vocab_size"], cfg["width"]))
        self.blocks = nn.ModuleList(
            Block(cfg, mixers[i % len(mixers)], fal_backend) for i in range(cfg["layers"]))
        self.norm = nn.Parameter(torch.ones(cfg["width"]))
        self.init_weights()

    def init_weights(self, seed=0):
        """MODEL.md's initialisation (its distribution, not lintape's random stream)."""
        gen = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * self.cfg["layers"])
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() < 2:
                    p.fill_(1.0)
                else:
                    std = out_std if name.endswith("out.weight") or name.endswith("mlp.down.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def hidden(self, tokens):
        """The embedding and the blocks: the last block's output."""
        x = self.wte[tokens]
        for block in self.blocks:
            x = block(x)
        return x

    def head(self, x):
        """The final norm and the tied head: logits from the last block's output."""
        return rms_norm(x, self.norm, self.cfg["norm_eps"]) @ self.wte.to(x.dtype).t()

    def head_loss(self, x, targets):
        logits = self.head(x)
        logits = logits.to(at_least_f32(logits.dtype))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)

    def logits(self, tokens):
        return self.head(self.hidden(tokens))

    def loss(self, tokens, targets):
        return self.head_loss(self.hidden(tokens), targets)

    # -- MODEL.md's parameter names <-> this module's
    def lintape_names(self):
        """{MODEL.md name: parameter of this module}."""
        names = {"wte": self.wte, "norm.weight": self.norm}
        for i, blk in enumerate(self.blocks):
            p = f"blocks.{i}."
            names[p + "norm1.weight"] = blk.norm1
            names[p + "norm2.weight"] = blk.norm2
            names[p + "mlp.up.weight"] = blk.mlp.up.weight
            names[p + "mlp.down.weight"] = blk.mlp.down.weight
            if blk.mixer_name == "fal":
                names[p + "fal.qkvg.weight"] = blk.fal.qkvg.weight
                names[p + "fal.norm.weight"] = blk.fal.norm
                names[p + "fal.out.weight"] = blk.fal.out.weight
            else:
                names[p + "tpa.a.weight"] = blk.tpa.a.weight
                names[p + "tpa.b.weight"] = blk.tpa.b.weight
                names[p + "tpa.out.weight"] = blk.tpa.out.weight
        return names


def checkpoint_step_dir(path):
    """A checkpoint directory (with `latest`) or one of its step directories."""
    latest = os.path.join(path, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    return path


def load_lintape_checkpoint(path, fal_backend="torch", device="cpu"):
    """The model of a lintape checkpoint with its parameters, and the checkpoint's state.json."""
    from safetensors.torch import load_file

    step_dir = checkpoint_step_dir(path)
    with open(os.path.join(step_dir, "state.json")) as f:
        state = json.load(f)
    cfg = model_config(state["config"])
    model = LanguageModel(cfg, fal_backend)
    tensors = load_file(os.path.join(step_dir, "model.safetensors"))
    names = model.lintape_names()
    missing = sorted(set(names) - set(tensors))
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise ValueError(f"{step_dir}/model.safetensors: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, param in names.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"{step_dir}/model.safetensors: {name} is {tuple(t.shape)}; "
                                 f"expected {tuple(param.shape)}")
            param.copy_(t)
    return model.to(device), state
