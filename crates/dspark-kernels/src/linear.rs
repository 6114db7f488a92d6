//! A linear layer over GGUF weights that routes each format to the fastest kernel we have.

use crate::format::QuantFormat;
use crate::packed::PackedMatrix;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Result, Tensor};
use std::sync::Arc;

/// Which implementation runs the non-K formats; `Candle` exists to benchmark against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelChoice {
    Ours,
    OursScalar,
    Candle,
}

impl KernelChoice {
    /// `DSPARK_KERNELS=candle|scalar|ours` (default ours).
    pub fn from_env() -> Self {
        match std::env::var("DSPARK_KERNELS").as_deref() {
            Ok("candle") => Self::Candle,
            Ok("scalar") => Self::OursScalar,
            _ => Self::Ours,
        }
    }
}

enum Inner {
    Ours { packed: Arc<PackedMatrix>, simd: bool },
    Candle(QMatMul),
    Dense(Tensor),
}

/// `y = x · Wᵀ` with `W` of shape `(out, in)`.
pub struct QLinear {
    inner: Inner,
    out_dim: usize,
    in_dim: usize,
}

impl QLinear {
    pub fn from_qtensor(qt: QTensor, choice: KernelChoice) -> Result<Self> {
        let (out_dim, in_dim) = qt.shape().dims2()?;
        let format = QuantFormat::from_ggml(qt.dtype());
        let inner = match (format, choice) {
            (Some(format), KernelChoice::Ours | KernelChoice::OursScalar) if in_dim % 32 == 0 => {
                Inner::Ours {
                    packed: Arc::new(PackedMatrix::from_gguf(format, &qt.data()?, out_dim, in_dim)),
                    simd: choice == KernelChoice::Ours,
                }
            }
            _ => Inner::Candle(QMatMul::from_qtensor(qt)?),
        };
        Ok(Self { inner, out_dim, in_dim })
    }

    /// A dense f32 weight of shape `(out, in)` (Hugging Face checkpoints, tests).
    pub fn from_dense(w: Tensor) -> Result<Self> {
        let (out_dim, in_dim) = w.dims2()?;
        let w = w.to_dtype(DType::F32)?.t()?.contiguous()?;
        Ok(Self { inner: Inner::Dense(w), out_dim, in_dim })
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// `x`: `(rows, in)` f32 → `(rows, out)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.inner {
            Inner::Ours { .. } => {
                let (rows, _) = x.dims2()?;
                let xv = x.contiguous()?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Tensor::from_vec(self.forward_slice(&xv, rows)?, (rows, self.out_dim), &Device::Cpu)
            }
            Inner::Candle(q) => q.forward(x),
            Inner::Dense(wt) => x.matmul(wt),
        }
    }

    /// `x`: `rows × in` → `rows × out`, without tensor round trips on our kernels' path.
    pub fn forward_slice(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        match &self.inner {
            Inner::Ours { packed, simd } => {
                let mut y = vec![0f32; rows * self.out_dim];
                crate::matmul(packed, x, rows, &mut y, *simd);
                Ok(y)
            }
            _ => {
                let xt = Tensor::from_slice(x, (rows, self.in_dim), &Device::Cpu)?;
                self.forward(&xt)?.flatten_all()?.to_vec1()
            }
        }
    }

    /// The layer restricted to output rows `ids`, in the same format (same kernels, same
    /// arithmetic per row).
    pub fn select_rows(&self, ids: &[usize]) -> Result<Self> {
        let inner = match &self.inner {
            Inner::Ours { packed, simd } => {
                Inner::Ours { packed: Arc::new(packed.select_rows(ids)), simd: *simd }
            }
            _ => {
                let mut w = Vec::with_capacity(ids.len() * self.in_dim);
                for &i in ids {
                    w.extend(self.row(i)?);
                }
                return Self::from_dense(Tensor::from_vec(w, (ids.len(), self.in_dim), &Device::Cpu)?);
            }
        };
        Ok(Self { inner, out_dim: ids.len(), in_dim: self.in_dim })
    }

    /// Row `i` of `W` as f32 (embedding lookup on a tied table).
    pub fn row(&self, i: usize) -> Result<Vec<f32>> {
        match &self.inner {
            Inner::Ours { packed, .. } => {
                let mut out = vec![0f32; self.in_dim];
                packed.dequantize_row(i, &mut out);
                Ok(out)
            }
            Inner::Candle(QMatMul::QTensor(q)) => {
                let ids = Tensor::new(&[i as u32], &Device::Cpu)?;
                q.embedding(&ids)?.flatten_all()?.to_vec1()
            }
            Inner::Candle(QMatMul::Tensor(t)) | Inner::Candle(QMatMul::TensorF16(t)) => {
                t.get(i)?.to_dtype(DType::F32)?.to_vec1()
            }
            Inner::Dense(wt) => wt.narrow(1, i, 1)?.flatten_all()?.to_vec1(),
        }
    }
}
