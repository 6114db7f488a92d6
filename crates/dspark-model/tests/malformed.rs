//! Damaged and hostile model files: thousands of mutated GGUF headers, GGUF metadata,
//! safetensors headers and `config.json`s, each of which must load with an error or load and run
//! a forward pass, never panic or abort.

use candle_core::quantized::gguf_file::Value;
use dspark_model::testing::{config_json, gguf_parts, weights, write_gguf_parts, write_hf, Tiny};
use dspark_model::{Model, SeqInput, TapSpec};
use rand::{Rng, SeedableRng};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

fn tiny() -> Tiny {
    Tiny { family: "llama", hidden: 32, heads: 2, kv_heads: 1, head_dim: 16, layers: 1, ffn: 64 }
}

/// Loads `path`; a model that loads must also run. Returns whether it loaded.
fn survives(path: &Path, what: &str) -> bool {
    let r = catch_unwind(AssertUnwindSafe(|| match Model::load(path) {
        Ok(m) => {
            let mut cache = m.new_cache(8);
            let _ = m.forward(&mut [SeqInput::logits_all(&mut cache, &[1, 2, 3])], &TapSpec::default());
            true
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.is_empty(), "{what}: empty error");
            false
        }
    }));
    r.unwrap_or_else(|_| panic!("{what}: loading panicked"))
}

const INTERESTING: [u64; 12] =
    [0, 1, 2, 3, 15, 33, 1 << 31, u32::MAX as u64, 1 << 32, 1_000_000_000, 1 << 63, u64::MAX];

fn values() -> Vec<Value> {
    let mut v: Vec<Value> = INTERESTING.iter().map(|&x| Value::U64(x)).collect();
    v.extend([0, 1, 2, 3, 1_000_000_000].map(Value::U32));
    v.extend([-1, i32::MIN].map(Value::I32));
    v.extend([f32::NAN, f32::INFINITY, -1.0, 0.0, 1e9, 0.5].map(Value::F32));
    v.extend([Value::String("x".into()), Value::Bool(true), Value::Array(vec![])]);
    v
}

