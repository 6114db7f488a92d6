//! Drafters, one per method, all behind [`dspark_spec::Drafter`].

mod auto;
mod block;
mod draft_model;
mod eagle3;
mod ngram;
mod recorder;

pub use auto::AutoDrafter;
pub use block::{propose_batch, BatchEntry, BlockDrafter, BlockSeq};
pub use draft_model::{DraftModel, DEFAULT_MIN_P};
pub use eagle3::Eagle3Drafter;
pub use ngram::NgramDrafter;
pub use recorder::Recorder;

use dspark_drafter_models::{Method, NetworkError};
use dspark_model::Model;
use dspark_spec::{DraftError, Drafter};
use std::path::Path;
use std::sync::Arc;

pub(crate) fn net_error(e: NetworkError) -> DraftError {
    match e {
        NetworkError::Model(m) => DraftError::Model(m),
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
) -> Result<Box<dyn Drafter>, NetworkError> {
    let (net, name) = load_network(method, dir, target, target_name)?;
    let wrap = |e: DraftError| NetworkError::Config(e.to_string());
    Ok(match method {
        Method::Eagle3 => Box::new(Eagle3Drafter::from_net(net, &name).map_err(wrap)?),
        _ => Box::new(BlockDrafter::from_net(net, &name).map_err(wrap)?),
    })
}

/// The network of a drafter checkpoint of `method`, with its quantized drafting weights
/// ([`dspark_drafter_models::DraftWeights`]), and its display name (`method:folder`); a
/// checkpoint of another method is refused.
pub fn load_network(
    method: Method,
    dir: &Path,
    target: Arc<Model>,
    target_name: &str,
) -> Result<(dspark_drafter_models::DrafterNet, String), NetworkError> {
    let mut net = dspark_drafter_models::load(dir, target, target_name)?;
    net.quantize_for_inference()?;
    let found = net.method();
    if found != method {
        return Err(NetworkError::Config(format!(
            "{} is a {found} drafter, not {method}; use --drafter {found}:{}",
            dir.display(),
            dir.display()
        )));
    }
    let name =
        format!("{method}:{}", dir.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default());
    Ok((net, name))
}

/// A `--drafter` value, parsed in this one place for every command.
#[derive(Debug, Clone, PartialEq)]
pub enum DrafterSpec {
    /// Prompt lookup where it matches, the DSpark drafter shipped for the target while it pays.
    Auto,
    /// Plain decoding.
    None,
    /// Prompt lookup (n-gram).
    Ngram,
    /// A small model with the target's tokenizer, by name or path.
    DraftModel(String),
    /// A drafter checkpoint folder of a method.
    Network(Method, std::path::PathBuf),
}

impl std::str::FromStr for DrafterSpec {
    type Err = NetworkError;

    fn from_str(s: &str) -> Result<Self, NetworkError> {
        let (kind, arg) = s.split_once(':').unwrap_or((s, ""));
        let needs = |what: &str| {
            NetworkError::Config(format!(
                "drafter `{s}` names no {what}; write {kind}:{}",
                what.to_uppercase()
            ))
        };
        Ok(match (kind, arg) {
            ("auto", "") => Self::Auto,
            ("none", "") => Self::None,
            ("ngram", "") => Self::Ngram,
            ("draft", "") => return Err(needs("model")),
            ("draft", m) => Self::DraftModel(m.to_string()),
            ("dspark" | "dflash" | "eagle3", "") => return Err(needs("path")),
            ("dspark" | "dflash" | "eagle3", p) => Self::Network(kind.parse()?, p.into()),
            _ => {
                return Err(NetworkError::Config(format!(
                    "unknown drafter `{kind}`; use auto, none, ngram, draft:MODEL, dspark:PATH, dflash:PATH or eagle3:PATH"
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafter_specs_parse_or_say_what_is_wrong() {
        assert_eq!("auto".parse::<DrafterSpec>().unwrap(), DrafterSpec::Auto);
        assert_eq!("none".parse::<DrafterSpec>().unwrap(), DrafterSpec::None);
        assert_eq!("ngram".parse::<DrafterSpec>().unwrap(), DrafterSpec::Ngram);
        assert_eq!(
            "draft:qwen2.5-coder-0.5b".parse::<DrafterSpec>().unwrap(),
            DrafterSpec::DraftModel("qwen2.5-coder-0.5b".into())
        );
        assert_eq!(
            "eagle3:/x/y".parse::<DrafterSpec>().unwrap(),
            DrafterSpec::Network(Method::Eagle3, "/x/y".into())
        );
        for (bad, says) in
            [("draft:", "names no model"), ("dspark:", "names no path"), ("medusa:x", "unknown drafter")]
        {
            let e = bad.parse::<DrafterSpec>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
