"""batchlab's built-in decoder: one implementation for every ModelSpec (GPT-2 style and Llama style).

The calculator's activation formula (formula/memory.py) counts exactly the tensors this code keeps for
backward, so change the two together.  Written plainly, without fused kernels beyond SDPA, so that what
it saves is easy to enumerate.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from batchlab.config import AttentionImpl, MLPKind, ModelSpec, NormKind, PositionKind


class RMSNorm(nn.Module):
    # Zhang & Sennrich 2019; as in Llama.
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm is NormKind.RMSNORM:
        return RMSNorm(spec.hidden)
    return nn.LayerNorm(spec.hidden, bias=spec.bias)


def rope_tables(seq: int, head_dim: int, base: float = 10000.0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    # Su et al. 2021 (RoFormer), rotate-half form as in Llama's HF code.
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        h, kv = spec.hidden, spec.kv_hidden
        self.qkv = nn.Linear(h, h + 2 * kv, bias=spec.bias)
        self.proj = nn.Linear(h, h, bias=spec.bias)
        self.attn_drop = nn.Dropout(spec.dropout)
        self.resid_drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        spec = self.spec
        b, s, h = x.shape
        a, g, d = spec.heads, spec.kv_heads, spec.head_dim
        qkv = self.qkv(x)
        # under tensor parallelism this rank's qkv weight holds whole heads (distributed/tensor_parallel.py orders
        # its rows so): its local row count says how many, a / t query and g / t kv heads
        t = (a + 2 * g) * d // qkv.shape[-1]
        a, g = a // t, g // t
        q, k, v = qkv.split([a * d, g * d, g * d], dim=-1)
        q = q.view(b, s, a, d).transpose(1, 2)
        k = k.view(b, s, g, d).transpose(1, 2)
        v = v.view(b, s, g, d).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if g != a:  # grouped-query attention: each kv head serves a // g query heads
            k = k.repeat_interleave(a // g, dim=1)
            v = v.repeat_interleave(a // g, dim=1)
        if spec.attention is AttentionImpl.SDPA:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=spec.dropout if self.training else 0.0,
                                               is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = self.attn_drop(att) @ v
        y = y.transpose(1, 2).reshape(b, s, a * d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind = spec.mlp
        h, f = spec.hidden, spec.ffn
        if spec.mlp is MLPKind.SWIGLU:
            self.gate = nn.Linear(h, f, bias=spec.bias)
        self.up = nn.Linear(h, f, bias=spec.bias)
        self.down = nn.Linear(f, h, bias=spec.bias)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is MLPKind.SWIGLU:  # Shazeer 2020
            hidden = F.silu(self.gate(x)) * self.up(x)
        else:
            hidden = F.gelu(self.up(x), approximate="tanh")
        return self.drop(self.down(hidden))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm1 = make_norm(spec)
        self.attn = Attention(spec)
        self.norm2 = make_norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only LM; ``forward(tokens, targets)`` returns the mean token loss (padding = -100 ignored)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.max_positions, spec.hidden) if spec.position is PositionKind.LEARNED else None
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm_f = make_norm(spec)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final norm's output, (b, s, h): what the LM head reads (models/loss.py chunks from here)."""
        b, s = tokens.shape
        x = self.embed(tokens)
        rope = None
        if self.pos is not None:
            x = x + self.pos(torch.arange(s, device=tokens.device))
        else:
            rope = rope_tables(s, self.spec.head_dim, device=tokens.device)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        return self.norm_f(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, loss_sum: bool = False) -> torch.Tensor:
        b, s = tokens.shape
        logits = self.head(self.features(tokens))
        return F.cross_entropy(logits.view(b * s, -1).float(), targets.view(-1), ignore_index=-100,
                               reduction="sum" if loss_sum else "mean")


def build(spec: ModelSpec) -> GPT:
    return GPT(spec)
