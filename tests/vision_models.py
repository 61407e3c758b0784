"""Test-support factories for models that are not language models (``--model vision_models:cnn``): a small
CNN classifier and a small ViT, written here so that no torchvision is needed.  Inputs are declared with
an input spec (models/inputs.py) or a batch function."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 10


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)


class CNN(nn.Module):
    def __init__(self, widths=(3, 16, 32, 32)):
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(widths[-1], CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class ViTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image=32, patch=8, d=64, depth=2, heads=4):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, d))
        self.blocks = nn.ModuleList(ViTBlock(d, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, CLASSES)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def cnn():
    return CNN(), f"image:3x32x32:classes={CLASSES}"


def vit():
    model = ViT()

    def make_batch(gen, micro_batch, seq, device):  # a batch function instead of a spec: the same contract
        images = torch.randn((micro_batch, 3, 32, 32), generator=gen)
        return images.to(device), torch.randint(0, CLASSES, (micro_batch,), generator=gen).to(device)

    return model, make_batch
