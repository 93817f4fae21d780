"""A GPT-style decoder and a BERT-style masked language model, both on scaled_dot_product_attention."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    """causal=True: GPT (next-token loss). causal=False: BERT-style MLM (loss on masked tokens)."""

    def __init__(self, vocab: int, seq_len: int, layers: int, dim: int, heads: int, causal: bool,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.vocab, self.causal, self.ckpt = vocab, causal, activation_checkpointing
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, causal) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt and self.training else block(x)
        logits = self.head(self.ln_f(x)).float()
        # targets of -100 (unmasked BERT positions) are ignored.
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1), ignore_index=-100)


def build_model(cfg):
    layers, dim, heads = cfg.layers_dim_heads()
    return Transformer(cfg.effective_vocab(), cfg.seq_len, layers, dim, heads,
                       causal=cfg.model == "gpt", activation_checkpointing=cfg.activation_checkpointing)


def flops_per_token(model: Transformer, cfg) -> float:
    """Model FLOPs per trained token, 6N + 12*L*d*T (PaLM appendix B; N without the token embedding)."""
    layers, dim, _ = cfg.layers_dim_heads()
    n = sum(p.numel() for p in model.parameters()) - model.tok.weight.numel()
    return 6 * n + 12 * layers * dim * cfg.seq_len


def largest_layer_params(model: Transformer) -> int:
    return max(sum(p.numel() for p in m.parameters()) for m in
               [model.tok, model.head] + list(model.blocks))
