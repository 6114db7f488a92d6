//! DFlash's parallel backbone with DSpark's sequential and confidence heads.
//!
//! ```text
//! context rows:  H_ctx = RMSNorm(fc([h_l1; …; h_lm]))  → every layer's own k/v projections
//!                (k-norm, RoPE at true positions), kept in a per-sequence cache
//! block:         [anchor, MASK × (B−1)] at anchor_pos … → N layers (queries from the block,
//!                keys/values over [context ; block], bidirectional in the block) → final norm
//! drafts:        U_k = head(h_k); DSpark adds B(x_{k−1}) and samples left to right
//! ```

use crate::common::{
    append_kv, init_all, layer_specs, stack_taps, with_new, DecoderLayer, DraftVocab, Embedding, LmHead, Spec,
};
use crate::config::{BlockLayout, DrafterConfig, HeadKind, Method};
use crate::nn::{rms_norm, sigmoid, Linear, Rope};
use crate::store::{Init, Store};
use crate::{NetworkError, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor, D};
use dspark_model::Model;
use std::collections::BTreeMap;
use std::sync::Arc;

/// DSpark's sequential head: a bias on the draft logits that depends on the previous token.
pub enum SeqHead {
    /// `B(x) = W1[x] · W2ᵀ`.
    Markov { w1: Tensor, w2: Linear },
    /// Gated recurrence over `[s; W1[x]; h]`, bias `W2 · tanh(o)`.
    Rnn { w1: Tensor, cell: Linear, w2: Linear, rank: usize },
}

impl SeqHead {
    fn w1(&self) -> &Tensor {
        match self {
            Self::Markov { w1, .. } | Self::Rnn { w1, .. } => w1,
        }
    }

    /// `W1` rows of the previous tokens, `(n, r)`.
    pub fn embed_prev(&self, prev: &[u32]) -> Result<Tensor> {
        let ids = Tensor::from_slice(prev, prev.len(), &Device::Cpu)?;
        Ok(self.w1().index_select(&ids, 0)?)
    }
}

/// The recurrent state of the RNN head between positions.
pub fn rnn_step(
    cell: &Linear,
    w2: &Linear,
    rank: usize,
    s: &Tensor,
    e: &Tensor,
    h: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let z = cell.forward(&Tensor::cat(&[s, e, h], D::Minus1)?)?;
    let g = sigmoid(&z.narrow(D::Minus1, 0, rank)?)?;
    let c = z.narrow(D::Minus1, rank, rank)?.tanh()?;
    let o = z.narrow(D::Minus1, 2 * rank, rank)?.tanh()?;
    let s_new = (g.mul(s)? + (1.0 - &g)?.mul(&c)?)?;
    Ok((s_new, w2.forward(&o)?))
}

