#!/usr/bin/env python3
"""Exports the ONNX test models from PyTorch modules written like GPT-2 and Llama.

The sizes are those of the zoo's `gpt-tiny` and `llama-tiny` (2 blocks, hidden 64, 4 heads,
sequence 32, vocabulary 256; Llama with 2 key/value heads and a SwiGLU width of 128), so that
an imported model and the zoo model of the same shape can be compared plan for plan.

    python3 frontends/tests/onnx/make_models.py [OUT_DIR]

writes `gpt2-tiny.onnx` (weights inside the file), `llama-tiny.onnx` with its weights in
the external-data file `llama-tiny.onnx.data`, and `gpt2-tiny-opset14.onnx`, whose layer
norms the exporter decomposes (opset 14 has no `LayerNormalization`). The batch dim is symbolic (`batch`).
Needs torch and onnx; the weights are drawn from a fixed seed, so the files are reproducible
on one PyTorch version.
"""

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 64, 4, 32, 256
KV_HEADS, FFN, ROPE_BASE, EPS = 2, 128, 10000.0, 1e-5


class GptAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x):
        b, s, h = x.shape
        d = h // HEADS
        q = self.q_proj(x).view(b, s, HEADS, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, HEADS, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, HEADS, d).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        att = att.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, s, h)
        return self.c_proj(y)


class GptMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.c_proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GptBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN, eps=EPS)
        self.attn = GptAttention()
        self.ln_2 = nn.LayerNorm(HIDDEN, eps=EPS)
        self.mlp = GptMlp()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.h = nn.ModuleList([GptBlock() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(HIDDEN, eps=EPS)

    def forward(self, tokens):
        s = tokens.shape[1]
        pos = torch.arange(0, s, dtype=torch.long, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        # The output layer is tied to the token embedding, as in GPT-2.
        return F.linear(self.ln_f(x), self.wte.weight)


class RmsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + EPS))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        d = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * d, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * d, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * d, bias=False)
        self.o_proj = nn.Linear(HEADS * d, HIDDEN, bias=False)
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        d = HIDDEN // HEADS
        q = self.q_proj(x).view(b, s, HEADS, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, d).transpose(1, 2)
        t = torch.arange(s, dtype=torch.float32, device=x.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Grouped-query attention: every key/value head serves HEADS / KV_HEADS query heads.
        rep = HEADS // KV_HEADS
        k = k[:, :, None, :, :].expand(b, KV_HEADS, rep, s, d).reshape(b, HEADS, s, d)
        v = v[:, :, None, :, :].expand(b, KV_HEADS, rep, s, d).reshape(b, HEADS, s, d)
        att = (q @ k.transpose(2, 3)) / math.sqrt(d)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        att = F.softmax(att + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, HIDDEN)
        return self.o_proj(y)


class LlamaMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RmsNorm()
        self.self_attn = LlamaAttention()
        self.post_attention_layernorm = RmsNorm()
        self.mlp = LlamaMlp()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([LlamaBlock() for _ in range(LAYERS)])
        self.norm = RmsNorm()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def export(model, path, external_data, opset=17):
    import onnx

    model.eval()
    # As after training: no two weights alike (the exporter merges initializers with equal
    # values, which would tie the norms of different layers).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    torch.onnx.export(
        model,
        (tokens,),
        path,
        input_names=["tokens"],
        output_names=["logits"],
        dynamic_axes={"tokens": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=opset,
        do_constant_folding=True,
        dynamo=False,
    )
    if external_data:
        m = onnx.load(path)
        data = os.path.basename(path) + ".data"
        if os.path.exists(os.path.join(os.path.dirname(path), data)):
            os.remove(os.path.join(os.path.dirname(path), data))
        onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=data, size_threshold=0)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    torch.manual_seed(0)
    export(Gpt2(), os.path.join(out, "gpt2-tiny.onnx"), external_data=False)
    torch.manual_seed(1)
    export(Llama(), os.path.join(out, "llama-tiny.onnx"), external_data=True)
    # Opset 14 has no LayerNormalization: the exporter decomposes it into reductions.
    torch.manual_seed(2)
    export(Gpt2(), os.path.join(out, "gpt2-tiny-opset14.onnx"), external_data=False, opset=14)


if __name__ == "__main__":
    main()
