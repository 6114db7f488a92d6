//! The building blocks of every drafter, written from candle's basic ops only: candle's fused
//! `softmax`/`rms_norm` have no backward pass, and the training code reuses these functions.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor, D};
use dspark_kernels::bf16::Mat;
use dspark_kernels::{KernelChoice, QLinear};
use std::sync::Arc;

/// `y = x · Wᵀ (+ b)` with `W` stored `(out, in)` as in PyTorch checkpoints.
#[derive(Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// A quantized copy of `weight` for drafting (Q4_0 by default, [`crate::DraftWeights`]): f32
    /// weights make drafting memory-bound (see `dspark bench draft`); training never sets it.
    fast: Option<Arc<QLinear>>,
    /// The weight in 8-bit panels instead of `fast` for a product this thin (the sequential
    /// heads' rank-32 `W2`, one row per drafted position): the Q8_0 kernels pay a fixed cost per
    /// output row and per 32-wide block, which at `in` = 32 is most of the work. See [`Panels`].
    thin: Option<Arc<Panels>>,
}

/// Widest input that drafts through [`Linear::thin`] rather than 8-bit kernels.
const THIN_IN: usize = 64;

/// Outputs per panel: four AVX2 registers of sums.
const PANEL: usize = 32;

/// `W` `(out, in)` in 8 bits, one scale per output row, as panels of [`PANEL`] outputs, each
/// stored by pairs of inputs (`in/2 × PANEL × 2`, as i16, outputs padded with zeros): a one-row
/// product reads the weights once, front to back, with a panel's sums in registers, and at `in`
/// = 32 and 8 192 outputs the whole weight (512 KB) stays in L2. The row `x` is quantized to i16
/// (one scale) so that a pair of inputs and 32 outputs is four `vpmaddwd`: converting 8-bit
/// weights to f32 instead costs two operations per weight and bounded the loop at a third of
/// that rate. Transposed f32 rows (`y += x_j · Wᵀ_j`) re-read and re-write the output once per
/// input and were 3–4× slower still.
#[derive(Debug)]
struct Panels {
    /// Per panel, per input pair `j`: `[w(o, 2j), w(o, 2j+1)]` for its outputs `o`.
    data: Vec<i16>,
    scale: Vec<f32>,
    inp: usize,
    /// `inp` rounded up to a pair.
    inp2: usize,
    out: usize,
}

impl Panels {
    fn new(w: &[f32], out: usize, inp: usize) -> Self {
        let np = out.div_ceil(PANEL);
        let inp2 = inp.next_multiple_of(2);
        let mut data = vec![0i16; np * inp2 * PANEL];
        let mut scale = vec![0f32; np * PANEL];
        for o in 0..out {
            let row = &w[o * inp..(o + 1) * inp];
            let s = row.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            scale[o] = s;
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            let (p, t) = (o / PANEL, o % PANEL);
            for (j, v) in row.iter().enumerate() {
                data[(p * inp2 + (j & !1)) * PANEL + 2 * t + (j & 1)] = (v * inv).round() as i16;
            }
        }
        Self { data, scale, inp, inp2, out }
    }

    /// `y += x · Wᵀ` for one row, `y` of length `out`.
    fn row(&self, x: &[f32], y: &mut [f32]) {
        // The row in i16, one scale: 15 bits keep its rounding (≤ 2⁻¹⁵ of its largest value)
        // far below the weights' 8 bits; sums of `in` ≤ 64 products of 127 · 32 767 fit i32.
        let amax = x[..self.inp].iter().fold(0f32, |m, v| m.max(v.abs()));
        let sx = amax / 32767.0;
        let inv = if sx > 0.0 { 1.0 / sx } else { 0.0 };
        let mut xq = vec![0i16; self.inp2];
        for (q, &v) in xq.iter_mut().zip(&x[..self.inp]) {
            *q = (v * inv).round() as i16;
        }
        let np = self.data.len() / (self.inp2 * PANEL);
        let mut acc = vec![0i32; np * PANEL];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was just detected.
            unsafe { self.sums_avx2(&xq, &mut acc) };
        } else {
            self.sums(&xq, &mut acc);
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.sums(&xq, &mut acc);
        for ((v, &a), s) in y.iter_mut().zip(&acc).zip(&self.scale) {
            *v += a as f32 * (s * sx);
        }
    }

    /// The integer sums `acc[o] = Σ_j xq[j] · w(o, j)`, panel by panel.
    fn sums(&self, xq: &[i16], acc: &mut [i32]) {
        let stride = self.inp2 * PANEL;
        for (panel, acc) in self.data.chunks_exact(stride).zip(acc.chunks_exact_mut(PANEL)) {
            for (x, w) in xq.chunks_exact(2).zip(panel.chunks_exact(2 * PANEL)) {
                for (a, w) in acc.iter_mut().zip(w.chunks_exact(2)) {
                    *a += i32::from(x[0]) * i32::from(w[0]) + i32::from(x[1]) * i32::from(w[1]);
                }
            }
        }
    }