/// Per-sequence context keys/values of every draft layer (committed rows only).
#[derive(Clone, Default)]
pub struct ContextCache {
    kv: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl ContextCache {
    /// Committed rows held: the context minus its last token (the anchor).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Layer `l`'s keys and values, `(len, kv_heads, head_dim)` each.
    pub fn layer(&self, l: usize) -> Option<&(Tensor, Tensor)> {
        self.kv.get(l).and_then(|x| x.as_ref())
    }
}

/// What the heads made of one block, left to right.
#[derive(Debug, Clone, Default)]
pub struct DraftTrace {
    /// Target token ids.
    pub tokens: Vec<u32>,
    /// Final logits over the draft vocabulary at each position (after the sequential bias).
    pub logits: Vec<Vec<f32>>,
    /// Calibrated survival probabilities, when the drafter has a confidence head.
    pub confidence: Option<Vec<f32>>,
    /// The confidence head's raw logits (before scaling and sigmoid), as DeepSpec
    /// records them.
    pub confidence_logits: Option<Vec<f32>>,
}

pub struct BlockModel {
    pub config: DrafterConfig,
    pub method: Method,
    pub layout: BlockLayout,
    target: Arc<Model>,
    fc: Linear,
    hidden_norm: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    head: Option<SeqHead>,
    confidence: Option<Linear>,
    pub vocab: DraftVocab,
    embed: Embedding,
    lm_head: LmHead,
    tensors: BTreeMap<String, Tensor>,
}

/// Every tensor of a DFlash/DSpark checkpoint, under DeepSpec's names (without the copies of the
/// target's embedding and head that DeepSpec also saves).
pub fn specs(c: &DrafterConfig, std: f32) -> Result<Vec<Spec>> {
    let (d, m) = (c.hidden_size, c.target_layer_ids.len());
    let mut s: Vec<Spec> = vec![
        ("fc.weight".into(), vec![d, m * d], Init::Random(std)),
        ("hidden_norm.weight".into(), vec![d], Init::Ones),
    ];
    for i in 0..c.num_hidden_layers {
        s.extend(layer_specs(&format!("layers.{i}."), c, d, std)?);
    }
    s.push(("norm.weight".into(), vec![d], Init::Ones));
    let ext = c.ext();
    let (v, vd, r) = (c.vocab_size, c.draft_vocab(), ext.head_rank);
    if let Some(head) = ext.head {
        s.push(("markov_head.markov_w1.weight".into(), vec![v, r], Init::Random(std)));
        s.push(("markov_head.markov_w2.weight".into(), vec![vd, r], Init::Random(std)));
        if head == HeadKind::Rnn {
            s.push(("markov_head.joint_proj.weight".into(), vec![3 * r, 2 * r + d], Init::Random(std)));
            s.push(("markov_head.joint_proj.bias".into(), vec![3 * r], Init::Random(std)));
        }
    }
    if ext.confidence {
        let input = if ext.confidence_with_markov { d + r } else { d };
        s.push(("confidence_head.proj.weight".into(), vec![1, input], Init::Random(std)));
        s.push(("confidence_head.proj.bias".into(), vec![1], Init::Random(std)));
    }
    Ok(s)
}

pub fn init(c: &DrafterConfig, std: f32, seed: u64) -> Result<BTreeMap<String, Tensor>> {
    let mut i = crate::store::Initializer::new(seed);
    init_all(&mut i, specs(c, std)?)?;
    Ok(i.map)
}

impl BlockModel {
    pub fn new(config: DrafterConfig, store: &Store, vocab: DraftVocab, target: Arc<Model>) -> Result<Self> {
        let ext = config.ext();
        if ext.method == Method::Eagle3 {
            return Err(NetworkError::Config("an EAGLE-3 checkpoint is not a block drafter".into()));
        }
        if config.mask_token_id.is_none() {
            return Err(NetworkError::Config("config lacks mask_token_id, which the block needs".into()));
        }
        if config.block_size < 1 + usize::from(ext.layout == BlockLayout::Dflash) {
            return Err(NetworkError::Config(format!("block_size {} is too small", config.block_size)));
        }
        if vocab.len() != config.draft_vocab() {
            return Err(NetworkError::Checkpoint("d2t and draft_vocab_size disagree".into()));
        }
        let (d, m, r) = (config.hidden_size, config.target_layer_ids.len(), ext.head_rank);
        if m == 0 {
            return Err(NetworkError::Config("target_layer_ids is empty".into()));
        }
        let (v, vd) = (config.vocab_size, config.draft_vocab());
        let get = |name: &str, shape: &[usize]| store.get(store.pick(&config.file_names(name)), shape);
        let head = match ext.head {
            Some(HeadKind::Markov) => Some(SeqHead::Markov {
                w1: get("markov_head.markov_w1.weight", &[v, r])?,
                w2: Linear::new(get("markov_head.markov_w2.weight", &[vd, r])?, None),
            }),
            Some(HeadKind::Rnn) => Some(SeqHead::Rnn {
                w1: get("markov_head.markov_w1.weight", &[v, r])?,
                cell: Linear::new(
                    get("markov_head.joint_proj.weight", &[3 * r, 2 * r + d])?,
                    Some(get("markov_head.joint_proj.bias", &[3 * r])?),
                ),
                w2: Linear::new(get("markov_head.markov_w2.weight", &[vd, r])?, None),
                rank: r,
            }),
            None => None,
        };
        let confidence = if ext.confidence {
            if ext.confidence_with_markov && head.is_none() {
                return Err(NetworkError::Config(
                    "the confidence head reads the Markov head's W1 but there is no Markov head".into(),
                ));
            }
            let input = if ext.confidence_with_markov { d + r } else { d };
            Some(Linear::new(
                get("confidence_head.proj.weight", &[1, input])?,
                Some(get("confidence_head.proj.bias", &[1])?),
            ))
        } else {
            None
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| DecoderLayer::load(store, &format!("layers.{i}."), &config, d))
            .collect::<Result<_>>()?;
        // A checkpoint's own embedding and head (DeepSpec saves copies of the target's) are
        // what its code computes with; the target's serve those that have none.
        let embed = Embedding::load(store, &config, &target)?;
        let own_head = store.opt("lm_head.weight", &[vd, d])?;
        let lm_head = match &own_head {
            Some(w) => LmHead::Dense(w.clone()),
            None => LmHead::shared(&target, &vocab)?,
        };
        // Every tensor under the name our saver writes, so a loaded checkpoint saves as ours.
        let mut tensors: BTreeMap<String, Tensor> = specs(&config, 0.0)?
            .into_iter()
            .map(|(n, shape, _)| Ok((n.clone(), get(&n, &shape)?)))
            .collect::<Result<_>>()?;
        if let Some(e) = embed.own() {
            tensors.insert("embed_tokens.weight".into(), e.clone());
        }
        if let Some(w) = own_head {
            tensors.insert("lm_head.weight".into(), w);
        }
        Ok(Self {
            method: ext.method,
            layout: ext.layout,
            fc: Linear::new(store.get("fc.weight", &[d, m * d])?, None),
            hidden_norm: store.get("hidden_norm.weight", &[d])?,
            norm: store.get("norm.weight", &[d])?,
            layers,
            head,
            confidence,
            vocab,
            embed,
            lm_head,
            target,
            config,
            tensors,
        })
    }

    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }

