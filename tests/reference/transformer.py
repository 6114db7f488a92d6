#!/usr/bin/env python3
"""Independent reference forward pass for tiny Hugging Face checkpoints (pure Python, float64).

Written from the architectures' definitions (Hugging Face `modeling_*.py` conventions), not from
dspark's Rust code: llama, qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm), gemma3 (pre/post
norms with (1 + w), sqrt(d) embedding scale, q/k norm, GELU-tanh MLP, sliding-window layers with
a local RoPE base).

Usage: transformer.py MODEL_DIR TOKEN_IDS_JSON  ->  prints {"logits": [[...] per position]}
"""
import json
import math
import struct
import sys


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", f"{name}: only F32 supported here"
        a, b = info["data_offsets"]
        flat = list(struct.unpack(f"<{(b - a) // 4}f", data[a:b]))
        shape = info["shape"]
        if len(shape) == 2:
            r, c = shape
            out[name] = [flat[i * c:(i + 1) * c] for i in range(r)]
        else:
            out[name] = flat
    return out


def matvec(w, x):  # w: rows of length len(x)
    return [sum(wi * xi for wi, xi in zip(row, x)) for row in w]


def rms_norm(x, w, eps, add_one):
    ms = sum(v * v for v in x) / len(x)
    inv = 1.0 / math.sqrt(ms + eps)
    return [v * inv * ((1.0 + g) if add_one else g) for v, g in zip(x, w)]


def rope(x, pos, theta):  # rotate the two halves of one head
    d = len(x)
    half = d // 2
    out = list(x)
    for i in range(half):
        ang = pos * theta ** (-2.0 * i / d)
        c, s = math.cos(ang), math.sin(ang)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i] * s + x[i + half] * c
    return out


def silu(v):
    return v / (1.0 + math.exp(-v))


def gelu_tanh(v):
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def forward(cfg, w, ids):
    mt = cfg["model_type"]
    gemma = mt.startswith("gemma3")
    d = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", d // nh)
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    theta_local = cfg.get("rope_local_base_freq", 10000.0)
    window = cfg.get("sliding_window", 512)
    pattern = cfg.get("sliding_window_pattern", 6)
    scale = 1.0 / math.sqrt(cfg.get("query_pre_attn_scalar", hd) if gemma else hd)
    L = cfg["num_hidden_layers"]
    emb = w["model.embed_tokens.weight"]
    head = w.get("lm_head.weight", emb)

    xs = []
    for t in ids:
        e = list(emb[t])
        if gemma:
            e = [v * math.sqrt(d) for v in e]
        xs.append(e)
    n = len(ids)
    for l in range(L):
        p = f"model.layers.{l}."
        sliding = gemma and (l + 1) % pattern != 0
        th = theta_local if sliding else theta
        qs, ks, vs = [], [], []
        for pos, x in enumerate(xs):
            h = rms_norm(x, w[p + "input_layernorm.weight"], eps, gemma)
            q = matvec(w[p + "self_attn.q_proj.weight"], h)
            k = matvec(w[p + "self_attn.k_proj.weight"], h)
            v = matvec(w[p + "self_attn.v_proj.weight"], h)
            if p + "self_attn.q_proj.bias" in w:
                q = [a + b for a, b in zip(q, w[p + "self_attn.q_proj.bias"])]
                k = [a + b for a, b in zip(k, w[p + "self_attn.k_proj.bias"])]
                v = [a + b for a, b in zip(v, w[p + "self_attn.v_proj.bias"])]
            qh = [q[i * hd:(i + 1) * hd] for i in range(nh)]
            kh = [k[i * hd:(i + 1) * hd] for i in range(nkv)]
            vh = [v[i * hd:(i + 1) * hd] for i in range(nkv)]
            if p + "self_attn.q_norm.weight" in w:
                qh = [rms_norm(a, w[p + "self_attn.q_norm.weight"], eps, gemma) for a in qh]
                kh = [rms_norm(a, w[p + "self_attn.k_norm.weight"], eps, gemma) for a in kh]
            qs.append([rope(a, pos, th) for a in qh])
            ks.append([rope(a, pos, th) for a in kh])
            vs.append(vh)
        new = []
        for i in range(n):
            att = []
            for hh in range(nh):
                g = hh // (nh // nkv)
                keys = [j for j in range(i + 1) if not (sliding and i - j >= window)]
                sc = [scale * sum(a * b for a, b in zip(qs[i][hh], ks[j][g])) for j in keys]
                m = max(sc)
                ex = [math.exp(s - m) for s in sc]
                z = sum(ex)
                o = [0.0] * hd
                for e, j in zip(ex, keys):
                    for c in range(hd):
                        o[c] += e / z * vs[j][g][c]
                att.extend(o)
            a = matvec(w[p + "self_attn.o_proj.weight"], att)
            if gemma:
                a = rms_norm(a, w[p + "post_attention_layernorm.weight"], eps, True)
            x = [u + v for u, v in zip(xs[i], a)]
            pre = "pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"
            h = rms_norm(x, w[p + pre], eps, gemma)
            gt = matvec(w[p + "mlp.gate_proj.weight"], h)
            up = matvec(w[p + "mlp.up_proj.weight"], h)
            act = gelu_tanh if gemma else silu
            mlp = matvec(w[p + "mlp.down_proj.weight"], [act(a) * b for a, b in zip(gt, up)])
            if gemma:
                mlp = rms_norm(mlp, w[p + "post_feedforward_layernorm.weight"], eps, True)
            new.append([u + v for u, v in zip(x, mlp)])
        xs = new
    return [matvec(head, rms_norm(x, w["model.norm.weight"], eps, gemma)) for x in xs]


def main():
    model_dir, ids = sys.argv[1], json.loads(sys.argv[2])
    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    w = load_safetensors(f"{model_dir}/model.safetensors")
    print(json.dumps({"logits": forward(cfg, w, ids)}))


if __name__ == "__main__":
    main()