    /// [`Self::sums`] two panels per pass over `x` (eight independent chains of `vpmaddwd` and
    /// adds, where one panel's four would wait on their latency). Integer sums: the same bits.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn sums_avx2(&self, xq: &[i16], acc: &mut [i32]) {
        use std::arch::x86_64::*;
        let stride = self.inp2 * PANEL;
        let np = self.data.len() / stride;
        assert!(xq.len() == self.inp2 && acc.len() == np * PANEL);
        let mut p = 0;
        while p < np {
            let two = p + 1 < np;
            let a = self.data[p * stride..].as_ptr() as *const __m256i;
            let b = if two { self.data[(p + 1) * stride..].as_ptr() as *const __m256i } else { a };
            let mut s = [_mm256_setzero_si256(); 8];
            for (j, x) in xq.chunks_exact(2).enumerate() {
                let xv = _mm256_set1_epi32((x[0] as u16 as i32) | ((x[1] as i32) << 16));
                // SAFETY: input pair `j` of a panel is 4 registers at `4j` inside panels `p`
                // and `p + 1` (`b` is `a` when there is no `p + 1`).
                unsafe {
                    let (pa, pb) = (a.add(4 * j), b.add(4 * j));
                    for r in 0..4 {
                        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_loadu_si256(pa.add(r)), xv));
                        s[4 + r] =
                            _mm256_add_epi32(s[4 + r], _mm256_madd_epi16(_mm256_loadu_si256(pb.add(r)), xv));
                    }
                }
            }
            let n = if two { 8 } else { 4 };
            for (r, v) in s.iter().enumerate().take(n) {
                // SAFETY: register r holds outputs `p·PANEL + 8r ..+ 8`, inside `acc`.
                unsafe { _mm256_storeu_si256(acc[p * PANEL + 8 * r..].as_mut_ptr() as *mut __m256i, *v) };
            }
            p += 2;
        }
    }
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match (&self.fast, &self.thin) {
            (Some(_), _) => " (quantized)",
            (None, Some(_)) => " (8-bit panels)",
            (None, None) => "",
        };
        write!(f, "Linear{:?}{kind}", self.weight.dims())
    }
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias, fast: None, thin: None }
    }

    /// Drafts through a copy of the weight in `format` (our quantized kernels) from now on, or
    /// through an 8-bit [`Panels`] copy where the input is too narrow for those to pay
    /// ([`THIN_IN`]).
    pub fn quantize(&mut self, format: GgmlDType) -> Result<()> {
        if self.weight.dim(1)? <= THIN_IN {
            let (out, inp) = self.weight.dims2()?;
            let w = self.weight.flatten_all()?.to_vec1::<f32>()?;
            self.thin = Some(Arc::new(Panels::new(&w, out, inp)));
        } else if self.weight.dim(1)? % 32 == 0 {
            let q = QTensor::quantize(&self.weight, format)?;
            self.fast = Some(Arc::new(QLinear::from_qtensor(q, KernelChoice::from_env())?));
        }
        Ok(())
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.fast {
            Some(q) => q.forward(&x.contiguous()?)?,
            None => matmul_t(x, &self.weight)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `x · wᵀ` (`x`: `(m, in)`, `w`: `(out, in)`) for training, whose backward pass computes only
/// the gradients that exist. candle's matmul backward always computes both sides, so a frozen
/// weight (the LM head) or a constant input (the target's features into `fc`) cost a whole extra
/// matmul per step, ~20 % of a training step's multiply-adds. Where the CPU has AVX-512-BF16
/// the forward and backward products run in bf16 with f32 sums ([`dspark_kernels::bf16`]),
/// twice candle's f32 rate; with nothing to differentiate (drafting) the product stays f32.
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (tx, tw) = (x.track_op(), w.track_op());
    let f32_2d = cpu_f32_2d(x, w);
    let bf16 = f32_2d && dspark_kernels::bf16::available();
    if !(tx || tw) || !f32_2d || (tx && tw && !bf16) {
        return x.matmul(&w.t()?);
    }
    let (value, shape) = if bf16 {
        product_vec(&x.detach(), false, &w.detach(), true)?
    } else {
        let y = x.detach().matmul(&w.detach().t()?)?;
        (y.flatten_all()?.to_vec1::<f32>()?, y.shape().clone())
    };
    let op = Precomputed {
        value: std::sync::Mutex::new(Some(value)),
        shape,
        grad: match (tx, tw) {
            (true, true) => GradRule::Both,
            (true, false) => GradRule::ConstW(w.detach()),
            _ => GradRule::ConstX(x.detach()),
        },
        bf16,
    };
    match (tx, tw) {
        (true, true) => x.apply_op2(w, op),
        (true, false) => x.apply_op1(op),
        _ => w.apply_op1(op),
    }
}

/// `x · wᵀ` of constants (no gradient) in bf16 products where the CPU has AVX-512-BF16, f32
/// elsewhere: training's label computations (the target's distribution over the draft
/// vocabulary), which a frozen quantized target only approximates to begin with.
pub fn matmul_t_const(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if cpu_f32_2d(x, w) && dspark_kernels::bf16::available() {
        product(&x.detach(), false, &w.detach(), true)
    } else {
        x.detach().matmul(&w.detach().t()?)
    }
}

/// Both operands 2-D f32 tensors on the CPU: what the precomputed products handle.
fn cpu_f32_2d(x: &Tensor, w: &Tensor) -> bool {
    x.rank() == 2
        && w.rank() == 2
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && x.device().is_cpu()
        && w.device().is_cpu()
}

/// `op(a) · op(b)` of 2-D f32 tensors with bf16 products, `op` transposing where asked.
fn product(a: &Tensor, ta: bool, b: &Tensor, tb: bool) -> Result<Tensor> {
    let (c, shape) = product_vec(a, ta, b, tb)?;
    Tensor::from_vec(c, shape, &Device::Cpu)
}

/// [`product`] as plain values and their shape.
fn product_vec(a: &Tensor, ta: bool, b: &Tensor, tb: bool) -> Result<(Vec<f32>, candle_core::Shape)> {
    with_mat(a, |am| {
        with_mat(b, |bm| {
            let (am, bm) = (if ta { am.t() } else { am }, if tb { bm.t() } else { bm });
            (dspark_kernels::bf16::matmul(am, bm), (am.rows, bm.cols).into())
        })
    })?
}

/// Runs `f` on a 2-D f32 CPU tensor's values, in place when it is contiguous or a transposed
/// contiguous view (as `w.t()` is), otherwise on a contiguous copy.
fn with_mat<R>(t: &Tensor, f: impl FnOnce(Mat) -> R) -> Result<R> {
    let (r, c) = t.dims2()?;
    {
        let (s, l) = t.storage_and_layout();
        if let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*s {
            if let Some((a, b)) = l.contiguous_offsets() {
                return Ok(f(Mat::new(&v[a..b], r, c)));
            }
            if l.is_fortran_contiguous() {
                let o = l.start_offset();
                return Ok(f(Mat::new(&v[o..o + r * c], c, r).t()));
            }
        }
    }
    let v = t.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(Mat::new(&v, r, c)))
}

/// A value computed outside the graph, attached to the tensors that need its gradient.
struct Precomputed {
    value: std::sync::Mutex<Option<Vec<f32>>>,
    shape: candle_core::Shape,
    grad: GradRule,
    /// Backward products in bf16 (as the forward's were).
    bf16: bool,
}

enum GradRule {
    /// The argument is `x` of `x · wᵀ`: `∂/∂x = G · w`.
    ConstW(Tensor),
    /// The argument is `w` of `x · wᵀ`: `∂/∂w = Gᵀ · x`.
    ConstX(Tensor),
    /// The arguments are `x` and `w` of `x · wᵀ`, both needing gradients.
    Both,
    /// The argument is anything, the value a scalar `L` with `∂L/∂arg = G` (a loss whose
    /// gradient was worked out by hand).
    Given(Tensor),
}