    /// Drafts through `format` copies of the backbone and head weights (see
    /// [`crate::DraftWeights`]; the distributions handed to verification are still exactly those
    /// sampled from, so the output stays the target's whatever the format).
    pub fn quantize_for_inference(&mut self, format: GgmlDType) -> Result<()> {
        self.fc.quantize(format)?;
        for l in &mut self.layers {
            l.quantize(format)?;
        }
        self.lm_head.quantize(format)?;
        if let Some(c) = &mut self.confidence {
            c.quantize(format)?;
        }
        match &mut self.head {
            Some(SeqHead::Markov { w2, .. }) => w2.quantize(format)?,
            Some(SeqHead::Rnn { cell, w2, .. }) => {
                cell.quantize(format)?;
                w2.quantize(format)?;
            }
            None => {}
        }
        Ok(())
    }

    pub fn target(&self) -> &Arc<Model> {
        &self.target
    }

    /// Drafts per round.
    pub fn gamma(&self) -> usize {
        self.config.gamma()
    }

    /// Fuses target features of `rows` committed positions and appends their keys/values.
    pub fn extend(&self, cache: &mut ContextCache, taps: &[Vec<f32>], rows: usize) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let d = self.config.hidden_size;
        let x = stack_taps(taps, rows, d, self.config.target_layer_ids.len())?;
        let h = rms_norm(&self.fc.forward(&x)?, &self.hidden_norm, self.config.rms_norm_eps)?;
        let positions: Vec<usize> = (cache.len..cache.len + rows).collect();
        let rope = Rope::new(&positions, self.config.head_dim, self.config.rope_theta, &Device::Cpu)?;
        cache.kv.resize(self.layers.len(), None);
        for (layer, slot) in self.layers.iter().zip(cache.kv.iter_mut()) {
            let (k, v) = layer.attn.keys_values(&h, &rope)?;
            append_kv(slot, k, v)?;
        }
        cache.len += rows;
        Ok(())
    }

    /// Runs one block per sequence (anchor after each cache's rows) and returns the final-norm
    /// hidden states of the slots that make drafts, `(S·γ, hidden)`.
    pub fn block_hidden(&self, seqs: &[(&ContextCache, u32)]) -> Result<Tensor> {
        let b = self.config.block_size;
        let mask = self.config.mask_token_id.expect("checked at load");
        let mut tokens = Vec::with_capacity(seqs.len() * b);
        let mut positions = Vec::with_capacity(seqs.len() * b);
        for (cache, anchor) in seqs {
            tokens.push(*anchor);
            tokens.extend(std::iter::repeat_n(mask, b - 1));
            positions.extend(cache.len..cache.len + b);
        }
        let rope = Rope::new(&positions, self.config.head_dim, self.config.rope_theta, &Device::Cpu)?;
        let eps = self.config.rms_norm_eps;
        let mut x = self.embed.rows(&tokens)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, eps)?;
            let q = layer.attn.queries(&h, &rope)?;
            let (k, v) = layer.attn.keys_values(&h, &rope)?;
            let mut outs = Vec::with_capacity(seqs.len());
            for (s, (cache, _)) in seqs.iter().enumerate() {
                let rows = |t: &Tensor| t.narrow(0, s * b, b);
                let empty = None;
                let (kc, vc) = with_new(cache.kv.get(l).unwrap_or(&empty), &rows(&k)?, &rows(&v)?)?;
                outs.push(layer.attn.attend(&rows(&q)?, &kc, &vc, None)?);
            }
            x = layer_tail(layer, &x, &Tensor::cat(&outs, 0)?)?;
        }
        self.drafting_slots(&x, seqs.len())
    }

    /// Final norm, then the rows of each block that make drafts. DSpark: slot k drafts the token
    /// after it; DFlash: slots 1.. draft their own position.
    fn drafting_slots(&self, x: &Tensor, blocks: usize) -> Result<Tensor> {
        let x = rms_norm(x, &self.norm, self.config.rms_norm_eps)?;
        let (b, g) = (self.config.block_size, self.gamma());
        let skip = usize::from(self.layout == BlockLayout::Dflash);
        let picked: Vec<Tensor> =
            (0..blocks).map(|s| x.narrow(0, s * b + skip, g)).collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&picked, 0)?)
    }

    /// Draft-vocabulary logits before the sequential head, `(n, V_d)`.
    pub fn raw_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.logits(hidden)
    }

    /// The sequential part for one sequence: positions `0..n` left to right, each biased by the
    /// token chosen before it (`x_0` = the anchor). `choose` picks a draft-vocabulary index from
    /// the final logits of position k.
    pub fn draft(
        &self,
        hidden: &Tensor,
        raw: &Tensor,
        anchor: u32,
        n: usize,
        mut choose: impl FnMut(usize, &[f32]) -> Result<usize>,
    ) -> Result<DraftTrace> {
        let ext = self.config.ext();
        let (temps, biases, with_markov) =
            (ext.calibration_temperatures, ext.calibration_biases, ext.confidence_with_markov);
        let mut out = DraftTrace {
            confidence: self.confidence.as_ref().map(|_| Vec::new()),
            confidence_logits: self.confidence.as_ref().map(|_| Vec::new()),
            ..Default::default()
        };
        // Plain values from here: the loop is sequential and each step's products are one row.
        let (d, vd) = (hidden.dim(1)?, raw.dim(1)?);
        let hid = hidden.flatten_all()?.to_vec1::<f32>()?;
        let raws = raw.flatten_all()?.to_vec1::<f32>()?;
        let mut prev = anchor;
        let mut state: Option<Tensor> = None;
        for k in 0..n {
            let h = &hid[k * d..(k + 1) * d];
            let mut row = raws[k * vd..(k + 1) * vd].to_vec();
            let e = match &self.head {
                None => None,
                Some(head) => {
                    let e = head.embed_prev(&[prev])?;
                    let bias = match head {
                        SeqHead::Markov { w2, .. } => {
                            w2.forward_vec(&e.flatten_all()?.to_vec1::<f32>()?, 1)?
                        }
                        SeqHead::Rnn { cell, w2, rank, .. } => {
                            let s = match state.take() {
                                Some(s) => s,
                                None => Tensor::zeros((1, *rank), candle_core::DType::F32, &Device::Cpu)?,
                            };
                            let ht = Tensor::from_slice(h, (1, d), &Device::Cpu)?;
                            let (s, bias) = rnn_step(cell, w2, *rank, &s, &e, &ht)?;
                            state = Some(s);
                            bias.flatten_all()?.to_vec1::<f32>()?
                        }
                    };
                    row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
                    Some(e.flatten_all()?.to_vec1::<f32>()?)
                }
            };
            if let Some(proj) = &self.confidence {
                let mut input = h.to_vec();
                if let (Some(e), true) = (&e, with_markov) {
                    input.extend_from_slice(e);
                }
                let z = proj.forward_vec(&input, 1)?[0];
                let t = temps.as_ref().and_then(|t| t.get(k)).copied().unwrap_or(1.0);
                let b = biases.as_ref().and_then(|b| b.get(k)).copied().unwrap_or(0.0);
                out.confidence.get_or_insert_with(Vec::new).push(1.0 / (1.0 + (-(z / t + b)).exp()));
                out.confidence_logits.get_or_insert_with(Vec::new).push(z);
            }
            let idx = choose(k, &row)?;
            prev = self.vocab.to_target(idx);
            out.tokens.push(prev);
            out.logits.push(row);
        }
        Ok(out)
    }

    /// Training forward: the target features of a whole sequence (`(L, m·hidden)`) and blocks
    /// anchored at `anchors` (positions whose token opens the block). Block a sees context
    /// positions `< anchors[a]` and its own block, nothing else — the attention a block has at
    /// drafting time. Returns the final-norm hidden states of the drafting slots,
    /// `(A·γ, hidden)`, block by block.
    pub fn train_hidden(&self, features: &Tensor, tokens: &[u32], anchors: &[usize]) -> Result<Tensor> {
        let (b, eps) = (self.config.block_size, self.config.rms_norm_eps);
        let mask_id = self.config.mask_token_id.expect("checked at load");
        let l = features.dim(0)?;
        let h_ctx = rms_norm(&self.fc.forward(features)?, &self.hidden_norm, eps)?;
        let ctx_rope = Rope::new(
            &(0..l).collect::<Vec<_>>(),
            self.config.head_dim,
            self.config.rope_theta,
            &Device::Cpu,
        )?;
        let mut block_tokens = Vec::with_capacity(anchors.len() * b);
        let mut positions = Vec::with_capacity(anchors.len() * b);
        for &p in anchors {
            block_tokens.push(tokens[p]);
            block_tokens.extend(std::iter::repeat_n(mask_id, b - 1));
            positions.extend(p..p + b);
        }
        let rope = Rope::new(&positions, self.config.head_dim, self.config.rope_theta, &Device::Cpu)?;
        let mask = block_sparse_mask(l, anchors, b)?;
        let mut x = self.embed.rows(&block_tokens)?;
        for layer in &self.layers {
            let (kc, vc) = layer.attn.keys_values(&h_ctx, &ctx_rope)?;
            let h = rms_norm(&x, &layer.input_norm, eps)?;
            let q = layer.attn.queries(&h, &rope)?;
            let (kb, vb) = layer.attn.keys_values(&h, &rope)?;
            x = layer_tail(layer, &x, &layer.attn.attend_blocks(&q, &kc, &vc, &kb, &vb, &mask, b)?)?;
        }
        self.drafting_slots(&x, anchors.len())
    }

    /// Training heads with teacher forcing: `prev[i]` is the token before slot i (the anchor,
    /// then the true tokens). Returns the final draft logits `(A·γ, V_d)` and, with a
    /// confidence head, its logits `(A·γ)` before the sigmoid.
    pub fn train_heads(&self, hidden: &Tensor, prev: &[u32]) -> Result<(Tensor, Option<Tensor>)> {
        let raw = self.lm_head.logits(hidden)?;
        let confidence = |e: Option<&Tensor>| -> Result<Option<Tensor>> {
            let Some(p) = &self.confidence else { return Ok(None) };
            let input = match e {
                Some(e) if self.config.ext().confidence_with_markov => Tensor::cat(&[hidden, e], D::Minus1)?,
                _ => hidden.clone(),
            };
            Ok(Some(p.forward(&input)?.squeeze(1)?))
        };
        let Some(head) = &self.head else { return Ok((raw, confidence(None)?)) };
        let e = head.embed_prev(prev)?;
        let bias = match head {
            SeqHead::Markov { w2, .. } => w2.forward(&e)?,
            SeqHead::Rnn { cell, w2, rank, .. } => {
                // Slots are sequential within a block, blocks run side by side.
                let g = self.gamma();
                let a = prev.len() / g;
                let (d, r) = (hidden.dim(1)?, *rank);
                let h3 = hidden.reshape((a, g, d))?;
                let e3 = e.reshape((a, g, r))?;
                let mut s = Tensor::zeros((a, r), candle_core::DType::F32, &Device::Cpu)?;
                let mut biases = Vec::with_capacity(g);
                for k in 0..g {
                    let hk = h3.narrow(1, k, 1)?.squeeze(1)?;
                    let ek = e3.narrow(1, k, 1)?.squeeze(1)?;
                    let (s2, bk) = rnn_step(cell, w2, r, &s, &ek, &hk)?;
                    s = s2;
                    biases.push(bk.unsqueeze(1)?);
                }
                Tensor::cat(&biases, 1)?.reshape((a * g, ()))?
            }
        };
        let logits = (raw + bias)?;
        Ok((logits, confidence(Some(&e))?))
    }

    /// Replaces the shared head by a dense f32 copy of the target's rows, through which
    /// gradients reach the hidden states (training).
    pub fn use_dense_head(&mut self) -> Result<()> {
        let ids = self.vocab.target_ids();
        let rows = self.target.lm_head_rows(&ids)?;
        self.lm_head =
            LmHead::Dense(Tensor::from_vec(rows, (ids.len(), self.config.hidden_size), &Device::Cpu)?);
        Ok(())
    }

    pub fn lm_head(&self) -> &LmHead {
        &self.lm_head
    }
}

