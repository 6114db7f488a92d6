use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use dspark_kernels::{KernelChoice, QLinear};
fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let mut f = std::fs::File::open(&a[1])?;
    let c = gguf_file::Content::read(&mut f)?;
    for name in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"] {
        let q = c.tensor(&mut f, name, &Device::Cpu)?;
        println!("{name} {:?} {:?}", q.dtype(), q.shape());
        let (_, k) = q.shape().dims2()?;
        let dense = q.dequantize(&Device::Cpu)?;
        let x = (Tensor::randn(0f32, 1.0, (3, k), &Device::Cpu)? * 3.0)?;
        let want = x.matmul(&dense.t()?)?;
        for ch in [KernelChoice::Ours, KernelChoice::OursScalar, KernelChoice::Candle] {
            let l = QLinear::from_qtensor(c.tensor(&mut f, name, &Device::Cpu)?, ch)?;
            let got = l.forward(&x)?;
            let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            println!("  {ch:?} max err {err}");
        }
    }
    Ok(())
}
