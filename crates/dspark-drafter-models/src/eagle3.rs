//! EAGLE-3: one decoder layer reading `[norm(embedding of token t+1) ; norm(feature of t)]`, run
//! autoregressively on its own outputs, with its own reduced-vocabulary head.
//!
//! ```text
//! committed row i:  (e(t_{i+1}), fc([h_low; h_mid; h_high]_i))   → K/V kept in the cache
//! draft step:       (e(d_k), g_{k−1})  where g is the layer's previous output
//! logits:           lm_head(norm(g))  over the draft vocabulary (d2t)
//! ```

use crate::common::{
    append_kv, init_all, layer_specs, stack_taps, with_new, DecoderLayer, DraftVocab, Embedding, LmHead, Spec,
};
use crate::config::{DrafterConfig, Method};
use crate::dflash::DraftTrace;
use crate::nn::{causal_mask, rms_norm, Linear, Rope};
use crate::store::{Init, Store};
use crate::{NetworkError, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor, D};
use dspark_model::Model;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Per-sequence state: the layer's K/V over committed rows, and the output of the last one
/// (which drafts the first token of the next round).
#[derive(Clone, Default)]
pub struct EagleCache {
    kv: Option<(Tensor, Tensor)>,
    len: usize,
    last: Option<Tensor>,
}

impl EagleCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn kv(&self) -> Option<&(Tensor, Tensor)> {
        self.kv.as_ref()
    }

    pub fn last(&self) -> Option<&Tensor> {
        self.last.as_ref()
    }
}

pub struct Eagle3Model {
    pub config: DrafterConfig,
    fc: Linear,
    layer: DecoderLayer,
    hidden_norm: Tensor,
    norm: Tensor,
    lm_head: LmHead,
    embed: Embedding,
    pub vocab: DraftVocab,
    tensors: BTreeMap<String, Tensor>,
}

pub fn specs(c: &DrafterConfig, std: f32) -> Result<Vec<Spec>> {
    let (d, m) = (c.hidden_size, c.target_layer_ids.len());
    let mut s: Vec<Spec> = vec![("fc.weight".into(), vec![d, m * d], Init::Random(std))];
    s.extend(layer_specs("midlayer.", c, 2 * d, std)?);
    s.push(("midlayer.hidden_norm.weight".into(), vec![d], Init::Ones));
    s.push(("norm.weight".into(), vec![d], Init::Ones));
    s.push(("lm_head.weight".into(), vec![c.draft_vocab(), d], Init::Zeros));
    Ok(s)
}

/// A fresh EAGLE-3 drafter; its head starts as the target's rows for the draft vocabulary.
pub fn init(c: &DrafterConfig, std: f32, seed: u64, head_rows: Tensor) -> Result<BTreeMap<String, Tensor>> {
    let mut i = crate::store::Initializer::new(seed);
    init_all(&mut i, specs(c, std)?)?;
    i.insert("lm_head.weight", head_rows);
    Ok(i.map)
}

