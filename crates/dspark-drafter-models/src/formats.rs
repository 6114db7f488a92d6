//! Public checkpoints' `config.json`, read by the rules of the code that wrote them and turned
//! into a [`DrafterConfig`]. The format is named by `architectures[0]` (never guessed from the
//! tensors), and every key is either read, known not to change what the drafter computes, or
//! refused by name and value: a drafter that loads must compute what its own code computes.
//!
//! | `architectures[0]` | code | notes |
//! |---|---|---|
//! | `*DSparkModel` | DeepSpec DSpark / DFlash | `markov_head_type`, confidence flags, layer −1 |
//! | `*Eagle3Model` | DeepSpec EAGLE-3 | `layers.0.*`, `ttt_length` drafts |
//! | `DFlashDraftModel` | z-lab DFlash | `dflash_config`, `[anchor, MASK × γ]` with γ = B − 1 |
//! | `LlamaForCausalLM` (+ `draft_vocab_size`), `LlamaForCausalLMEagle3` | SafeAILab / vLLM EAGLE-3 | taps fixed by code |

use crate::config::{layer_id, BlockLayout, DrafterConfig, Extensions, Format, HeadKind, Method};
use crate::{NetworkError, Result};
use serde_json::{Map, Value};

/// Chain length of a SafeAILab EAGLE-3 round: its `EaModel` default depth 7 drafts 8 tokens
/// (the tree is not used; this is only the default γ, a runtime choice).
const SAFEAILAB_DRAFTS: usize = 8;

/// Keys that never change what a drafter computes at inference: bookkeeping, token ids the
/// target's tokenizer provides, training-only settings, dropout (off at inference).
const INFORMATIONAL: &[&str] = &[
    "_name_or_path",
    "auto_map",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "max_position_embeddings",
    "num_anchors",
    "step_loss_decay",
    "confidence_head_alpha",
    "target_model_name_or_path",
];

/// The keys of one config object, taken one by one; what is left at the end is checked.
struct Keys<'a> {
    map: Map<String, Value>,
    path: &'a str,
}

impl<'a> Keys<'a> {
    fn err(&self, msg: String) -> NetworkError {
        NetworkError::Config(format!("{}: {msg}", self.path))
    }

    fn take(&mut self, k: &str) -> Option<Value> {
        self.map.remove(k).filter(|v| !v.is_null())
    }

    fn usize(&mut self, k: &str) -> Result<Option<usize>> {
        match self.take(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.err(format!("`{k}` is {v}, not a non-negative integer"))),
        }
    }

    fn need_usize(&mut self, k: &str) -> Result<usize> {
        self.usize(k)?.ok_or_else(|| self.err(format!("lacks `{k}`")))
    }

    fn f64(&mut self, k: &str) -> Result<Option<f64>> {
        match self.take(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.err(format!("`{k}` is {v}, not a number"))),
        }
    }

    fn bool(&mut self, k: &str) -> Result<Option<bool>> {
        match self.take(k) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.err(format!("`{k}` is {v}, not true/false"))),
        }
    }

    fn str(&mut self, k: &str) -> Result<Option<String>> {
        match self.take(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(format!("`{k}` is {v}, not a string"))),
        }
    }

    fn layer_ids(&mut self, k: &str, allow_embedding: bool) -> Result<Option<Vec<usize>>> {
        let Some(v) = self.take(k) else { return Ok(None) };
        let arr = v.as_array().ok_or_else(|| self.err(format!("`{k}` is {v}, not a list")))?;
        let mut out = Vec::with_capacity(arr.len());
        for x in arr {
            let i = x.as_i64().ok_or_else(|| self.err(format!("`{k}` holds {x}, not an integer")))?;
            if i == -1 && !allow_embedding {
                return Err(self.err(format!(
                    "`{k}` holds -1 (the embedding output), which this format does not allow"
                )));
            }
            out.push(layer_id(i).map_err(|e| self.err(format!("`{k}`: {e}")))?);
        }
        Ok(Some(out))
    }

    /// Keys whose value is harmless only at one setting: refused, naming them, at any other.
    fn expect(&mut self, k: &str, ok: impl Fn(&Value) -> bool, why: &str) -> Result<()> {
        match self.take(k) {
            Some(v) if !ok(&v) => Err(self.err(format!("`{k}` = {v} is not implemented ({why})"))),
            _ => Ok(()),
        }
    }

    /// Refuses any key not read so far and not known to be informational.
    fn finish(mut self) -> Result<()> {
        for k in INFORMATIONAL {
            self.map.remove(*k);
        }
        match self.map.iter().next() {
            None => Ok(()),
            Some((k, v)) => Err(self.err(format!(
                "config key `{k}` = {v} is not understood by dspark's loader for this format, so it \
                 may change what the drafter computes; refusing rather than drafting with something else"
            ))),
        }
    }
}

