"""The PyTorch twin of scripts/gpu-check.sh.

`gpt2`: a GPT-2-small training step (12 layers, hidden 768, 12 heads, seq 1024, vocab
50304, bf16 autocast, AdamW, batch 8), timed in eager mode and with torch.compile; prints
`eager <tokens/s>` and `compile <tokens/s>`.

`allreduce`: NCCL all-reduce of 256 MiB over every GPU (torch.distributed, one process per
GPU); prints `busbw <GB/s> GB/s` in nccl-tests' convention, 2 (n - 1) / n times the
algorithm bandwidth.
"""

import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        shape = (b, s, self.heads, h // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers=12, hidden=768, heads=12, seq=1024, vocab=50304):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids, targets):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def gpt2(steps=10, batch=8, seq=1024, vocab=50304):
    for mode in ("eager", "compile"):
        torch.manual_seed(0)
        model = Gpt().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        fn = torch.compile(model) if mode == "compile" else model
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        targets = torch.randint(0, vocab, (batch, seq), device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(ids, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / steps
        print(f"{mode} {batch * seq / per_step:.1f}", flush=True)


def allreduce_worker(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    x = torch.ones(64 * 1024 * 1024, device="cuda")
    for _ in range(5):
        torch.distributed.all_reduce(x)
    torch.cuda.synchronize()
    iters = 20
    start = time.perf_counter()
    for _ in range(iters):
        torch.distributed.all_reduce(x)
    torch.cuda.synchronize()
    t = (time.perf_counter() - start) / iters
    if rank == 0:
        algbw = x.numel() * 4 / t / 1e9
        print(f"busbw {algbw * 2 * (world - 1) / world:.1f} GB/s", flush=True)
    torch.distributed.destroy_process_group()


def allreduce():
    world = torch.cuda.device_count()
    torch.multiprocessing.spawn(allreduce_worker, args=(world, 29517), nprocs=world)


if __name__ == "__main__":
    {"gpt2": gpt2, "allreduce": allreduce}[sys.argv[1]]()
