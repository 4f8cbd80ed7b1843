#!/usr/bin/env python3
"""The PyTorch twin of autopar's `gpt:` models, the anchor of `benches/step_cpu.rs`.

It builds what `frontends/src/zoo/gpt.rs` builds: token and position embeddings (the token
embedding tied to the output layer), pre-norm blocks of layer norm (eps 1e-5), causal
multi-head attention with biased query/key/value/output projections, and a tanh-GELU MLP of
width 4*hidden with biases, a final layer norm, and the mean next-token cross-entropy. The step
is the CLI's default training step: backward, gradient clipping to a global norm of 1.0, and
AdamW (lr 3e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.01), in f32 eager mode.

Prints one JSON line: {"steps_per_sec": ..., "threads": ..., "step_ms": [...]}.

With --serve it builds the model once, runs the warm-up steps, prints {"ready": true}, then
answers each line N on standard input with the times of N more steps, one JSON line
{"step_ms": [...]} each, until the input ends: the bench alternates rounds of autopar's step
and PyTorch's in one run, so that a change in the machine's speed falls on both.
"""

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden, eps=1e-5)
        self.q = torch.nn.Linear(hidden, hidden)
        self.k = torch.nn.Linear(hidden, hidden)
        self.v = torch.nn.Linear(hidden, hidden)
        self.o = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=1e-5)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        a = self.ln1(x)
        split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        q, k, v = split(self.q(a)), split(self.k(a)), split(self.v(a))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, h))
        a = self.ln2(x)
        return x + self.fc2(F.gelu(self.fc1(a), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, layers, hidden, heads, seq, vocab):
        super().__init__()
        self.wte = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.02)
        self.wpe = torch.nn.Parameter(torch.randn(seq, hidden) * 0.01)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, tokens, targets):
        x = self.wte[tokens] + self.wpe
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("hidden", 256), ("heads", 8), ("seq", 128),
                          ("vocab", 4096), ("batch", 8), ("threads", 1), ("steps", 10),
                          ("warmup", 2)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--serve", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Gpt(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq))
    targets = torch.randint(0, a.vocab, (a.batch, a.seq))

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        step()
    if a.serve:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            times = [step() for _ in range(int(line))]
            print(json.dumps({"step_ms": [round(t * 1e3, 3) for t in times]}), flush=True)
        return
    times = sorted(step() for _ in range(a.steps))
    median = times[len(times) // 2]
    print(json.dumps({"steps_per_sec": 1.0 / median, "threads": a.threads,
                      "step_ms": [round(t * 1e3, 3) for t in times]}))


if __name__ == "__main__":
    main()