/// Whether `config.json`'s object is one of ours (everything else is a public format).
pub fn is_ours(v: &Value) -> bool {
    v.get("dspark").is_some()
}

/// A public checkpoint's config as a [`DrafterConfig`].
pub fn public(v: Value, path: &str) -> Result<DrafterConfig> {
    let Value::Object(map) = v else {
        return Err(NetworkError::Config(format!("{path}: config.json is not a JSON object")));
    };
    let mut k = Keys { map, path };
    let arch = match k.take("architectures") {
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        other => {
            return Err(k.err(format!(
                "`architectures` is {other:?}; a drafter config names exactly one architecture"
            )))
        }
    };
    let kind = if arch.ends_with("DSparkModel") {
        Kind::DeepSpecBlock
    } else if arch.ends_with("Eagle3Model") {
        Kind::DeepSpecEagle3
    } else if arch == "DFlashDraftModel" {
        Kind::Zlab
    } else if arch == "LlamaForCausalLMEagle3"
        || (arch == "LlamaForCausalLM" && k.map.contains_key("draft_vocab_size"))
    {
        Kind::SafeAiLab
    } else {
        return Err(k.err(format!(
            "architecture `{arch}` is not a drafter dspark reads (DeepSpec *DSparkModel / *Eagle3Model, \
             z-lab DFlashDraftModel, SafeAILab/vLLM EAGLE-3 LlamaForCausalLM with draft_vocab_size, or \
             one made by `dspark init-drafter`)"
        )));
    };
    let model_type = k.str("model_type")?.ok_or_else(|| k.err("lacks `model_type`".into()))?;
    let hidden = k.need_usize("hidden_size")?;
    let heads = k.need_usize("num_attention_heads")?;
    let kv_heads = k.usize("num_key_value_heads")?.unwrap_or(heads);
    let head_dim_key = k.usize("head_dim")?;
    // SafeAILab's `Model` ignores `head_dim` and splits the hidden size evenly.
    let head_dim = match kind {
        Kind::SafeAiLab => hidden / heads.max(1),
        _ => head_dim_key.unwrap_or(hidden / heads.max(1)),
    };
    let layers = k.need_usize("num_hidden_layers")?;
    let rope_theta = rope(&mut k)?;
    k.expect("hidden_act", |v| v == "silu", "only SiLU MLPs are implemented")?;
    k.expect("mlp_bias", |v| v == false, "MLP biases are not implemented")?;
    k.expect("pretraining_tp", |v| v == 1, "tensor-parallel pretraining splits are not implemented")?;
    k.expect(
        "tie_word_embeddings",
        |v| v == false,
        "a drafter head tied to its embedding is not implemented",
    )?;
    k.expect(
        "use_sliding_window",
        |v| v == false,
        "sliding-window attention is not implemented for drafters",
    )?;
    k.expect(
        "norm_before_residual",
        |v| v == false,
        "EAGLE-3's residual from the normed hidden state is not implemented",
    )?;
    if let Some(v) = k.take("is_causal") {
        return Err(k.err(format!(
            "`is_causal` = {v} is not implemented (each format's attention masking is fixed by its code)"
        )));
    }
    if let Some(v) = k.take("layer_types") {
        let all_full = v.as_array().is_some_and(|a| a.iter().all(|t| t == "full_attention"));
        if !all_full {
            return Err(
                k.err(format!("`layer_types` = {v} is not implemented (only full_attention layers are)"))
            );
        }
    }
    // Only read when use_sliding_window is on, which is refused above.
    k.take("sliding_window");
    k.take("max_window_layers");
    let rms_norm_eps = k.f64("rms_norm_eps")?.unwrap_or(1e-6);
    let vocab_size = k.need_usize("vocab_size")?;
    let attention_bias = k.bool("attention_bias")?.unwrap_or(false) || model_type == "qwen2";
    let num_target_layers = k.usize("num_target_layers")?;

    let mut c = DrafterConfig {
        architectures: vec![arch.clone()],
        model_type,
        hidden_size: hidden,
        intermediate_size: k.need_usize("intermediate_size")?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        rms_norm_eps,
        rope_theta,
        vocab_size,
        attention_bias,
        block_size: 0,
        markov_rank: 0,
        target_layer_ids: Vec::new(),
        mask_token_id: None,
        draft_vocab_size: None,
        dspark: None,
        format: Format::DeepSpec,
        num_target_layers,
        taps_from_target: false,
    };
    let mut ext = Extensions {
        method: Method::Dflash,
        head: None,
        head_rank: 0,
        confidence: false,
        layout: BlockLayout::Dspark,
        calibration_temperatures: None,
        calibration_biases: None,
        target: None,
        confidence_with_markov: false,
    };
    match kind {
        Kind::DeepSpecBlock => {
            c.block_size = k.need_usize("block_size")?;
            c.mask_token_id = Some(k.need_usize("mask_token_id")? as u32);
            c.target_layer_ids = k
                .layer_ids("target_layer_ids", true)?
                .ok_or_else(|| k.err("lacks `target_layer_ids`".into()))?;
            let rank = k.usize("markov_rank")?.unwrap_or(0);
            let head_type = k.str("markov_head_type")?;
            let conf = k.bool("enable_confidence_head")?;
            let with_markov = k.bool("confidence_head_with_markov")?.unwrap_or(false);
            if rank > 0 {
                ext.head = Some(match head_type.as_deref().unwrap_or("vanilla") {
                    "vanilla" => HeadKind::Markov,
                    "rnn" => HeadKind::Rnn,
                    other => {
                        return Err(k.err(format!(
                            "`markov_head_type` = \"{other}\" is not implemented (vanilla and rnn are)"
                        )))
                    }
                });
                ext.head_rank = rank;
            }
            ext.confidence = match conf {
                Some(b) => b,
                None if rank == 0 => false,
                None => {
                    return Err(k.err(
                        "has a Markov head but no `enable_confidence_head`; say whether the checkpoint has a confidence head".into(),
                    ))
                }
            };
            if ext.confidence && with_markov && rank == 0 {
                return Err(k.err(
                    "`confidence_head_with_markov` is true but there is no Markov head (markov_rank 0)"
                        .into(),
                ));
            }
            ext.confidence_with_markov = with_markov;
            ext.method = if ext.head.is_some() || ext.confidence { Method::Dspark } else { Method::Dflash };
            c.markov_rank = if ext.head == Some(HeadKind::Markov) { rank } else { 0 };
        }
        Kind::Zlab => {
            c.format = Format::Zlab;
            c.block_size = k.need_usize("block_size")?;
            let Some(Value::Object(d)) = k.take("dflash_config") else {
                return Err(
                    k.err("lacks the `dflash_config` object (mask_token_id, target_layer_ids)".into())
                );
            };
            let mut d = Keys { map: d, path };
            c.mask_token_id = Some(d.need_usize("mask_token_id")? as u32);
            let n = num_target_layers.ok_or_else(|| k.err("lacks `num_target_layers`".into()))?;
            c.target_layer_ids = match d.layer_ids("target_layer_ids", false)? {
                Some(ids) => ids,
                None => zlab_default_layers(n, layers),
            };
            d.finish().map_err(|e| NetworkError::Config(format!("{e} (in `dflash_config`)")))?;
            ext.layout = BlockLayout::Dflash;
        }
        Kind::DeepSpecEagle3 => {
            c.block_size = k.need_usize("ttt_length")?;
            c.target_layer_ids = k
                .layer_ids("target_layer_ids", false)?
                .ok_or_else(|| k.err("lacks `target_layer_ids`".into()))?;
            if let Some(n) = k.usize("draft_num_hidden_layers")?.filter(|&n| n != layers) {
                return Err(
                    k.err(format!("`draft_num_hidden_layers` {n} differs from num_hidden_layers {layers}"))
                );
            }
            ext.method = Method::Eagle3;
        }
        Kind::SafeAiLab => {
            c.format = Format::SafeAiLab;
            c.block_size = SAFEAILAB_DRAFTS;
            let vd = k.need_usize("draft_vocab_size")?;
            // SafeAILab deletes d2t/t2d when the draft vocabulary is the full one.
            c.draft_vocab_size = (vd != vocab_size).then_some(vd);
            // vLLM's EAGLE-3 configs name the tapped layers by the layer whose *input* they are.
            c.target_layer_ids = match k.take("eagle_config") {
                Some(Value::Object(e)) => {
                    let mut e = Keys { map: e, path };
                    let ids = e.layer_ids("eagle_aux_hidden_state_layer_ids", false)?.ok_or_else(|| {
                        k.err("`eagle_config` lacks `eagle_aux_hidden_state_layer_ids`".into())
                    })?;
                    e.finish().map_err(|e| NetworkError::Config(format!("{e} (in `eagle_config`)")))?;
                    ids.into_iter().map(|i| i.checked_sub(1).unwrap_or(dspark_model::EMBEDDING_TAP)).collect()
                }
                Some(v) => return Err(k.err(format!("`eagle_config` is {v}, not an object"))),
                None => {
                    c.taps_from_target = true;
                    Vec::new()
                }
            };
            ext.method = Method::Eagle3;
        }
    }
    // SafeAILab's key, read above for its own format; a reduced vocabulary in the other
    // layouts is one of ours (see `export`), as are the keys below.
    if k.map.contains_key("draft_vocab_size") {
        let vd = k.need_usize("draft_vocab_size")?;
        c.draft_vocab_size = (vd != vocab_size).then_some(vd);
    }
    if let Some(t) = k.take("dspark_calibration_temperatures") {
        let t: Vec<f32> = serde_json::from_value(t.clone())
            .map_err(|_| k.err(format!("`dspark_calibration_temperatures` is {t}, not a list of numbers")))?;
        ext.calibration_temperatures = Some(t);
    }
    if let Some(b) = k.take("dspark_calibration_biases") {
        let b: Vec<f32> = serde_json::from_value(b.clone())
            .map_err(|_| k.err(format!("`dspark_calibration_biases` is {b}, not a list of numbers")))?;
        ext.calibration_biases = Some(b);
    }
    if let Some(t) = k.take("dspark_target") {
        ext.target = Some(
            serde_json::from_value(t.clone())
                .map_err(|e| k.err(format!("`dspark_target` is {t}, which dspark cannot read: {e}")))?,
        );
    }
    k.finish()?;
    c.dspark = Some(ext);
    c.validate().map_err(|e| NetworkError::Config(format!("{path}: {e}")))?;
    Ok(c)
}