/// The rest of a pre-norm decoder layer after attention: output projection and residual, then
/// the MLP block.
fn layer_tail(layer: &DecoderLayer, x: &Tensor, attn: &Tensor) -> Result<Tensor> {
    let x = (x + layer.attn.o.forward(attn)?)?;
    let h = rms_norm(&x, &layer.post_attention_norm, layer.eps)?;
    Ok((&x + layer.mlp.forward(&h)?)?)
}

/// The additive mask of [`Attention::attend_blocks`](crate::nn::Attention::attend_blocks): rows
/// are the blocks' slots, columns the `l` context positions then the row's own block's `b`
/// slots. Block a sees context `< anchors[a]` and all of itself.
pub fn block_sparse_mask(l: usize, anchors: &[usize], b: usize) -> Result<Tensor> {
    let cols = l + b;
    let mut m = vec![f32::NEG_INFINITY; anchors.len() * b * cols];
    for (a, &p) in anchors.iter().enumerate() {
        for i in 0..b {
            let row = &mut m[(a * b + i) * cols..(a * b + i + 1) * cols];
            row[..p.min(l)].iter_mut().for_each(|x| *x = 0.0);
            row[l..].iter_mut().for_each(|x| *x = 0.0);
        }
    }
    Ok(Tensor::from_vec(m, (anchors.len() * b, cols), &Device::Cpu)?)
}

/// The dense form of that mask, over every block's slots (what [`block_sparse_mask`] leaves
/// out): rows are the blocks' slots, columns the `l` context positions then every block's
/// slots. Block a sees context `< anchors[a]` and itself.
pub fn block_mask(l: usize, anchors: &[usize], b: usize) -> Result<Tensor> {
    let cols = l + anchors.len() * b;
    let mut m = vec![f32::NEG_INFINITY; anchors.len() * b * cols];
    for (a, &p) in anchors.iter().enumerate() {
        for i in 0..b {
            let row = &mut m[(a * b + i) * cols..(a * b + i + 1) * cols];
            row[..p.min(l)].iter_mut().for_each(|x| *x = 0.0);
            row[l + a * b..l + (a + 1) * b].iter_mut().for_each(|x| *x = 0.0);
        }
    }
    Ok(Tensor::from_vec(m, (anchors.len() * b, cols), &Device::Cpu)?)
}
