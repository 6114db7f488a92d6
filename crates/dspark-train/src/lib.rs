//! Drafter training on one machine: data, features, anchored blocks, losses, optimiser,
//! checkpoints, calibration.

pub mod blocks;
pub mod checkpoint;
pub mod data;
pub mod features;
pub mod loss;
pub mod optim;
pub mod trainer;

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("cannot access {path}: {msg}")]
    Io { path: String, msg: String },
    #[error("training data: {0}")]
    Data(String),
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] dspark_model::ModelError),
    #[error(transparent)]
    Drafter(#[from] dspark_drafter_models::NetworkError),
    #[error(transparent)]
    Decode(#[from] dspark_decode::DecodeError),
    #[error(transparent)]
    Tokenizer(#[from] dspark_tokenizer::TokenizerError),
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
}

impl TrainError {
    pub(crate) fn io(path: &Path, e: impl std::fmt::Display) -> Self {
        Self::Io { path: path.display().to_string(), msg: e.to_string() }
    }
}

pub type Result<T> = std::result::Result<T, TrainError>;
