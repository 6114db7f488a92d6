#!/usr/bin/env python3
"""Independent NumPy reference for a DSpark/DFlash block drafter (float64).

Written from the method's description (docs: DSPARK.md §2–3), not from dspark's Rust code:

  context:  H_ctx = RMSNorm(W_c [h_l1; ...; h_lm]) (hidden_norm)
            every layer: K_ctx, V_ctx from its own k/v projections of H_ctx (k-norm for qwen3,
            RoPE in the Hugging Face rotate-half layout at the context positions 0..n-1)
  block:    [anchor, MASK x (B-1)] at positions n..n+B-1, target embeddings; each layer:
            pre-norm attention (queries from the block, keys/values over [context; block],
            no mask) + SwiGLU MLP; final RMSNorm -> h
  logits:   U = h W_head^T over the draft vocabulary (target LM head rows d2t)
  DSpark:   x_0 = anchor; left to right, logits_k = U_k + bias_k,
            Markov bias_k = W1[x_{k-1}] W2^T;
            RNN: z = [s; W1[x_{k-1}]; h_k], (g|c|o) = cell(z), s = sig(g) s + (1-sig(g)) tanh(c),
                 bias_k = W2 tanh(o);
            confidence c_k = sig(z_k / T_k + b_k), z_k = w^T [h_k; W1[x_{k-1}]] + bias (the head's own
                 bias; T_k, b_k the calibration's temperature and offset);
            greedy: x_k = argmax logits_k.

Usage: dspark_drafter.py TARGET_DIR DRAFTER_DIR INPUTS_JSON -> prints JSON
INPUTS_JSON: {"taps": [[rows*d floats] per tapped layer], "rows": n, "anchor": id}
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "BF16": None}


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = DTYPES[info["dtype"]]
        arr = np.frombuffer(data[a:b], dtype=dt).reshape(info["shape"])
        out[name] = arr.astype(np.int64 if dt == np.int64 else np.float64)
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    # x: (T, heads, hd); rotate-half layout: pairs (i, i + hd/2)
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-2.0 * np.arange(half) / hd)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def linear(w, name, x):
    y = x @ w[name + ".weight"].T
    if name + ".bias" in w:
        y = y + w[name + ".bias"]
    return y


def main():
    target_dir, drafter_dir, inputs_path = sys.argv[1:4]
    cfg = json.load(open(f"{drafter_dir}/config.json"))
    ext = cfg.get("dspark") or {}
    w = load_safetensors(f"{drafter_dir}/model.safetensors")
    t = load_safetensors(f"{target_dir}/model.safetensors")
    inp = json.load(open(inputs_path))

    d, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    qwen3 = cfg["model_type"] == "qwen3"
    n, anchor = inp["rows"], inp["anchor"]
    B = cfg["block_size"]
    embed = t["model.embed_tokens.weight"]
    head = t.get("lm_head.weight", embed)
    if "d2t" in w:
        d2t = np.arange(len(w["d2t"])) + w["d2t"]
    else:
        d2t = np.arange(cfg["vocab_size"])
    head = head[d2t]

    feats = np.concatenate([np.asarray(x, dtype=np.float64).reshape(n, d) for x in inp["taps"]], axis=1)
    h_ctx = rms_norm(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)

    tokens = [anchor] + [cfg["mask_token_id"]] * (B - 1)
    x = embed[tokens]
    ctx_pos, blk_pos = list(range(n)), list(range(n, n + B))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."

        def kv(src, pos):
            k = linear(w, p + "self_attn.k_proj", src).reshape(len(pos), nkv, hd)
            if qwen3:
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
            v = linear(w, p + "self_attn.v_proj", src).reshape(len(pos), nkv, hd)
            return rope(k, pos, theta), v

        kc, vc = kv(h_ctx, ctx_pos)
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = linear(w, p + "self_attn.q_proj", h).reshape(B, nh, hd)
        if qwen3:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        q = rope(q, blk_pos, theta)
        kb, vb = kv(h, blk_pos)
        K, V = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        out = np.zeros((B, nh, hd))
        for hh in range(nh):
            g = hh // (nh // nkv)
            s = q[:, hh, :] @ K[:, g, :].T / np.sqrt(hd)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hh, :] = (s / s.sum(axis=1, keepdims=True)) @ V[:, g, :]
        x = x + linear(w, p + "self_attn.o_proj", out.reshape(B, nh * hd))
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = linear(w, p + "mlp.gate_proj", h)
        x = x + linear(w, p + "mlp.down_proj", gate * sigmoid(gate) * linear(w, p + "mlp.up_proj", h))
    hid = rms_norm(x, w["norm.weight"], eps)
    if ext.get("layout", "dspark") == "dflash":
        hid = hid[1:]
    U = hid @ head.T

    head_kind, r = ext.get("head"), ext.get("head_rank", cfg.get("markov_rank", 0))
    temps = ext.get("calibration_temperatures")
    biases = ext.get("calibration_biases")
    prev, state = anchor, np.zeros(r)
    logits, conf, toks = [], [], []
    for k in range(len(hid)):
        if head_kind == "markov":
            e = w["markov_head.markov_w1.weight"][prev]
            lk = U[k] + w["markov_head.markov_w2.weight"] @ e
        elif head_kind == "rnn":
            e = w["markov_head.markov_w1.weight"][prev]
            z = linear(w, "markov_head.joint_proj", np.concatenate([state, e, hid[k]]))
            g, c, o = z[:r], z[r:2 * r], z[2 * r:]
            state = sigmoid(g) * state + (1 - sigmoid(g)) * np.tanh(c)
            lk = U[k] + w["markov_head.markov_w2.weight"] @ np.tanh(o)
        else:
            e, lk = None, U[k]
        if "confidence_head.proj.weight" in w:
            zc = float(linear(w, "confidence_head.proj", np.concatenate([hid[k], e]))[0])
            T = temps[k] if temps else 1.0
            b = biases[k] if biases else 0.0
            conf.append(sigmoid(zc / T + b))
        idx = int(np.argmax(lk))
        prev = int(d2t[idx])
        logits.append(lk.tolist())
        toks.append(prev)
    print(json.dumps({"raw": U.tolist(), "logits": logits, "confidence": conf, "tokens": toks}))


if __name__ == "__main__":
    main()