/// Where a tensor's info (`n_dims`, dims, dtype, offset) starts in a GGUF file.
fn tensor_info_at(bytes: &[u8], name: &str) -> usize {
    let mut pat = (name.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(name.as_bytes());
    let i = bytes.windows(pat.len()).position(|w| w == pat).expect("tensor info in the header");
    i + pat.len()
}

#[test]
fn mutated_gguf_files_never_panic() {
    let t = tiny();
    let w = weights(&t, 7);
    let (md, tensors) = gguf_parts(&t, &w);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_gguf_parts(&path, &md, &tensors);
    let base = std::fs::read(&path).unwrap();
    assert!(survives(&path, "the unmutated file"), "the unmutated file must load");
    let mut cases = 0;
    // Every metadata value replaced by every interesting value (and removed).
    for i in 0..md.len() {
        for v in values().into_iter().map(Some).chain([None]) {
            let mut m = md.clone();
            match v {
                Some(v) => m[i].1 = v,
                None => {
                    m.remove(i);
                }
            }
            write_gguf_parts(&path, &m, &tensors);
            survives(&path, &format!("metadata {} = {:?}", md[i].0, m.get(i).map(|x| &x.1)));
            cases += 1;
        }
    }
    for extra in [("general.alignment", 0u32), ("general.alignment", 3), ("general.alignment", 1 << 30)] {
        let mut m = md.clone();
        m.push((extra.0.into(), Value::U32(extra.1)));
        write_gguf_parts(&path, &m, &tensors);
        survives(&path, &format!("{} = {}", extra.0, extra.1));
        cases += 1;
    }
    // Tensor infos: dimensions, their count, the type and the offset.
    for (name, _) in &tensors {
        let at = tensor_info_at(&base, name);
        let n_dims = u32::from_le_bytes(base[at..at + 4].try_into().unwrap()) as usize;
        let mut patch = |pos: usize, val: &[u8], what: String| {
            let mut b = base.clone();
            b[pos..pos + val.len()].copy_from_slice(val);
            std::fs::write(&path, &b).unwrap();
            survives(&path, &format!("{name}: {what}"));
            cases += 1;
        };
        for d in 0..n_dims {
            for x in INTERESTING {
                patch(at + 4 + 8 * d, &x.to_le_bytes(), format!("dim {d} = {x}"));
            }
        }
        for n in [0u32, 1, 2, 3, 4, 5, 64, u32::MAX] {
            patch(at, &n.to_le_bytes(), format!("{n} dims"));
        }
        let after = at + 4 + 8 * n_dims;
        for ty in [0u32, 1, 2, 8, 12, 14, 30, 1000, u32::MAX] {
            patch(after, &ty.to_le_bytes(), format!("type {ty}"));
        }
        for off in [1u64, 31, 32, 1 << 20, 1 << 40, u64::MAX - 7] {
            patch(after + 4, &off.to_le_bytes(), format!("offset {off}"));
        }
    }
    // Random damage in the header: flipped bytes, interesting words, truncation.
    let header_end = tensor_info_at(&base, &tensors.last().unwrap().0) + 32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    for case in 0..1500 {
        let mut b = base.clone();
        match case % 3 {
            0 => {
                for _ in 0..rng.random_range(1..4) {
                    let i = rng.random_range(0..header_end);
                    b[i] ^= 1 << rng.random_range(0..8);
                }
            }
            1 => {
                let i = rng.random_range(0..header_end - 8);
                let x = INTERESTING[rng.random_range(0..INTERESTING.len())];
                let n = if rng.random_bool(0.5) { 8 } else { 4 };
                b[i..i + n].copy_from_slice(&x.to_le_bytes()[..n]);
            }
            _ => b.truncate(rng.random_range(0..base.len())),
        }
        std::fs::write(&path, &b).unwrap();
        survives(&path, &format!("random case {case}"));
        cases += 1;
    }
    assert!(cases > 2000, "{cases} cases");
}

#[test]
fn mutated_safetensors_and_configs_never_panic() {
    let t = tiny();
    let w = weights(&t, 7);
    let dir = tempfile::tempdir().unwrap();
    write_hf(dir.path(), &t, &w);
    assert!(survives(dir.path(), "the unmutated directory"));
    let st = dir.path().join("model.safetensors");
    let base = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&base[8..8 + n]).unwrap();
    let names: Vec<String> =
        header.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect();
    let with_header = |h: &serde_json::Value| {
        let mut text = h.to_string().into_bytes();
        while !text.len().is_multiple_of(8) {
            text.push(b' ');
        }
        let mut b = (text.len() as u64).to_le_bytes().to_vec();
        b.extend(text);
        b.extend_from_slice(&base[8 + n..]);
        b
    };
    let mut cases = 0;
    let big = [0u64, 1, 3, 1 << 32, 1 << 62, u64::MAX];
    for name in &names {
        for field in ["shape", "data_offsets"] {
            for j in 0..2 {
                for &x in &big {
                    let mut h = header.clone();
                    if let Some(a) = h[name][field].as_array_mut() {
                        if j < a.len() {
                            a[j] = x.into();
                        }
                    }
                    std::fs::write(&st, with_header(&h)).unwrap();
                    survives(dir.path(), &format!("{name}.{field}[{j}] = {x}"));
                    cases += 1;
                }
            }
        }
        for dtype in ["F16", "BF16", "I64", "U8", "BOOL", "F64", "XX"] {
            let mut h = header.clone();
            h[name]["dtype"] = dtype.into();
            std::fs::write(&st, with_header(&h)).unwrap();
            survives(dir.path(), &format!("{name}.dtype = {dtype}"));
            cases += 1;
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    for case in 0..600 {
        let mut b = base.clone();
        match case % 3 {
            0 => {
                let i = rng.random_range(0..8 + n);
                b[i] ^= 1 << rng.random_range(0..8);
            }
            1 => {
                let x = big[rng.random_range(0..big.len())];
                b[..8].copy_from_slice(&x.to_le_bytes());
            }
            _ => b.truncate(rng.random_range(0..base.len())),
        }
        std::fs::write(&st, &b).unwrap();
        survives(dir.path(), &format!("random safetensors case {case}"));
        cases += 1;
    }
    std::fs::write(&st, &base).unwrap();
    // config.json: every size set to every interesting value.
    let cfg = config_json(&t);
    for key in cfg.as_object().unwrap().keys() {
        for v in [
            serde_json::json!(0),
            serde_json::json!(1),
            serde_json::json!(3),
            serde_json::json!(-1),
            serde_json::json!(1e9),
            serde_json::json!(1u64 << 40),
            serde_json::json!(u64::MAX),
            serde_json::json!("x"),
            serde_json::json!(null),
        ] {
            let mut c = cfg.clone();
            c[key] = v.clone();
            std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
            survives(dir.path(), &format!("config.json {key} = {v}"));
            cases += 1;
        }
    }
    assert!(cases > 1000, "{cases} cases");
}

/// The specific files of the issue get errors that say what is wrong.
#[test]
fn damaged_sizes_are_named_in_the_error() {
    let t = tiny();
    let w = weights(&t, 7);
    let (md, tensors) = gguf_parts(&t, &w);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    for (key, v, says) in [
        ("llama.attention.head_count", Value::U32(0), "head_count` is 0"),
        ("llama.attention.head_count_kv", Value::U32(0), "key/value head count is 0"),
        ("llama.attention.head_count_kv", Value::U32(3), "cannot share 3 key/value heads"),
        ("llama.block_count", Value::U32(1_000_000_000), "not a valid size"),
        ("llama.block_count", Value::U32(1_000_000), "lacks tensor `blk.1."),
        ("llama.embedding_length", Value::U32(48), "has shape"),
    ] {
        let mut m = md.clone();
        m.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
        write_gguf_parts(&path, &m, &tensors);
        let err = Model::load(&path).err().unwrap_or_else(|| panic!("{key} accepted")).to_string();
        assert!(err.contains(says), "{key}: `{err}` should say `{says}`");
    }
    write_gguf_parts(&path, &md, &tensors);
    let base = std::fs::read(&path).unwrap();
    for (x, says) in [(0u64, "empty dimension"), (1 << 63, "impossible dimensions")] {
        let mut b = base.clone();
        let at = tensor_info_at(&base, "token_embd.weight") + 4;
        b[at..at + 8].copy_from_slice(&x.to_le_bytes());
        std::fs::write(&path, &b).unwrap();
        let err = Model::load(&path).err().unwrap().to_string();
        assert!(err.contains(says), "dim {x}: `{err}` should say `{says}`");
    }
}

/// Corrupt weights: a NaN in a norm vector or in a quantized block's f16 scale is an error at
/// load, naming the tensor; finite weights whose logits overflow are an error at the forward
/// pass, never sampled into text.
#[test]
fn corrupt_weights_are_errors_not_text() {
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
    let t = tiny();
    let w = weights(&t, 7);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let md = gguf_parts(&t, &w).0;
    let swap = |name: &str, q: QTensor| {
        let mut ts = gguf_parts(&t, &w).1;
        ts.iter_mut().find(|(n, _)| n == name).unwrap().1 = q;
        ts
    };
    // Quantized: Q8_0 loads, and a NaN scale in one block is refused.
    let up = &w["model.layers.0.mlp.up_proj.weight"];
    let q = QTensor::quantize(up, GgmlDType::Q8_0).unwrap();
    write_gguf_parts(&path, &md, &swap("blk.0.ffn_up.weight", q));
    assert!(survives(&path, "Q8_0 weights"), "a Q8_0 tensor loads");
    let q = QTensor::quantize(up, GgmlDType::Q8_0).unwrap();
    let mut raw = q.data().unwrap().to_vec();
    raw[34 * 5..34 * 5 + 2].copy_from_slice(&0x7E00u16.to_le_bytes());
    let bad = qtensor_from_ggml(GgmlDType::Q8_0, &raw, vec![64, 32], &candle_core::Device::Cpu).unwrap();
    write_gguf_parts(&path, &md, &swap("blk.0.ffn_up.weight", bad));
    let err = Model::load(&path).err().expect("NaN scale refused").to_string();
    assert!(err.contains("blk.0.ffn_up.weight") && err.contains("scale (block 5)"), "{err}");
    // A norm vector.
    let mut v: Vec<f32> = w["model.norm.weight"].to_vec1().unwrap();
    v[4] = f32::INFINITY;
    let norm = candle_core::Tensor::from_vec(v, 32, &candle_core::Device::Cpu).unwrap();
    write_gguf_parts(
        &path,
        &md,
        &swap("output_norm.weight", QTensor::quantize(&norm, GgmlDType::F32).unwrap()),
    );
    let err = Model::load(&path).err().expect("inf norm refused").to_string();
    assert!(err.contains("output_norm.weight") && err.contains("corrupt"), "{err}");
    // Finite weights, overflowing logits: the forward pass reports it.
    let head = candle_core::Tensor::full(3e38f32, (96, 32), &candle_core::Device::Cpu).unwrap();
    let mut ts = gguf_parts(&t, &w).1;
    ts.push(("output.weight".into(), QTensor::quantize(&head, GgmlDType::F32).unwrap()));
    write_gguf_parts(&path, &md, &ts);
    let m = Model::load(&path).unwrap();
    let mut cache = m.new_cache(8);
    let err = m
        .forward(&mut [SeqInput::logits_all(&mut cache, &[1, 2, 3])], &TapSpec::default())
        .expect_err("overflowing logits are an error")
        .to_string();
    assert!(err.contains("non-finite logit"), "{err}");
}
