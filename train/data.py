"""Deterministic data: sample i is a pure function of (seed, i), so that a run resumed from a
checkpoint sees exactly the samples the uninterrupted run would have seen.

Global sample index for (step s, micro-batch k, rank r, row j):
    ((s * grad_accum + k) * world + r) * micro_batch + j
The data position kept in a checkpoint is the number of optimizer steps done.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

MASK_ID, PAD_ID = 256, 257  # byte-level special tokens (text path)


def load_tokens(cfg) -> np.ndarray | None:
    """The token stream for text/array data; None for synthetic."""
    if cfg.data == "synthetic":
        return None
    if cfg.data == "array":
        arr = np.load(cfg.data_path, mmap_mode="r")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{cfg.data_path}: expected a 1-D integer array of token ids")
        if int(arr.max()) >= cfg.effective_vocab():
            raise ValueError(f"{cfg.data_path}: token id {int(arr.max())} >= vocab_size {cfg.effective_vocab()}")
        return arr
    path = Path(cfg.data_path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    data = b"\n".join(p.read_bytes() for p in files)
    if len(data) < cfg.seq_len + 2:
        raise ValueError(f"{cfg.data_path}: {len(data)} bytes is shorter than seq_len + 2")
    return np.frombuffer(data, dtype=np.uint8)


class Batches:
    def __init__(self, cfg, tokens, micro_batch: int, grad_accum: int, world: int, rank: int):
        self.cfg, self.tokens = cfg, tokens
        self.mb, self.ga, self.world, self.rank = micro_batch, grad_accum, world, rank
        self.vocab = cfg.effective_vocab()

    def sample(self, i: int):
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
        if self.tokens is None:
            seq = torch.randint(0, min(self.vocab, 50000), (cfg.seq_len + 1,), generator=g)
            if cfg.model == "gpt":
                # Learnable synthetic data: a random start followed by a fixed arithmetic progression.
                seq = (seq[0] + torch.arange(cfg.seq_len + 1) * 7) % min(self.vocab, 50000)
        else:
            span = len(self.tokens) - cfg.seq_len - 1
            start = int(torch.randint(0, span, (1,), generator=g))
            seq = torch.from_numpy(np.asarray(self.tokens[start:start + cfg.seq_len + 1], dtype=np.int64))
        if cfg.model == "gpt":
            return seq[:-1], seq[1:]
        x = seq[:-1].clone()
        masked = torch.rand(cfg.seq_len, generator=g) < cfg.mask_prob
        masked[0] = True  # at least one target per sample
        y = torch.full_like(x, -100)
        y[masked] = x[masked]
        x[masked] = MASK_ID if self.tokens is not None and cfg.data == "text" else self.vocab - 1
        return x, y

    def micro_batch(self, step: int, k: int, device):
        base = ((step * self.ga + k) * self.world + self.rank) * self.mb
        xs, ys = zip(*(self.sample(base + j) for j in range(self.mb)), strict=True)
        return torch.stack(xs).to(device), torch.stack(ys).to(device)


def rank_info():
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
