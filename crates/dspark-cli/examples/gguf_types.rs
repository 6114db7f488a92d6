//! Counts tensor formats in a GGUF: `cargo run --release --example gguf_types -- FILE`.
use candle_core::quantized::gguf_file;
fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).expect("FILE");
    let c = gguf_file::Content::read(&mut std::fs::File::open(path)?)?;
    let mut by: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
    for (name, t) in &c.tensor_infos {
        let e = by.entry(format!("{:?}", t.ggml_dtype)).or_default();
        e.0 += 1;
        e.1 += t.shape.elem_count();
        if name.contains("output") || name.contains("token_embd") || name.starts_with("blk.0.") {
            println!("{name}: {:?} {:?}", t.ggml_dtype, t.shape);
        }
    }
    for (k, (n, e)) in by {
        println!("{k}: {n} tensors, {:.1} M values", e as f64 / 1e6);
    }
    Ok(())
}