impl Precomputed {
    fn take(&self) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let v = self.value.lock().map_err(|_| candle_core::Error::Msg("poisoned".into()))?.take();
        let v = v.ok_or_else(|| candle_core::Error::Msg("a precomputed value is used once".into()))?;
        Ok((candle_core::CpuStorage::F32(v), self.shape.clone()))
    }

    /// `G · w`.
    fn grad_x(&self, g: &Tensor, w: &Tensor) -> Result<Tensor> {
        if self.bf16 {
            product(g, false, w, false)
        } else {
            g.matmul(w)
        }
    }

    /// `Gᵀ · x`.
    fn grad_w(&self, g: &Tensor, x: &Tensor) -> Result<Tensor> {
        if self.bf16 {
            product(g, true, x, false)
        } else {
            g.t()?.matmul(x)
        }
    }
}

impl candle_core::CustomOp1 for Precomputed {
    fn name(&self) -> &'static str {
        "precomputed"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.take()
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(match &self.grad {
            GradRule::ConstW(w) => self.grad_x(g, w)?,
            GradRule::ConstX(x) => self.grad_w(g, x)?,
            GradRule::Given(grad) => grad.broadcast_mul(g)?,
            GradRule::Both => candle_core::bail!("a product of two tracked tensors is a binary op"),
        }))
    }
}

impl candle_core::CustomOp2 for Precomputed {
    fn name(&self) -> &'static str {
        "precomputed-linear"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.take()
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, w) = (x.detach(), w.detach());
        Ok((Some(self.grad_x(g, &w)?), Some(self.grad_w(g, &x)?)))
    }
}

/// Batched `op(a) · op(b)` for training (`a`: `(n, m, k)`, or `(n, k, m)` read transposed when
/// `ta`; `b`: `(n, k, p)`, or `(n, p, k)` when `tb`): the attention's score and value products,
/// in bf16 with f32 sums where the CPU has them (as [`matmul_t`]), candle's f32 matmul where it
/// does not or where nothing needs a gradient.
pub fn bmm(a: &Tensor, ta: bool, b: &Tensor, tb: bool) -> Result<Tensor> {
    let cpu_f32_3d = |t: &Tensor| t.rank() == 3 && t.dtype() == DType::F32 && t.device().is_cpu();
    if !(a.track_op() || b.track_op())
        || !(cpu_f32_3d(a) && cpu_f32_3d(b))
        || !dspark_kernels::bf16::available()
    {
        let a = if ta { a.transpose(1, 2)? } else { a.clone() };
        let b = if tb { b.transpose(1, 2)? } else { b.clone() };
        return a.matmul(&b);
    }
    a.contiguous()?.apply_op2(&b.contiguous()?, Bmm { ta, tb })
}

/// [`bmm`]'s op: values from [`batched`], gradients by the same products.
struct Bmm {
    ta: bool,
    tb: bool,
}

/// `op(a[i]) · op(b[i])` for every i of two contiguous `(n, ·, ·)` value arrays, bf16 products.
fn batched(
    a: &[f32],
    ad: (usize, usize, usize),
    ta: bool,
    b: &[f32],
    bd: (usize, usize, usize),
    tb: bool,
) -> Result<(Vec<f32>, candle_core::Shape)> {
    let (n, ar, ac) = ad;
    let (n2, br, bc) = bd;
    let ((m, k), (k2, p)) = (if ta { (ac, ar) } else { (ar, ac) }, if tb { (bc, br) } else { (br, bc) });
    if n != n2 || k != k2 {
        candle_core::bail!("bmm: batches {n} and {n2}, inner sizes {k} and {k2}");
    }
    let mut out = Vec::with_capacity(n * m * p);
    for i in 0..n {
        let am = Mat::new(&a[i * ar * ac..(i + 1) * ar * ac], ar, ac);
        let bm = Mat::new(&b[i * br * bc..(i + 1) * br * bc], br, bc);
        out.extend(dspark_kernels::bf16::matmul(if ta { am.t() } else { am }, if tb { bm.t() } else { bm }));
    }
    Ok((out, (n, m, p).into()))
}

fn values3(t: &Tensor) -> Result<(Vec<f32>, (usize, usize, usize))> {
    Ok((t.contiguous()?.flatten_all()?.to_vec1::<f32>()?, t.dims3()?))
}

impl candle_core::CustomOp2 for Bmm {
    fn name(&self) -> &'static str {
        "bf16-bmm"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (candle_core::CpuStorage::F32(v1), candle_core::CpuStorage::F32(v2)) = (s1, s2) else {
            candle_core::bail!("bmm takes f32 tensors");
        };
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("bmm takes contiguous tensors");
        };
        let (d1, d2) = (l1.shape().dims3()?, l2.shape().dims3()?);
        let (c, shape) = batched(&v1[a0..a1], d1, self.ta, &v2[b0..b1], d2, self.tb)?;
        Ok((candle_core::CpuStorage::F32(c), shape))
    }

    /// `C = op(A)·op(B)`: `∂op(A) = G·op(B)ᵀ` and `∂op(B) = op(A)ᵀ·G`, transposed back where
    /// the operand was read transposed.
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let ((av, ad), (bv, bd), (gv, gd)) = (values3(a)?, values3(b)?, values3(g)?);
        let tensor = |(v, s): (Vec<f32>, candle_core::Shape)| Tensor::from_vec(v, s, &Device::Cpu);
        let ga = if !a.track_op() {
            None
        } else if self.ta {
            // ∂A = op(B)·Gᵀ
            Some(tensor(batched(&bv, bd, self.tb, &gv, gd, true)?)?)
        } else {
            Some(tensor(batched(&gv, gd, false, &bv, bd, !self.tb)?)?)
        };
        let gb = if !b.track_op() {
            None
        } else if self.tb {
            // ∂B = Gᵀ·op(A)
            Some(tensor(batched(&gv, gd, true, &av, ad, self.ta)?)?)
        } else {
            Some(tensor(batched(&av, ad, !self.ta, &gv, gd, false)?)?)
        };
        Ok((ga, gb))
    }
}

/// A scalar with value `value` whose gradient with respect to `arg` is `grad` (same shape as
/// `arg`): how a loss differentiated by hand enters candle's backward pass.
pub fn with_gradient(arg: &Tensor, value: f32, grad: Tensor) -> Result<Tensor> {
    if !arg.track_op() {
        return Tensor::new(value, arg.device());
    }
    arg.apply_op1(Precomputed {
        value: std::sync::Mutex::new(Some(vec![value])),
        shape: ().into(),
        grad: GradRule::Given(grad),
        bf16: false,
    })
}

