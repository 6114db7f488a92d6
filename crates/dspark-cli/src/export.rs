//! `dspark export-drafter`: one of our drafters written in a public layout (DeepSpec, z-lab
//! DFlash, SafeAILab / vLLM EAGLE-3); see `dspark_drafter_models::export` for what each layout
//! carries and which of our additions the official code does not read.

use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_drafter_models::export::{export, PublicFormat};
use dspark_model::Model;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct ExportArgs {
    /// The drafter checkpoint folder.
    drafter: PathBuf,
    /// deepspec (DSpark, DFlash with DeepSpec's block, EAGLE-3), zlab (DFlash with the
    /// [anchor, MASK × γ] block), eagle3 (SafeAILab / vLLM), or dspark-q8: ours with every large
    /// matrix in 8 bits (one f32 scale per 32 values; a quarter of the f32 size, what the
    /// drafter computes with anyway), for shipping; dspark-q4: the same in 4 bits (an eighth of
    /// the size), for drafters too deep for 8 bits under a size limit.
    #[arg(long)]
    format: String,
    /// Output folder (config.json + model.safetensors).
    #[arg(long)]
    out: PathBuf,
    /// The target (name or path; default: the one the drafter records). The layouts that carry
    /// copies of the target's embedding and head take them from it.
    #[arg(long)]
    target: Option<String>,
}

pub fn run(a: ExportArgs) -> Result<()> {
    if a.out.join("config.json").exists() {
        bail!("{} already holds a checkpoint; choose an empty --out folder", a.out.display());
    }
    let quant = match a.format.as_str() {
        "dspark-q8" => Some((dspark_drafter_models::Quant::Q8, 8)),
        "dspark-q4" => Some((dspark_drafter_models::Quant::Q4, 4)),
        _ => None,
    };
    if let Some((quant, bits)) = quant {
        let bytes = dspark_drafter_models::compact(&a.drafter, &a.out, quant)?;
        eprintln!(
            "wrote {} with {bits}-bit matrices to {} ({:.1} MB of weights)",
            a.drafter.display(),
            a.out.display(),
            bytes as f64 / 1e6
        );
        return Ok(());
    }
    let format: PublicFormat = a.format.parse()?;
    let recorded = dspark_drafter_models::read_config(&a.drafter)?.ext().target.map(|t| t.name);
    let target_arg = match a.target.or(recorded) {
        Some(t) => crate::ModelArg { model: t },
        None => bail!("{} does not say which target it was made for; pass --target", a.drafter.display()),
    };
    let path = dspark_hub::resolve(&target_arg.model, true)?;
    let target = Arc::new(Model::load(&path).with_context(|| format!("loading target {}", path.display()))?);
    let net = dspark_drafter_models::load(&a.drafter, target.clone(), &target_arg.name())
        .with_context(|| format!("loading drafter {}", a.drafter.display()))?;
    export(&net, &target, format, &a.out)?;
    eprintln!("wrote {} in the {} layout to {}", a.drafter.display(), a.format, a.out.display());
    Ok(())
}
