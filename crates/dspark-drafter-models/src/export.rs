//! Writing a drafter in a public layout, for DeepSpec's trainer and evaluator, z-lab's DFlash
//! code, or SafeAILab's / vLLM's EAGLE-3. Each folder gets the `config.json` keys and tensor
//! names that layout's own code reads, and [`crate::load`] reads it back strictly.
//!
//! What a public layout has no key for is written under names of ours, which the official
//! Python code ignores (transformers keeps unknown config keys as attributes; unexpected
//! tensors are reported and dropped):
//!
//! | ours | written as | read by the official code? |
//! |---|---|---|
//! | per-position confidence temperatures | `dspark_calibration_temperatures` | no: it uses raw `sigmoid(confidence)` |
//! | per-position confidence offsets | `dspark_calibration_biases` | no, as above |
//! | the target the drafter was made for | `dspark_target` | no (only a check in dspark) |
//! | reduced draft vocabulary (DeepSpec, z-lab) | `draft_vocab_size` + `d2t` tensor, as EAGLE-3 names them | no: DeepSpec's heads span the full vocabulary, so its code cannot load such a checkpoint; z-lab's reads out through the target's head and drafts over the full vocabulary |
//!
//! A layout is refused, naming the reason, when its code would compute something else: z-lab has
//! no Markov or confidence heads and uses the `[anchor, MASK × γ]` block; DeepSpec's blocks
//! are MASK-only; no public layout reads the last target layer (its id means the final norm's
//! output there); SafeAILab splits heads evenly and has no embedding-output tap. Not refused,
//! but documented: DeepSpec's EAGLE-3 code expects exactly five target layers, SafeAILab's own
//! code ignores vLLM's `eagle_config` (its taps are fixed), and a SafeAILab folder carries no
//! chain length (dspark drafts 8 per round from it unless told).

use crate::config::{BlockLayout, DrafterConfig, HeadKind, Method};
use crate::{DrafterNet, NetworkError, Result};
use candle_core::{Device, Tensor};
use dspark_model::{Model, EMBEDDING_TAP};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// A public checkpoint layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublicFormat {
    /// deepseek-ai/DeepSpec: `*DSparkModel` (DSpark and DFlash) or `*Eagle3Model`.
    DeepSpec,
    /// z-lab/dflash `DFlashDraftModel` with `dflash_config`.
    Zlab,
    /// SafeAILab/EAGLE and vLLM EAGLE-3: `midlayer.*`, `draft_vocab_size`, `d2t`/`t2d`, tapped
    /// layers in vLLM's `eagle_config`.
    Eagle3,
}

impl std::str::FromStr for PublicFormat {
    type Err = NetworkError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "deepspec" => Ok(Self::DeepSpec),
            "zlab" => Ok(Self::Zlab),
            "eagle3" => Ok(Self::Eagle3),
            other => Err(NetworkError::Config(format!(
                "unknown checkpoint format `{other}`; use deepspec, zlab, eagle3, dspark-q8 or dspark-q4"
            ))),
        }
    }
}

fn refuse<T>(msg: String) -> Result<T> {
    Err(NetworkError::Config(msg))
}

/// Writes `net` (a drafter for `target`) into `dir` in `format`.
pub fn export(net: &DrafterNet, target: &Model, format: PublicFormat, dir: &Path) -> Result<()> {
    let c = net.config();
    let ext = c.ext();
    let n_layers = target.config.n_layers;
    if c.target_layer_ids.contains(&(n_layers - 1)) {
        return refuse(format!(
            "the drafter reads target layer {} (the last), which public layouts cannot name: their id {} \
             means the final norm's output",
            n_layers - 1,
            n_layers - 1
        ));
    }
    let (config, tensors) = match (format, ext.method) {
        (PublicFormat::DeepSpec, Method::Eagle3) => deepspec_eagle3(net, target)?,
        (PublicFormat::DeepSpec, _) => deepspec_block(net, target)?,
        (PublicFormat::Zlab, Method::Eagle3) | (PublicFormat::Eagle3, Method::Dspark | Method::Dflash) => {
            return refuse(format!(
                "a {} drafter cannot be written in the {} layout; use --format {}",
                ext.method,
                match format {
                    PublicFormat::Zlab => "z-lab DFlash",
                    _ => "EAGLE-3",
                },
                if ext.method == Method::Eagle3 { "eagle3 or deepspec" } else { "deepspec or zlab" }
            ))
        }
        (PublicFormat::Zlab, _) => zlab(net, target)?,
        (PublicFormat::Eagle3, Method::Eagle3) => safeailab(net)?,
    };
    crate::write_checkpoint(dir, &serde_json::to_string_pretty(&config).expect("JSON"), &tensors)
}