#[derive(Clone, Copy)]
enum Kind {
    DeepSpecBlock,
    DeepSpecEagle3,
    Zlab,
    SafeAiLab,
}

/// z-lab's `build_target_layer_ids`: the middle layer for one draft layer, otherwise as many ids
/// as draft layers spread evenly over `1 ..= L−3`, rounded.
fn zlab_default_layers(n_target: usize, n_draft: usize) -> Vec<usize> {
    if n_draft <= 1 {
        return vec![n_target / 2];
    }
    let (start, end) = (1.0, n_target as f64 - 3.0);
    (0..n_draft)
        .map(|i| (start + i as f64 * (end - start) / (n_draft as f64 - 1.0)).round() as usize)
        .collect()
}

/// The RoPE base from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`;
/// scaled variants are refused by name.
fn rope(k: &mut Keys) -> Result<f64> {
    let default_type = |v: &Value, k: &Keys, key: &str| -> Result<()> {
        let t = v.get("rope_type").or_else(|| v.get("type"));
        match t {
            None => Ok(()),
            Some(t) if t == "default" => Ok(()),
            Some(t) => Err(k.err(format!(
                "`{key}` has rope_type {t}, which dspark's drafters do not implement (only the default RoPE is)"
            ))),
        }
    };
    let mut theta = k.f64("rope_theta")?;
    if let Some(p) = k.take("rope_parameters") {
        let Value::Object(m) = &p else {
            return Err(k.err(format!("`rope_parameters` is {p}, not an object")));
        };
        default_type(&p, k, "rope_parameters")?;
        if let Some((key, v)) =
            m.iter().find(|(key, _)| !["rope_theta", "rope_type", "type"].contains(&key.as_str()))
        {
            return Err(k.err(format!("`rope_parameters.{key}` = {v} is not implemented")));
        }
        if let Some(t) = m.get("rope_theta") {
            theta = Some(t.as_f64().ok_or_else(|| k.err(format!("`rope_parameters.rope_theta` is {t}")))?);
        }
    }
    if let Some(s) = k.take("rope_scaling") {
        default_type(&s, k, "rope_scaling")?;
        if let Some((key, v)) = s
            .as_object()
            .and_then(|m| m.iter().find(|(key, _)| !["rope_type", "type"].contains(&key.as_str())))
        {
            return Err(k.err(format!("`rope_scaling.{key}` = {v} is not implemented")));
        }
    }
    // transformers' default base for Llama and Qwen configs, and SafeAILab's fallback.
    Ok(theta.unwrap_or(10_000.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zlab_default_layers_follow_its_rule() {
        assert_eq!(zlab_default_layers(8, 3), vec![1, 3, 5]);
        assert_eq!(zlab_default_layers(8, 1), vec![4]);
        assert_eq!(zlab_default_layers(36, 5), vec![1, 9, 17, 25, 33]);
    }
}
