//! The drafters shipped in `drafters/` (saved before we adopted DeepSpec's tensor names) still
//! load strictly: every tensor in their files is read.

mod common;

use dspark_model::Model;
use std::path::PathBuf;
use std::sync::Arc;

#[test]
fn shipped_drafters_load_strictly() {
    let t = Arc::new(Model::load(&common::model("smollm2-135m")).unwrap());
    for name in ["dflash", "dspark-markov", "dspark-rnn", "eagle3"] {
        let dir = PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for tests"),
        )
        .join(format!("../../drafters/smollm2-135m-{name}"));
        let net = dspark_drafter_models::load(&dir, t.clone(), "smollm2-135m")
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Saving writes DeepSpec's names, and the saved copy loads back.
        let out = tempfile::tempdir().unwrap();
        net.save(out.path()).unwrap();
        dspark_drafter_models::load(out.path(), t.clone(), "smollm2-135m")
            .unwrap_or_else(|e| panic!("{name} resaved: {e}"));
    }
}
