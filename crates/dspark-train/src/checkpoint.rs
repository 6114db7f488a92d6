//! Crash-consistent training checkpoints.
//!
//! A checkpoint is one directory, `OUT/checkpoints/step-NNNNNNNN/`, holding the drafter
//! (`config.json`, `model.safetensors`), the optimiser state and `train_state.json`. It is
//! written under a temporary name, every file and the directory are fsynced, and one `rename`
//! makes it visible: a kill at any point leaves either the new checkpoint complete or only the
//! previous one, never a mix of two. Older checkpoints are removed only after the new one is in
//! place; temporaries a kill left behind are removed on resume.

use crate::{Result, TrainError};
use std::fs::File;
use std::path::{Path, PathBuf};

pub const DIR: &str = "checkpoints";
pub const STATE: &str = "train_state.json";
pub const OPTIMIZER: &str = "optimizer.safetensors";
const PREFIX: &str = "step-";
const TMP_PREFIX: &str = ".tmp-";

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::io(path, e)
}

/// Flushes a file's or a directory's contents to disk.
pub fn fsync(path: &Path) -> Result<()> {
    File::open(path).and_then(|f| f.sync_all()).map_err(io(path))
}

/// The directory a checkpoint at `step` is committed to.
pub fn final_dir(out: &Path, step: usize) -> PathBuf {
    out.join(DIR).join(format!("{PREFIX}{step:08}"))
}

/// A fresh temporary directory to write the checkpoint of `step` into.
pub fn temp_dir(out: &Path, step: usize) -> Result<PathBuf> {
    let root = out.join(DIR);
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let tmp = root.join(format!("{TMP_PREFIX}{PREFIX}{step:08}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    Ok(tmp)
}

/// Fsyncs every file of `tmp` and `tmp` itself, renames it to `dest` and fsyncs the parent, so
/// that the rename is the single moment the checkpoint appears.
pub fn commit(tmp: &Path, dest: &Path) -> Result<()> {
    for e in std::fs::read_dir(tmp).map_err(io(tmp))? {
        fsync(&e.map_err(io(tmp))?.path())?;
    }
    fsync(tmp)?;
    if dest.exists() {
        // Replacing a committed checkpoint could not be atomic; callers skip steps already saved.
        return Err(TrainError::Data(format!(
            "{} already exists; is another run writing to this folder?",
            dest.display()
        )));
    }
    std::fs::rename(tmp, dest).map_err(io(dest))?;
    fsync(dest.parent().expect("checkpoints live in a directory"))
}

fn step_of(name: &str) -> Option<usize> {
    name.strip_prefix(PREFIX)?.parse().ok()
}

/// Committed checkpoints, oldest first.
pub fn list(out: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let root = out.join(DIR);
    if !root.is_dir() {
        return Ok(Vec::new());
    }
    let mut v = Vec::new();
    for e in std::fs::read_dir(&root).map_err(io(&root))? {
        let e = e.map_err(io(&root))?;
        if let Some(step) = e.file_name().to_str().and_then(step_of) {
            v.push((step, e.path()));
        }
    }
    v.sort();
    Ok(v)
}

/// Removes committed checkpoints other than `keep`.
pub fn prune(out: &Path, keep: &Path) -> Result<()> {
    for (_, p) in list(out)? {
        if p != keep {
            std::fs::remove_dir_all(&p).map_err(io(&p))?;
        }
    }
    Ok(())
}

/// Removes what an interrupted save left: temporary checkpoint directories and half-written
/// top-level files.
pub fn clean_temporaries(out: &Path) -> Result<()> {
    let root = out.join(DIR);
    if root.is_dir() {
        for e in std::fs::read_dir(&root).map_err(io(&root))? {
            let e = e.map_err(io(&root))?;
            if e.file_name().to_str().is_some_and(|n| n.starts_with(TMP_PREFIX)) {
                std::fs::remove_dir_all(e.path()).map_err(io(&e.path()))?;
            }
        }
    }
    if out.is_dir() {
        for e in std::fs::read_dir(out).map_err(io(out))? {
            let p = e.map_err(io(out))?.path();
            if p.is_file() && p.extension().is_some_and(|x| x == "partial") {
                std::fs::remove_file(&p).map_err(io(&p))?;
            }
        }
    }
    Ok(())
}

/// Whether `out` holds a training run (a committed checkpoint, or the single-directory layout
/// of earlier versions).
pub fn has_run(out: &Path) -> bool {
    list(out).is_ok_and(|v| !v.is_empty()) || out.join(STATE).exists()
}

/// The newest committed checkpoint that is complete, or the earlier versions' layout
/// (`OUT/train_state.json` beside the weights) when there is none.
pub fn latest(out: &Path) -> Result<PathBuf> {
    for (_, dir) in list(out)?.into_iter().rev() {
        if [STATE, OPTIMIZER, "config.json", "model.safetensors"].iter().all(|f| dir.join(f).is_file()) {
            return Ok(dir);
        }
    }
    if out.join(STATE).is_file() {
        return Ok(out.to_path_buf());
    }
    Err(TrainError::Data(format!(
        "cannot resume: {} holds no complete checkpoint; start without --resume",
        out.display()
    )))
}