/// Keys every layout shares: a Hugging Face config of the drafter's own decoder layers.
fn base(c: &DrafterConfig, arch: &str) -> Map<String, Value> {
    let v = json!({
        "architectures": [arch],
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias,
        "tie_word_embeddings": false,
        "use_sliding_window": false,
        "layer_types": vec!["full_attention"; c.num_hidden_layers],
        "dtype": "float32",
    });
    let Value::Object(mut m) = v else { unreachable!("a JSON object literal") };
    if let Some(t) = c.ext().target {
        m.insert("dspark_target".into(), serde_json::to_value(t).expect("JSON"));
    }
    if let Some(d) = c.draft_vocab_size {
        m.insert("draft_vocab_size".into(), d.into());
    }
    m
}

/// `Qwen3`, `Llama`, `Qwen2`: the prefix DeepSpec's class names carry.
fn family_class(c: &DrafterConfig) -> Result<&'static str> {
    Ok(match c.family()? {
        dspark_model::Family::Llama => "Llama",
        dspark_model::Family::Qwen2 => "Qwen2",
        dspark_model::Family::Qwen3 => "Qwen3",
        dspark_model::Family::Gemma3 => "Gemma3",
    })
}

/// Layer ids as DeepSpec writes them (`-1`: the embedding output).
fn deepspec_ids(ids: &[usize]) -> Vec<i64> {
    ids.iter().map(|&i| if i == EMBEDDING_TAP { -1 } else { i as i64 }).collect()
}

/// The drafter's tensors plus the copies of the target's embedding and draft-vocabulary head
/// that DeepSpec's checkpoints carry (its code reads them from the file).
fn with_target_copies(
    net: &DrafterNet,
    target: &Model,
    tensors: &BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    let c = net.config();
    let (v, d) = (c.vocab_size, c.hidden_size);
    let mut out = tensors.clone();
    if !out.contains_key("embed_tokens.weight") {
        let ids: Vec<u32> = (0..v as u32).collect();
        out.insert(
            "embed_tokens.weight".into(),
            Tensor::from_vec(target.embed(&ids)?, (v, d), &Device::Cpu)?,
        );
    }
    if !out.contains_key("lm_head.weight") {
        let ids = net.vocab().target_ids();
        let rows = target.lm_head_rows(&ids)?;
        out.insert("lm_head.weight".into(), Tensor::from_vec(rows, (ids.len(), d), &Device::Cpu)?);
    }
    if let Some(d2t) = net.vocab().tensor()? {
        out.insert("d2t".into(), d2t);
    }
    Ok(out)
}

fn deepspec_block(net: &DrafterNet, target: &Model) -> Result<(Value, BTreeMap<String, Tensor>)> {
    let DrafterNet::Block(m) = net else { unreachable!("called for block drafters") };
    let c = net.config();
    let ext = c.ext();
    if ext.layout == BlockLayout::Dflash {
        return refuse(
            "this drafter uses DFlash's [anchor, MASK × γ] block, which DeepSpec's blocks do not; \
             use --format zlab"
                .into(),
        );
    }
    let mut k = base(c, &format!("{}DSparkModel", family_class(c)?));
    k.insert("rope_parameters".into(), json!({"rope_theta": c.rope_theta, "rope_type": "default"}));
    k.insert("block_size".into(), c.block_size.into());
    k.insert("mask_token_id".into(), c.mask_token_id.into());
    k.insert("target_layer_ids".into(), deepspec_ids(&c.target_layer_ids).into());
    k.insert("num_target_layers".into(), target.config.n_layers.into());
    k.insert("enable_confidence_head".into(), ext.confidence.into());
    match ext.head {
        Some(head) => {
            k.insert("markov_rank".into(), ext.head_rank.into());
            let t = if head == HeadKind::Rnn { "rnn" } else { "vanilla" };
            k.insert("markov_head_type".into(), t.into());
            k.insert(
                "confidence_head_with_markov".into(),
                (ext.confidence && ext.confidence_with_markov).into(),
            );
        }
        None => {
            k.insert("markov_rank".into(), 0.into());
        }
    }
    if let Some(t) = &ext.calibration_temperatures {
        k.insert("dspark_calibration_temperatures".into(), json!(t));
    }
    if let Some(b) = &ext.calibration_biases {
        k.insert("dspark_calibration_biases".into(), json!(b));
    }
    let tensors = with_target_copies(net, target, m.tensors())?;
    Ok((Value::Object(k), tensors))
}