impl Linear {
    /// [`Self::forward`] on `rows` rows given as plain values: drafting's sequential loop, where
    /// a tensor per op would cost more than the arithmetic of a 1-row product.
    pub fn forward_vec(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        if let Some(p) = &self.thin {
            let mut y = vec![0f32; rows * p.out];
            if let Some(b) = &self.bias {
                let b = b.to_vec1::<f32>()?;
                y.chunks_mut(p.out).for_each(|row| row.copy_from_slice(&b));
            }
            for (xr, yr) in x.chunks_exact(p.inp).zip(y.chunks_mut(p.out)) {
                p.row(xr, yr);
            }
            return Ok(y);
        }
        let Some(q) = &self.fast else {
            let t = Tensor::from_slice(x, (rows, x.len() / rows.max(1)), &Device::Cpu)?;
            return self.forward(&t)?.flatten_all()?.to_vec1::<f32>();
        };
        let mut y = q.forward_slice(x, rows)?;
        if let Some(b) = &self.bias {
            let b = b.to_vec1::<f32>()?;
            for row in y.chunks_mut(b.len()) {
                row.iter_mut().zip(&b).for_each(|(v, c)| *v += c);
            }
        }
        Ok(y)
    }
}

pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if !(x.track_op() || weight.track_op()) && x.dtype() == DType::F32 && weight.rank() == 1 {
        // Drafting: plain values, not four tensors and their passes over the row.
        let w = weight.to_vec1::<f32>()?;
        let mut v = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        dspark_model::ops::rms_norm(&mut v, &w, eps as f32, false);
        return Tensor::from_vec(v, x.shape(), x.device());
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(weight)
}

pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

pub fn silu(x: &Tensor) -> Result<Tensor> {
    x.mul(&sigmoid(x)?)
}

/// Softmax over the last axis; the max is detached (softmax does not depend on it).
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// `softmax(scale · x + mask)` over the last axis, `mask` an additive `(rows, cols)` matrix
/// broadcast over the leading axes (heads), as one op with a hand-written backward pass.
/// Written with candle's ops, the training attention's scores (`heads × A·γ × keys`, ~20 MB per
/// sequence and layer) went through seven full passes forward and a dozen backward, each a fresh
/// tensor; this is one pass each way.
pub fn scaled_masked_softmax(x: &Tensor, mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let cols = x.dim(D::Minus1)?;
    let mask = match mask {
        Some(m) => {
            let (r, c) = m.dims2()?;
            if c != cols || x.dim(D::Minus2)? != r {
                candle_core::bail!("mask {:?} does not fit scores {:?}", m.dims(), x.dims());
            }
            Some(m.detach().contiguous()?.flatten_all()?.to_vec1::<f32>()?)
        }
        None => None,
    };
    x.contiguous()?.apply_op1(MaskedSoftmax { mask, scale: scale as f32 })
}

struct MaskedSoftmax {
    /// Row-major `(rows, cols)`; row `r` of every head uses mask row `r % rows`.
    mask: Option<Vec<f32>>,
    scale: f32,
}

impl candle_core::CustomOp1 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "scaled-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use rayon::prelude::*;
        let (candle_core::CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("scaled_masked_softmax takes contiguous f32 scores");
        };
        let cols = *l.dims().last().unwrap_or(&1);
        if cols == 0 {
            return Ok((candle_core::CpuStorage::F32(vec![]), l.shape().clone()));
        }
        let mask_rows = self.mask.as_ref().map_or(1, |m| m.len() / cols.max(1));
        let mut out = v[a..b].to_vec();
        out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
            let m = self.mask.as_ref().map(|m| &m[(r % mask_rows) * cols..(r % mask_rows + 1) * cols]);
            let mut max = f32::NEG_INFINITY;
            for (j, x) in row.iter_mut().enumerate() {
                *x = *x * self.scale + m.map_or(0.0, |m| m[j]);
                max = max.max(*x);
            }
            if max == f32::NEG_INFINITY {
                // A row that sees nothing attends to nothing, so no NaN reaches the gradients
                // (drafting's `attend_plain` never builds such a row).
                row.iter_mut().for_each(|x| *x = 0.0);
                return;
            }
            let mut sum = 0f32;
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|x| *x *= inv);
        });
        Ok((candle_core::CpuStorage::F32(out), l.shape().clone()))
    }

    /// `∂x = scale · p ⊙ (g − Σ_row g ⊙ p)`; the mask is a constant.
    fn bwd(&self, _: &Tensor, p: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        use rayon::prelude::*;
        let cols = p.dim(D::Minus1)?;
        if cols == 0 {
            return Ok(Some(p.zeros_like()?));
        }
        let pv = p.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mut gv = g.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        gv.par_chunks_mut(cols).zip(pv.par_chunks(cols)).for_each(|(g, p)| {
            let dot: f32 = g.iter().zip(p).map(|(g, p)| g * p).sum();
            g.iter_mut().zip(p).for_each(|(g, p)| *g = self.scale * p * (*g - dot));
        });
        Ok(Some(Tensor::from_vec(gv, p.shape(), p.device())?))
    }
}

/// Rotary embedding in the Hugging Face "rotate half" layout, at explicit positions.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(positions: &[usize], head_dim: usize, theta: f64, device: &Device) -> Result<Self> {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for i in 0..half {
                let angle = p as f64 * theta.powf(-2.0 * i as f64 / head_dim as f64);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = (positions.len(), 1, half);
        Ok(Self { cos: Tensor::from_vec(cos, shape, device)?, sin: Tensor::from_vec(sin, shape, device)? })
    }

    /// `x`: `(T, heads, head_dim)`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let half = x.dim(D::Minus1)? / 2;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let a = (x1.broadcast_mul(&self.cos)? - x2.broadcast_mul(&self.sin)?)?;
        let b = (x2.broadcast_mul(&self.cos)? + x1.broadcast_mul(&self.sin)?)?;
        Tensor::cat(&[a, b], D::Minus1)
    }
}

/// The attention half of a decoder layer of the target's family (q/k/v biases for Qwen2,
/// per-head q/k RMSNorm for Qwen3).
#[derive(Clone, Debug)]
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub eps: f64,
}

