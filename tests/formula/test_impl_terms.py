"""The per-implementation layer terms (formula/activations.py, ``--impl``) against the implementations' own code:
every tensor autograd saves in one forward, counted by storage (an independent reference: the formula never
sees it), at small dims in pure bf16 on CPU.  One layer's share = the 2-layer model's bytes less the 1-layer's.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from batchlab.config import Backend, Precision, preset  # noqa: E402
from batchlab.formula import activations as act  # noqa: E402

S, B = 32, 2


def saved_bytes(forward, params) -> int:
    """Bytes of the distinct storages autograd saves during ``forward()`` (parameters and buffers excluded)."""
    own = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())


# -- torchtitan's Llama, re-written from torchtitan/models/llama3/model.py (Attention, FeedForward,
# TransformerBlock, apply_rotary_emb, repeat_kv) with nn.RMSNorm, as torchtitan builds it since 2025-03
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    return torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def repeat_kv(x, n_rep: int):
    bs, slen, n_kv, hd = x.shape
    return x if n_rep == 1 else x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)


class TTAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, s, _ = x.shape
        xq = self.wq(x).view(bs, s, -1, self.hd)
        xk = self.wk(x).view(bs, s, -1, self.hd)
        xv = self.wv(x).view(bs, s, -1, self.hd)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.heads // self.kv_heads
        q, k, v = (t.transpose(1, 2) for t in (xq, repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, s, -1))


class TTBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn):
        super().__init__()
        self.attention = TTAttention(dim, heads, kv_heads)
        self.w1, self.w2, self.w3 = (nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False),
                                     nn.Linear(dim, ffn, bias=False))
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


def torchtitan_layer_bytes(spec, s: int, b: int) -> int:
    def stack(n):
        torch.manual_seed(0)
        blocks = nn.ModuleList(TTBlock(spec.hidden, spec.heads, spec.kv_heads, spec.ffn) for _ in range(n))
        return blocks.to(torch.bfloat16)

    freqs = precompute_freqs_cis(spec.head_dim, s)
    x = torch.randn(b, s, spec.hidden, dtype=torch.bfloat16, requires_grad=True)

    def run(blocks):
        def fwd():
            h = x
            for blk in blocks:
                h = blk(h, freqs)
            return h
        return saved_bytes(fwd, list(blocks.parameters()))

    return run(stack(2)) - run(stack(1))


def hf_layer_bytes(spec, s: int, b: int) -> int:
    transformers = pytest.importorskip("transformers")
    gpt2 = spec.mlp.value == "gelu"

    def build(n):
        torch.manual_seed(0)
        if gpt2:
            cfg = transformers.GPT2Config(n_layer=n, n_embd=spec.hidden, n_head=spec.heads, vocab_size=spec.vocab,
                                          n_positions=spec.max_positions, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0, use_cache=False)
            model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
        else:
            cfg = transformers.LlamaConfig(num_hidden_layers=n, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                                           num_key_value_heads=spec.kv_heads, intermediate_size=spec.ffn,
                                           vocab_size=spec.vocab, max_position_embeddings=spec.max_positions,
                                           use_cache=False)
            model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        return model.to(torch.bfloat16)

    ids = torch.randint(0, spec.vocab, (b, s))

    def run(model):
        return saved_bytes(lambda: model.model(input_ids=ids).last_hidden_state if not gpt2
                           else model.transformer(input_ids=ids).last_hidden_state,
                           list(model.parameters()) + list(model.buffers()))

    return run(build(2)) - run(build(1))


LLAMA = dict(layers=2, hidden=64, heads=4, ffn=160, vocab=256, max_positions=128)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_torchtitan_count_matches_a_trace_of_its_code(kv_heads):
    spec = preset("llama-2-7b", impl="torchtitan", kv_heads=kv_heads, **LLAMA)
    counted = act.layer_activations(spec, S, B, Precision.BF16, Backend.CPU, act.Impl.TT_LLAMA).total
    assert counted == torchtitan_layer_bytes(spec, S, B)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_hf_llama_count_matches_a_trace_of_transformers(kv_heads):
    spec = preset("llama-2-7b", kv_heads=kv_heads, **LLAMA)
    counted = act.layer_activations(spec, S, B, Precision.BF16, Backend.CPU, act.Impl.HF_LLAMA).total
    assert counted == hf_layer_bytes(spec, S, B)


def test_hf_gpt2_count_matches_a_trace_of_transformers():
    spec = preset("gpt2", layers=2, hidden=64, heads=4, vocab=256, max_positions=128)
    counted = act.layer_activations(spec, S, B, Precision.BF16, Backend.CPU, act.Impl.HF_GPT2).total
    assert counted == hf_layer_bytes(spec, S, B)


# -- nanoGPT's GPT block, re-written from karpathy/nanoGPT model.py (CausalSelfAttention with the flash path,
# MLP with nn.GELU, LayerNorm with bias=False)
class NanoBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False)
        self.c_attn, self.attn_proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.c_fc, self.gelu, self.mlp_proj = nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False)

    def attn(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))


def test_nanogpt_count_matches_a_trace_of_its_code():
    spec = preset("gpt2", impl="nanogpt", bias=False, layers=2, hidden=64, heads=4, vocab=256, max_positions=128)
    x = torch.randn(B, S, 64, dtype=torch.bfloat16, requires_grad=True)

    def run(n):
        torch.manual_seed(0)
        blocks = nn.Sequential(*(NanoBlock(64, 4) for _ in range(n))).to(torch.bfloat16)
        return saved_bytes(lambda: blocks(x), list(blocks.parameters()))

    counted = act.layer_activations(spec, S, B, Precision.BF16, Backend.CPU, act.Impl.NANOGPT).total
    assert counted == run(2) - run(1)


def test_implementations_keep_different_bytes_at_the_same_shape():
    """The reason --impl exists: at llama-2-13b's published torchtitan shape (seq 4096, micro-batch 2, bf16 on a
    GPU), transformers' Llama keeps its RMSNorm's fp32 upcast where torchtitan's fused nn.RMSNorm keeps the input."""
    spec = preset("llama-2-13b")
    hf = act.layer_activations(spec, 4096, 2, Precision.BF16_FSDP, Backend.CUDA, act.Impl.HF_LLAMA)
    tt = act.layer_activations(spec, 4096, 2, Precision.BF16_FSDP, Backend.CUDA, act.Impl.TT_LLAMA)
    sbh = 4096 * 2 * 5120
    # per norm: the fp32 upcast (4 B) and x * rstd cast back (2 B) where the fused kernel keeps the bf16 input (2 B)
    assert hf.norms - tt.norms == 2 * (4 * sbh)
    assert (hf.qkv, hf.mlp) == (tt.qkv, tt.mlp)  # rotated q, k and v; gate, silu, up, product