fn deepspec_eagle3(net: &DrafterNet, target: &Model) -> Result<(Value, BTreeMap<String, Tensor>)> {
    let DrafterNet::Eagle3(m) = net else { unreachable!("called for EAGLE-3 drafters") };
    let c = net.config();
    if c.target_layer_ids.contains(&EMBEDDING_TAP) {
        return refuse(
            "DeepSpec's EAGLE-3 cannot read the embedding output (layer -1); use --format eagle3".into(),
        );
    }
    let mut k = base(c, &format!("{}Eagle3Model", family_class(c)?));
    k.insert("rope_parameters".into(), json!({"rope_theta": c.rope_theta, "rope_type": "default"}));
    k.insert("ttt_length".into(), c.block_size.into());
    k.insert("target_layer_ids".into(), deepspec_ids(&c.target_layer_ids).into());
    k.insert("num_target_layers".into(), target.config.n_layers.into());
    k.insert("draft_num_hidden_layers".into(), 1.into());
    // DeepSpec's single layer is `layers.0.*` where ours is `midlayer.*`.
    let renamed: BTreeMap<String, Tensor> = m
        .tensors()
        .iter()
        .map(|(n, t)| (n.strip_prefix("midlayer.").map_or(n.clone(), |r| format!("layers.0.{r}")), t.clone()))
        .collect();
    Ok((Value::Object(k), with_target_copies(net, target, &renamed)?))
}

fn zlab(net: &DrafterNet, target: &Model) -> Result<(Value, BTreeMap<String, Tensor>)> {
    let DrafterNet::Block(m) = net else { unreachable!("called for block drafters") };
    let c = net.config();
    let ext = c.ext();
    if ext.head.is_some() || ext.confidence {
        return refuse(
            "z-lab's DFlash has no Markov/RNN or confidence head, so its code would draft without them; \
             use --format deepspec"
                .into(),
        );
    }
    if ext.layout != BlockLayout::Dflash {
        return refuse(
            "this drafter's block is MASK-only (DeepSpec's), not z-lab's [anchor, MASK × γ]; use --format deepspec"
                .into(),
        );
    }
    if c.target_layer_ids.contains(&EMBEDDING_TAP) {
        return refuse(
            "z-lab's DFlash cannot read the embedding output (layer -1); use --format deepspec".into(),
        );
    }
    let mut k = base(c, "DFlashDraftModel");
    k.insert("rope_theta".into(), c.rope_theta.into());
    k.insert("rope_scaling".into(), Value::Null);
    k.insert("block_size".into(), c.block_size.into());
    k.insert("num_target_layers".into(), target.config.n_layers.into());
    k.insert(
        "dflash_config".into(),
        json!({"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids}),
    );
    k.insert("auto_map".into(), json!({"AutoModel": "dflash.DFlashDraftModel"}));
    // z-lab embeds and reads out through the target's own tables.
    let mut tensors = m.tensors().clone();
    for copied in ["embed_tokens.weight", "lm_head.weight"] {
        if tensors.remove(copied).is_some() {
            return refuse(format!(
                "this drafter has its own `{copied}`, which z-lab's DFlash does not read (it uses the \
                 target's); use --format deepspec"
            ));
        }
    }
    if let Some(d2t) = net.vocab().tensor()? {
        tensors.insert("d2t".into(), d2t);
    }
    Ok((Value::Object(k), tensors))
}

fn safeailab(net: &DrafterNet) -> Result<(Value, BTreeMap<String, Tensor>)> {
    let DrafterNet::Eagle3(m) = net else { unreachable!("called for EAGLE-3 drafters") };
    let c = net.config();
    if c.family()? != dspark_model::Family::Llama || c.attention_bias {
        return refuse(format!(
            "SafeAILab's and vLLM's EAGLE-3 layer is LLaMA's, without the QK norm or attention biases \
             of this {} drafter; use --format deepspec",
            c.model_type
        ));
    }
    if c.head_dim * c.num_attention_heads != c.hidden_size {
        return refuse(format!(
            "head_dim {} × {} heads is not hidden_size {}: SafeAILab's and vLLM's EAGLE-3 split the hidden \
             size evenly; use --format deepspec",
            c.head_dim, c.num_attention_heads, c.hidden_size
        ));
    }
    let mut tensors = m.tensors().clone();
    if tensors.contains_key("embed_tokens.weight") {
        return refuse(
            "this drafter has its own `embed_tokens`, which SafeAILab's EAGLE-3 does not read (it uses the \
             target's); use --format deepspec"
                .into(),
        );
    }
    let mut k = base(c, "LlamaForCausalLMEagle3");
    k.remove("head_dim");
    k.remove("layer_types");
    k.remove("use_sliding_window");
    k.insert("rope_theta".into(), c.rope_theta.into());
    k.insert("draft_vocab_size".into(), c.draft_vocab().into());
    // vLLM names a tap by the layer whose input it is.
    let aux: Vec<usize> =
        c.target_layer_ids.iter().map(|&l| if l == EMBEDDING_TAP { 0 } else { l + 1 }).collect();
    k.insert("eagle_config".into(), json!({"eagle_aux_hidden_state_layer_ids": aux}));
    if let Some(d2t) = net.vocab().tensor()? {
        tensors.insert("d2t".into(), d2t);
        let mut t2d = vec![0u8; c.vocab_size];
        for i in net.vocab().target_ids() {
            t2d[i as usize] = 1;
        }
        tensors.insert("t2d".into(), Tensor::from_vec(t2d, c.vocab_size, &Device::Cpu)?);
    }
    Ok((Value::Object(k), tensors))
}