impl Attention {
    /// Queries of `x` (`T × in`) → `(T, heads, head_dim)`, normed and rotated.
    pub fn queries(&self, x: &Tensor, rope: &Rope) -> Result<Tensor> {
        let q = self.q.forward(x)?.reshape((x.dim(0)?, self.n_heads, self.head_dim))?;
        let q = match &self.q_norm {
            Some(w) => rms_norm(&q, w, self.eps)?,
            None => q,
        };
        rope.apply(&q)
    }

    /// Keys and values of `x` → `(T, kv_heads, head_dim)` each, keys normed and rotated.
    pub fn keys_values(&self, x: &Tensor, rope: &Rope) -> Result<(Tensor, Tensor)> {
        let t = x.dim(0)?;
        let k = self.k.forward(x)?.reshape((t, self.n_kv_heads, self.head_dim))?;
        let k = match &self.k_norm {
            Some(w) => rms_norm(&k, w, self.eps)?,
            None => k,
        };
        let v = self.v.forward(x)?.reshape((t, self.n_kv_heads, self.head_dim))?;
        Ok((rope.apply(&k)?, v))
    }

    /// Scaled dot-product attention of `q` over `k`/`v` (grouped heads), with an optional
    /// additive mask `(Tq, Tk)`; returns `Tq × (heads·head_dim)` before the output projection.
    pub fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        if !(q.track_op() || k.track_op() || v.track_op()) {
            return self.attend_plain(q, k, v, mask);
        }
        let (tq, tk) = (q.dim(0)?, k.dim(0)?);
        let rep = self.n_heads / self.n_kv_heads;
        let expand = |x: &Tensor| -> Result<Tensor> {
            let x = x.transpose(0, 1)?; // (kv_heads, Tk, hd)
            x.unsqueeze(1)?.expand((self.n_kv_heads, rep, tk, self.head_dim))?.reshape((
                self.n_heads,
                tk,
                self.head_dim,
            ))
        };
        let q = q.transpose(0, 1)?.contiguous()?;
        let (k, v) = (expand(k)?.contiguous()?, expand(v)?.contiguous()?);
        let p = scaled_masked_softmax(&q.matmul(&k.t()?)?, mask, 1.0 / (self.head_dim as f64).sqrt())?;
        let out = p.matmul(&v)?; // (heads, Tq, hd)
        out.transpose(0, 1)?.reshape((tq, self.n_heads * self.head_dim))
    }
}

