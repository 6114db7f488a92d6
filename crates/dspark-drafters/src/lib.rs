//! Drafters, one per method, all behind [`dspark_spec::Drafter`].

mod auto;
mod block;
mod draft_model;
mod eagle3;
mod ngram;

pub use auto::AutoDrafter;
pub use block::{propose_batch, BatchEntry, BlockDrafter, BlockSeq};
pub use draft_model::DraftModel;
pub use eagle3::Eagle3Drafter;
pub use ngram::NgramDrafter;

use dspark_drafter_models::{DrafterError, Method};
use dspark_model::Model;
use dspark_spec::{DraftError, Drafter};
use std::path::Path;
use std::sync::Arc;

pub(crate) fn net_error(e: DrafterError) -> DraftError {
    match e {
        DrafterError::Model(m) => DraftError::Model(m),
        other => DraftError::Incompatible(other.to_string()),
    }
}

/// Loads a drafter checkpoint as `method` (`dflash`, `dspark` or `eagle3`) for `target`,
/// refusing a checkpoint of another method or for another target.
pub fn load_network_drafter(
    method: Method,
    dir: &Path,
    target: Arc<Model>,
    target_name: &str,
) -> Result<Box<dyn Drafter>, DrafterError> {
    let mut net = dspark_drafter_models::load(dir, target, target_name)?;
    net.quantize_for_inference()?;
    let found = net.method();
    if found != method {
        return Err(DrafterError::Config(format!(
            "{} is a {found} drafter, not {method}; use --drafter {found}:{}",
            dir.display(),
            dir.display()
        )));
    }
    let name =
        format!("{method}:{}", dir.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default());
    let wrap = |e: DraftError| DrafterError::Config(e.to_string());
    Ok(match method {
        Method::Eagle3 => Box::new(Eagle3Drafter::from_net(net, &name).map_err(wrap)?),
        _ => Box::new(BlockDrafter::from_net(net, &name).map_err(wrap)?),
    })
}
