//! Drafters, one per method, all behind [`dspark_spec::Drafter`].

mod draft_model;
mod ngram;

pub use draft_model::DraftModel;
pub use ngram::NgramDrafter;