impl Attention {
    /// [`Self::attend`] for a training step's blocks without the scores it would mask: the
    /// queries are `A` blocks of `b` slots (`(A·b, heads, head_dim)`); block `a` attends to the
    /// context keys `kc`/`vc` (`(L, kv_heads, head_dim)`) through row `a·b + i` of the additive
    /// `mask` (`(A·b, L + b)`, its last `b` columns the block's own, see
    /// [`block_sparse_mask`](crate::dflash::block_sparse_mask)) and to its own slots' keys
    /// `kb`/`vb` (`(A·b, kv_heads, head_dim)`), never to another block's. The same function as
    /// `attend` over `[kc; kb]` with the dense `block_mask`, whose other-block columns are half
    /// of the scores at 64 anchors and two thirds at 128; the softmax sums the same terms in the
    /// same order.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_blocks(
        &self,
        q: &Tensor,
        kc: &Tensor,
        vc: &Tensor,
        kb: &Tensor,
        vb: &Tensor,
        mask: &Tensor,
        b: usize,
    ) -> Result<Tensor> {
        let (tq, l) = (q.dim(0)?, kc.dim(0)?);
        if b == 0 || tq % b != 0 || kb.dim(0)? != tq || mask.dims() != [tq, l + b] {
            candle_core::bail!(
                "attend_blocks: {tq} queries in blocks of {b}, {} block keys, mask {:?} for {l} context keys",
                kb.dim(0)?,
                mask.dims()
            );
        }
        let (nh, hd, a) = (self.n_heads, self.head_dim, tq / b);
        let rep = nh / self.n_kv_heads;
        let expand = |x: &Tensor| -> Result<Tensor> {
            let t = x.dim(0)?;
            let x = x.transpose(0, 1)?; // (kv_heads, T, hd)
            x.unsqueeze(1)?.expand((self.n_kv_heads, rep, t, hd))?.reshape((nh, t, hd))?.contiguous()
        };
        let qh = q.transpose(0, 1)?.contiguous()?; // (heads, A·b, hd)
        let (kc, vc, kb, vb) = (expand(kc)?, expand(vc)?, expand(kb)?, expand(vb)?);
        let per_block = |x: &Tensor| x.reshape((nh * a, b, hd));
        let sc = bmm(&qh, false, &kc, true)?; // (heads, A·b, L)
        let sb = per_block(&qh)?.matmul(&per_block(&kb)?.t()?)?.reshape((nh, tq, b))?;
        let p = scaled_masked_softmax(&Tensor::cat(&[&sc, &sb], 2)?, Some(mask), 1.0 / (hd as f64).sqrt())?;
        let pc = p.narrow(2, 0, l)?.contiguous()?;
        let pb = p.narrow(2, l, b)?.contiguous()?.reshape((nh * a, b, b))?;
        let out = (bmm(&pc, false, &vc, false)? + pb.matmul(&per_block(&vb)?)?.reshape((nh, tq, hd))?)?;
        out.transpose(0, 1)?.reshape((tq, nh * hd))
    }

    /// [`Self::attend`] without a graph (drafting): one pass over the keys and values per query
    /// row and head, in place of candle's head expansion, copies and a dozen small ops — a third
    /// of a drafting round when written with them (perf, SmolLM2 DSpark drafter, γ 7).
    fn attend_plain(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (tq, tk, hd) = (q.dim(0)?, k.dim(0)?, self.head_dim);
        let (nh, nkv) = (self.n_heads, self.n_kv_heads);
        let rep = nh / nkv;
        let qv = q.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let kv = k.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let vv = v.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mv = match mask {
            Some(m) => Some(m.contiguous()?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; tq * nh * hd];
        if mv.is_none() {
            // Unmasked (a drafting block): per KV head, its keys and values made contiguous once,
            // then every query row of the heads sharing them, four at a time over the keys.
            let mut kh = vec![0f32; tk * hd];
            let mut vh = vec![0f32; tk * hd];
            let mut res = vec![0f32; tq * rep * hd];
            for g in 0..nkv {
                for j in 0..tk {
                    let src = (j * nkv + g) * hd;
                    kh[j * hd..(j + 1) * hd].copy_from_slice(&kv[src..src + hd]);
                    vh[j * hd..(j + 1) * hd].copy_from_slice(&vv[src..src + hd]);
                }
                let rows: Vec<(usize, usize)> =
                    (0..tq).flat_map(|i| (g * rep..(g + 1) * rep).map(move |h| (i, h))).collect();
                let qs: Vec<&[f32]> =
                    rows.iter().map(|&(i, h)| &qv[(i * nh + h) * hd..(i * nh + h + 1) * hd]).collect();
                dspark_model::ops::attend_all(&qs, &kh, &vh, hd, scale, &mut res);
                for (r, &(i, h)) in rows.iter().enumerate() {
                    out[(i * nh + h) * hd..(i * nh + h + 1) * hd].copy_from_slice(&res[r * hd..(r + 1) * hd]);
                }
            }
            return Tensor::from_vec(out, (tq, nh * hd), q.device());
        }
        let mut scores = vec![0f32; tk];
        for i in 0..tq {
            for h in 0..nh {
                let g = h / rep;
                let qi = &qv[(i * nh + h) * hd..(i * nh + h + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (j, sc) in scores.iter_mut().enumerate() {
                    let kj = &kv[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                    let mut d = dspark_model::ops::dot(qi, kj) * scale;
                    if let Some(m) = &mv {
                        d += m[i * tk + j];
                    }
                    *sc = d;
                    max = max.max(d);
                }
                let mut sum = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let o = &mut out[(i * nh + h) * hd..(i * nh + h + 1) * hd];
                for (j, &p) in scores.iter().enumerate() {
                    let p = p / sum;
                    let vj = &vv[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                    dspark_model::ops::axpy(p, vj, o);
                }
            }
        }
        Tensor::from_vec(out, (tq, nh * hd), q.device())
    }
}

#[derive(Clone, Debug)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let tracked = [&self.gate, &self.up, &self.down].iter().any(|l| l.weight.track_op());
        if !(x.track_op() || tracked) && x.rank() == 2 && x.dtype() == DType::F32 {
            // Drafting: the products on plain values and SiLU · up in one pass, instead of
            // five elementwise tensors (a tenth of a SmolLM2 drafting round).
            let rows = x.dim(0)?;
            let xv = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
            let g = self.gate.forward_vec(&xv, rows)?;
            let u = self.up.forward_vec(&xv, rows)?;
            let a: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
            let y = self.down.forward_vec(&a, rows)?;
            let out = y.len() / rows.max(1);
            return Tensor::from_vec(y, (rows, out), x.device());
        }
        self.down.forward(&silu(&self.gate.forward(x)?)?.mul(&self.up.forward(x)?)?)
    }
}

/// A causal mask `(Tq, past + Tq)`: query `i` sees keys `0 ..= past + i`.
pub fn causal_mask(tq: usize, past: usize, device: &Device) -> Result<Tensor> {
    let tk = past + tq;
    let m: Vec<f32> = (0..tq)
        .flat_map(|i| (0..tk).map(move |j| if j <= past + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(m, (tq, tk), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drafting's products after `quantize` equal the f32 definition within the rounding of
    /// their format, on the thin panels (rank 32 with a bias, a full panel, a ragged one: 8 bits
    /// whatever the format) and the Q8_0 and Q4_0 kernels; and the format asked for is the one
    /// used (4 bits round visibly coarser than 8 on the same product).
    #[test]
    fn drafting_products_match_the_f32_forward() {
        let dev = Device::Cpu;
        let vals = |n: usize, s: f32| (0..n).map(|i| ((i as f32 + 1.0) * s).sin()).collect::<Vec<_>>();
        let cases = [
            (GgmlDType::Q8_0, 300, 32, 2e-2),
            (GgmlDType::Q8_0, 70, 32, 2e-2),
            (GgmlDType::Q8_0, 64, 64, 2e-2),
            (GgmlDType::Q8_0, 40, 7, 2e-2),
            (GgmlDType::Q8_0, 50, 128, 3e-2),
            (GgmlDType::Q4_0, 50, 128, 0.1),
        ];
        let mut worst = std::collections::HashMap::new();
        for (format, out, inp, tol) in cases {
            let w = Tensor::from_vec(vals(out * inp, 0.37), (out, inp), &dev).unwrap();
            let b = Tensor::from_vec(vals(out, 1.1), out, &dev).unwrap();
            let x = vals(3 * inp, 0.53);
            let want = Linear::new(w.clone(), Some(b.clone()))
                .forward(&Tensor::from_slice(&x, (3, inp), &dev).unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let mut l = Linear::new(w, Some(b));
            l.quantize(format).unwrap();
            assert_eq!(l.thin.is_some(), inp <= THIN_IN);
            let got = l.forward_vec(&x, 3).unwrap();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= tol * scale, "{format:?} in {inp}: {g} vs {w}");
            }
            let err = got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale;
            worst.insert((format, out, inp), err);
        }
        let (q8, q4) = (worst[&(GgmlDType::Q8_0, 50, 128)], worst[&(GgmlDType::Q4_0, 50, 128)]);
        assert!(q4 > 2.0 * q8, "Q4_0's error {q4} should be well above Q8_0's {q8}: was Q4_0 used?");
    }

    /// Drafting's graph-free attention equals the differentiable one (grouped heads, a mask).
    #[test]
    fn plain_attention_matches_the_graph_version() {
        use candle_core::Var;
        let dev = Device::Cpu;
        let lin = |o: usize, i: usize| {
            Linear::new(Tensor::zeros((o, i), candle_core::DType::F32, &dev).unwrap(), None)
        };
        let a = Attention {
            q: lin(8, 8),
            k: lin(4, 8),
            v: lin(4, 8),
            o: lin(8, 8),
            q_norm: None,
            k_norm: None,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 2,
            eps: 1e-6,
        };
        let vals = |n: usize, s: f32| (0..n).map(|i| ((i as f32 + 1.0) * s).sin()).collect::<Vec<_>>();
        let q = Tensor::from_vec(vals(3 * 4 * 2, 0.7), (3, 4, 2), &dev).unwrap();
        let k = Tensor::from_vec(vals(5 * 2 * 2, 1.3), (5, 2, 2), &dev).unwrap();
        let v = Tensor::from_vec(vals(5 * 2 * 2, 0.4), (5, 2, 2), &dev).unwrap();
        let mask = causal_mask(3, 2, &dev).unwrap();
        // A variable on q forces the graph path.
        let qv = Var::from_tensor(&q).unwrap();
        for mask in [Some(&mask), None] {
            let plain = a.attend(&q, &k, &v, mask).unwrap().to_vec2::<f32>().unwrap();
            let graph = a.attend(qv.as_tensor(), &k, &v, mask).unwrap().to_vec2::<f32>().unwrap();
            for (r, s) in plain.iter().zip(&graph) {
                for (x, y) in r.iter().zip(s) {
                    assert!((x - y).abs() < 1e-6, "{x} vs {y}");
                }
            }
        }
    }

    /// The training matmul gives candle's value and candle's gradients on the sides that have
    /// one, of the operands its products see: rounded to bf16 where the CPU has AVX-512-BF16.
    #[test]
    fn matmul_t_matches_candle_on_the_operands_it_multiplies() {
        use candle_core::Var;
        use dspark_kernels::bf16::{available, from_bf16, to_bf16};
        let dev = Device::Cpu;
        let round = |v: &[f32]| -> Vec<f32> {
            v.iter().map(|&x| if available() { from_bf16(to_bf16(x)) } else { x }).collect()
        };
        let xv: Vec<f32> = (0..15).map(|i| (i as f32 * 0.37).sin()).collect();
        let wv: Vec<f32> = (0..20).map(|i| (i as f32 * 0.53).cos()).collect();
        // Half-integers: exact in bf16, so both sides' gradients multiply the same values.
        let probe =
            Tensor::from_vec((0..12).map(|i| i as f32 - 5.5).collect::<Vec<_>>(), (3, 4), &dev).unwrap();
        for (x_var, w_var) in [(true, false), (false, true), (true, true)] {
            let vars = |xv: &[f32], wv: &[f32]| {
                let x = Var::from_vec(xv.to_vec(), (3, 5), &dev).unwrap();
                let w = Var::from_vec(wv.to_vec(), (4, 5), &dev).unwrap();
                let xt = if x_var { x.as_tensor().clone() } else { x.as_tensor().detach() };
                let wt = if w_var { w.as_tensor().clone() } else { w.as_tensor().detach() };
                (x, w, xt, wt)
            };
            let (x, w, xt, wt) = vars(&xv, &wv);
            let (xr, wr, xrt, wrt) = vars(&round(&xv), &round(&wv));
            let fast = matmul_t(&xt, &wt).unwrap();
            let slow = xrt.matmul(&wrt.t().unwrap()).unwrap();
            let close = |a: &Tensor, b: &Tensor| {
                let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(a.len(), b.len());
                for (p, q) in a.iter().zip(&b) {
                    assert!((p - q).abs() < 1e-5, "{p} vs {q} ({x_var}, {w_var})");
                }
            };
            close(&fast, &slow);
            let (gf, gs) = (
                (&fast * &probe).unwrap().sum_all().unwrap().backward().unwrap(),
                (&slow * &probe).unwrap().sum_all().unwrap().backward().unwrap(),
            );
            for (on, v, vr) in [(x_var, &x, &xr), (w_var, &w, &wr)] {
                match gf.get(v.as_tensor()) {
                    Some(g) => close(g, gs.get(vr.as_tensor()).unwrap()),
                    None => assert!(!on, "a tracked side got no gradient"),
                }
            }
        }
    }

    /// The fused op against the same function written with candle's ops: values, and the
    /// gradient of a loss that weighs every probability differently; a fully masked row gives
    /// zeros, not NaNs.
    #[test]
    fn scaled_masked_softmax_matches_the_written_function() {
        use candle_core::Var;
        let dev = Device::Cpu;
        let (h, r, c) = (3, 5, 9);
        let vals = |n: usize, s: f32| (0..n).map(|i| ((i as f32 + 1.0) * s).sin() * 3.0).collect::<Vec<_>>();
        let x = Var::from_vec(vals(h * r * c, 0.37), (h, r, c), &dev).unwrap();
        let mut m = vec![0f32; r * c];
        for (i, v) in m.iter_mut().enumerate() {
            if (i * 7) % 5 == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(m, (r, c), &dev).unwrap();
        let w = Tensor::from_vec(vals(h * r * c, 1.9), (h, r, c), &dev).unwrap();
        let scale = 0.3;
        let fused = scaled_masked_softmax(x.as_tensor(), Some(&mask), scale).unwrap();
        let written = softmax(&(x.as_tensor() * scale).unwrap().broadcast_add(&mask).unwrap()).unwrap();
        let g1 = (&fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&written * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in [
            (flat(&fused), flat(&written)),
            (flat(g1.get(x.as_tensor()).unwrap()), flat(g2.get(x.as_tensor()).unwrap())),
        ] {
            for (a, b) in a.iter().zip(&b) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
        let all = Tensor::full(f32::NEG_INFINITY, (1, 4), &dev).unwrap();
        let y = scaled_masked_softmax(
            &Tensor::ones((2, 1, 4), candle_core::DType::F32, &dev).unwrap(),
            Some(&all),
            1.0,
        )
        .unwrap();
        assert_eq!(flat(&y), vec![0.0; 8]);
    }

    /// The batched bf16 product in all four transposition cases against candle's f32 matmul of
    /// the same bf16-rounded values: value and both gradients.
    #[test]
    fn bmm_matches_candle_in_every_layout() {
        use candle_core::Var;
        let dev = Device::Cpu;
        let (n, m, k, p) = (3, 5, 7, 4);
        let round = |v: Vec<f32>| -> Vec<f32> {
            v.into_iter().map(|x| dspark_kernels::bf16::from_bf16(dspark_kernels::bf16::to_bf16(x))).collect()
        };
        let vals = |len: usize, s: f32| round((0..len).map(|i| ((i as f32 + 1.0) * s).sin()).collect());
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let ashape = if ta { (n, k, m) } else { (n, m, k) };
            let bshape = if tb { (n, p, k) } else { (n, k, p) };
            let a = Var::from_vec(vals(n * m * k, 0.37), ashape, &dev).unwrap();
            let b = Var::from_vec(vals(n * k * p, 0.53), bshape, &dev).unwrap();
            let w = Tensor::from_vec(vals(n * m * p, 0.91), (n, m, p), &dev).unwrap();
            let fast = bmm(&a, ta, &b, tb).unwrap();
            let oa = if ta { a.transpose(1, 2).unwrap() } else { a.as_tensor().clone() };
            let ob = if tb { b.transpose(1, 2).unwrap() } else { b.as_tensor().clone() };
            let slow = oa.matmul(&ob).unwrap();
            let gf = (&fast * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gs = (&slow * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let close = |x: Vec<f32>, y: Vec<f32>, what: &str| {
                assert_eq!(x.len(), y.len(), "{what}");
                // The gradients' G is rounded to bf16 in the fast path only: 2⁻⁸ relative.
                for (u, v) in x.iter().zip(&y) {
                    assert!((u - v).abs() < 2e-2, "({ta}, {tb}) {what}: {u} vs {v}");
                }
            };
            assert_eq!(fast.dims(), slow.dims());
            close(flat(&fast), flat(&slow), "value");
            close(flat(gf.get(a.as_tensor()).unwrap()), flat(gs.get(a.as_tensor()).unwrap()), "∂a");
            close(flat(gf.get(b.as_tensor()).unwrap()), flat(gs.get(b.as_tensor()).unwrap()), "∂b");
        }
    }

    /// The training attention without the masked columns against the dense one with
    /// `block_mask`: values and the gradients of every input, grouped heads, context rows that
    /// see nothing (an anchor at 0) included.
    #[test]
    fn block_sparse_attention_equals_the_masked_dense_one() {
        use crate::dflash::{block_mask, block_sparse_mask};
        use candle_core::Var;
        let dev = Device::Cpu;
        let (nh, nkv, hd, l, b) = (4, 2, 8, 11, 3);
        let anchors = [0usize, 4, 10, 6];
        let tq = anchors.len() * b;
        let lin = || Linear::new(Tensor::zeros((1, 1), candle_core::DType::F32, &dev).unwrap(), None);
        let att = Attention {
            q: lin(),
            k: lin(),
            v: lin(),
            o: lin(),
            q_norm: None,
            k_norm: None,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            eps: 1e-6,
        };
        let var = |t: usize, h: usize, seed: f32| {
            let v: Vec<f32> = (0..t * h * hd).map(|i| ((i as f32 + 1.0) * seed).sin()).collect();
            Var::from_vec(v, (t, h, hd), &dev).unwrap()
        };
        let (q, kc, vc, kb, vb) =
            (var(tq, nh, 0.31), var(l, nkv, 0.17), var(l, nkv, 0.23), var(tq, nkv, 0.41), var(tq, nkv, 0.53));
        let sparse = att
            .attend_blocks(&q, &kc, &vc, &kb, &vb, &block_sparse_mask(l, &anchors, b).unwrap(), b)
            .unwrap();
        let k = Tensor::cat(&[kc.as_tensor(), kb.as_tensor()], 0).unwrap();
        let v = Tensor::cat(&[vc.as_tensor(), vb.as_tensor()], 0).unwrap();
        let dense = att.attend(&q, &k, &v, Some(&block_mask(l, &anchors, b).unwrap())).unwrap();
        let w = Tensor::from_vec(
            (0..tq * nh * hd).map(|i| (i as f32 * 0.77).cos()).collect(),
            (tq, nh * hd),
            &dev,
        )
        .unwrap();
        let gs = (&sparse * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let gd = (&dense * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // The sparse form's score and value products are bf16 where the CPU has them, the dense
        // form's f32: a few 2⁻⁹ apart then, 1e-5 otherwise.
        let tol = if dspark_kernels::bf16::available() { 1e-2 } else { 1e-5 };
        let close = |a: Vec<f32>, b: Vec<f32>, what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < tol, "{what}: {x} vs {y}");
            }
        };
        close(flat(&sparse), flat(&dense), "values");
        // And the tolerance tells a wrong mask apart: every block seeing every block differs.
        let leaky = att.attend(&q, &k, &v, None).unwrap();
        let gap = flat(&sparse).iter().zip(flat(&leaky)).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(gap > 10.0 * tol, "an unmasked attention came within {gap}");
        for (name, x) in [("q", &q), ("kc", &kc), ("vc", &vc), ("kb", &kb), ("vb", &vb)] {
            close(flat(gs.get(x.as_tensor()).unwrap()), flat(gd.get(x.as_tensor()).unwrap()), name);
        }
        assert!(att.attend_blocks(&q, &kc, &vc, &kb, &vb, &block_mask(l, &anchors, b).unwrap(), b).is_err());
    }

    #[test]
    fn softmax_and_rms_norm_match_closed_forms() {
        let x = Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu).unwrap();
        let p = softmax(&x).unwrap().to_vec2::<f32>().unwrap();
        let z: f32 = [1f32, 2.0, 3.0].iter().map(|v| v.exp()).sum();
        for (i, v) in [1f32, 2.0, 3.0].iter().enumerate() {
            assert!((p[0][i] - v.exp() / z).abs() < 1e-6);
        }
        let w = Tensor::new(&[1f32, 1.0, 2.0], &Device::Cpu).unwrap();
        let n = rms_norm(&x, &w, 0.0).unwrap().to_vec2::<f32>().unwrap();
        let rms = (14f32 / 3.0).sqrt();
        assert!((n[0][2] - 2.0 * 3.0 / rms).abs() < 1e-5);
    }

    #[test]
    fn rope_rotates_pairs_half_apart_and_keeps_norms() {
        let x = Tensor::new(&[[[1f32, 0.0, 0.0, 1.0]]], &Device::Cpu).unwrap(); // (1, 1, 4)
        let r = Rope::new(&[3], 4, 10000.0, &Device::Cpu).unwrap();
        let y = r.apply(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // Pair (x0, x2) rotates by 3 rad; pair (x1, x3) by 3·10000^(-1/2).
        let (a, b) = (3f32, 3f32 / 100.0);
        let want = [a.cos(), -b.sin(), a.sin(), b.cos()];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{y:?}");
        }
    }

    #[test]
    fn every_building_block_passes_gradients() {
        use candle_core::Var;
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 4), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::ones(4, candle_core::DType::F32, &dev).unwrap()).unwrap();
        let r = Rope::new(&[0, 1, 2], 4, 100.0, &dev).unwrap();
        let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
        let y = silu(&softmax(&y).unwrap()).unwrap();
        let y = r.apply(&y.reshape((3, 1, 4)).unwrap()).unwrap();
        let loss = y.sqr().unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        for v in [&x, &w] {
            let gv = g.get(v.as_tensor()).expect("a gradient");
            assert!(gv.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
        }
    }
}