impl Eagle3Model {
    pub fn new(config: DrafterConfig, store: &Store, vocab: DraftVocab, target: Arc<Model>) -> Result<Self> {
        if config.ext().method != Method::Eagle3 {
            return Err(NetworkError::Config("not an EAGLE-3 checkpoint".into()));
        }
        if config.num_hidden_layers != 1 {
            return Err(NetworkError::Config(format!(
                "EAGLE-3 has one draft layer, the config says {}",
                config.num_hidden_layers
            )));
        }
        if vocab.len() != config.draft_vocab() {
            return Err(NetworkError::Checkpoint("d2t and draft_vocab_size disagree".into()));
        }
        let (d, m) = (config.hidden_size, config.target_layer_ids.len());
        if m == 0 {
            return Err(NetworkError::Config("target_layer_ids is empty".into()));
        }
        // Under the names our saver writes (DeepSpec's layer is `layers.0.*`, ours `midlayer.*`).
        let get = |name: &str, shape: &[usize]| store.get(store.pick(&config.file_names(name)), shape);
        let mut tensors: BTreeMap<String, Tensor> = specs(&config, 0.0)?
            .into_iter()
            .map(|(n, shape, _)| Ok((n.clone(), get(&n, &shape)?)))
            .collect::<Result<_>>()?;
        let embed = Embedding::load(store, &config, &target)?;
        if let Some(e) = embed.own() {
            tensors.insert("embed_tokens.weight".into(), e.clone());
        }
        let prefix = config.file_names("midlayer.").remove(0);
        Ok(Self {
            fc: Linear::new(store.get("fc.weight", &[d, m * d])?, None),
            layer: DecoderLayer::load(store, &prefix, &config, 2 * d)?,
            hidden_norm: get("midlayer.hidden_norm.weight", &[d])?,
            norm: store.get("norm.weight", &[d])?,
            lm_head: LmHead::Dense(store.get("lm_head.weight", &[config.draft_vocab(), d])?),
            embed,
            vocab,
            config,
            tensors,
        })
    }

    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }

    /// Drafts through `format` copies of the weights (see [`crate::DraftWeights`]).
    pub fn quantize_for_inference(&mut self, format: GgmlDType) -> Result<()> {
        self.fc.quantize(format)?;
        self.layer.quantize(format)?;
        self.lm_head.quantize(format)
    }

    pub fn gamma(&self) -> usize {
        self.config.block_size
    }

    /// Runs rows `(embedding, hidden)` after the cache (causal) and returns the layer's outputs.
    /// With `commit`, the rows' keys/values join the cache.
    fn run(&self, cache: &mut EagleCache, emb: &Tensor, hid: &Tensor, commit: bool) -> Result<Tensor> {
        let (n, eps) = (emb.dim(0)?, self.config.rms_norm_eps);
        let x = Tensor::cat(
            &[rms_norm(emb, &self.layer.input_norm, eps)?, rms_norm(hid, &self.hidden_norm, eps)?],
            D::Minus1,
        )?;
        let positions: Vec<usize> = (cache.len..cache.len + n).collect();
        let rope = Rope::new(&positions, self.config.head_dim, self.config.rope_theta, &Device::Cpu)?;
        let q = self.layer.attn.queries(&x, &rope)?;
        let (k, v) = self.layer.attn.keys_values(&x, &rope)?;
        let (kc, vc) = with_new(&cache.kv, &k, &v)?;
        let mask = if n > 1 { Some(causal_mask(n, cache.len, &Device::Cpu)?) } else { None };
        let a = self.layer.attn.attend(&q, &kc, &vc, mask.as_ref())?;
        let h = (hid + self.layer.attn.o.forward(&a)?)?;
        let out = (&h + self.layer.mlp.forward(&rms_norm(&h, &self.layer.post_attention_norm, eps)?)?)?;
        if commit {
            append_kv(&mut cache.kv, k, v)?;
            cache.len += n;
        }
        Ok(out)
    }

    /// Appends committed rows: target features of `rows` positions and the token after each.
    pub fn extend(&self, cache: &mut EagleCache, taps: &[Vec<f32>], rows: usize, next: &[u32]) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        if next.len() != rows {
            return Err(NetworkError::Input(format!("{rows} feature rows but {} next tokens", next.len())));
        }
        let x = stack_taps(taps, rows, self.config.hidden_size, self.config.target_layer_ids.len())?;
        let fused = self.fc.forward(&x)?;
        let out = self.run(cache, &self.embed.rows(next)?, &fused, true)?;
        cache.last = Some(out.narrow(0, rows - 1, 1)?);
        Ok(())
    }

    /// Logits over the draft vocabulary from layer outputs `(n, hidden)`.
    pub fn logits(&self, g: &Tensor) -> Result<Tensor> {
        self.lm_head.logits(&rms_norm(g, &self.norm, self.config.rms_norm_eps)?)
    }

    /// Drafts `n` tokens autoregressively from the cache's last output; the cache is unchanged.
    pub fn draft(
        &self,
        cache: &EagleCache,
        n: usize,
        mut choose: impl FnMut(usize, &[f32]) -> Result<usize>,
    ) -> Result<DraftTrace> {
        let mut out = DraftTrace::default();
        let Some(mut g) = cache.last.clone() else { return Ok(out) };
        let mut scratch = cache.clone();
        for k in 0..n {
            let row = self.logits(&g)?.flatten_all()?.to_vec1::<f32>()?;
            let tok = self.vocab.to_target(choose(k, &row)?);
            out.tokens.push(tok);
            out.logits.push(row);
            if k + 1 < n {
                g = self.run(&mut scratch, &self.embed.rows(&[tok])?, &g, true)?;
            }
        }
        Ok(out)
    }

    /// Training-time test over a whole sequence (`features`: `(L, m·hidden)`, `tokens`: L).
    /// Row i of step 1 is `(e(t_{i+1}), fused f_i)` with causal attention; step j feeds
    /// `(e(t_{i+j}), g_{j−1,i})` and attends to step-1 rows `≤ i` and to row i's own earlier
    /// steps, as drafting does. Returns each step's logits `(L−1, V_d)`; rows whose inputs
    /// run past the sequence are garbage that no valid row sees (the caller masks their loss).
    pub fn train_ttt(&self, features: &Tensor, tokens: &[u32], steps: usize) -> Result<Vec<Tensor>> {
        let l = tokens.len();
        let n = l - 1;
        let eps = self.config.rms_norm_eps;
        let fused = self.fc.forward(&features.narrow(0, 0, n)?)?;
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        let mut hid = fused;
        let mut out = Vec::with_capacity(steps);
        for j in 1..=steps {
            let next: Vec<u32> = (0..n).map(|i| tokens[(i + j).min(l - 1)]).collect();
            let emb = self.embed.rows(&next)?;
            let x = Tensor::cat(
                &[rms_norm(&emb, &self.layer.input_norm, eps)?, rms_norm(&hid, &self.hidden_norm, eps)?],
                D::Minus1,
            )?;
            let positions: Vec<usize> = (0..n).map(|i| i + j - 1).collect();
            let rope = Rope::new(&positions, self.config.head_dim, self.config.rope_theta, &Device::Cpu)?;
            let q = self.layer.attn.queries(&x, &rope)?;
            let (k, v) = self.layer.attn.keys_values(&x, &rope)?;
            keys.push(k);
            values.push(v);
            let kk = Tensor::cat(&keys, 0)?;
            let vv = Tensor::cat(&values, 0)?;
            let mask = ttt_mask(n, j)?;
            let a = self.layer.attn.attend(&q, &kk, &vv, Some(&mask))?;
            let h = (&hid + self.layer.attn.o.forward(&a)?)?;
            let g = (&h + self.layer.mlp.forward(&rms_norm(&h, &self.layer.post_attention_norm, eps)?)?)?;
            out.push(self.logits(&g)?);
            hid = g;
        }
        Ok(out)
    }
}

/// Step j's mask over `[step 1 ; … ; step j]` keys: causal on step 1, row i only on later steps.
pub fn ttt_mask(n: usize, j: usize) -> Result<Tensor> {
    let cols = n * j;
    let mut m = vec![f32::NEG_INFINITY; n * cols];
    for i in 0..n {
        let row = &mut m[i * cols..(i + 1) * cols];
        row[..=i].iter_mut().for_each(|x| *x = 0.0);
        for s in 1..j {
            row[s * n + i] = 0.0;
        }
    }
    Ok(Tensor::from_vec(m, (n, cols), &Device::Cpu)?)
}
