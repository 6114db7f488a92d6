//! Bad input gets a clear message and a non-zero exit, never a panic.

mod common;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::*;
use std::io::Write;

fn fails_with(args: &[&str], needle: &str) {
    let out = dspark(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "dspark {args:?} should fail");
    assert!(!err.contains("panicked"), "dspark {args:?} panicked: {err}");
    assert!(err.contains(needle), "dspark {args:?}: expected {needle:?} in: {err}");
}

/// `dspark args` with the environment variable `key` set to `value` fails with `needle`.
fn env_fails_with<S: AsRef<std::ffi::OsStr>>(args: &[S], key: &str, value: &str, needle: &str) {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_dspark")).args(args).env(key, value).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{key}={value}: {err}");
    assert!(err.contains(needle), "{key}={value}: expected {needle:?} in: {err}");
}

#[test]
fn missing_file() {
    fails_with(&["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"], "does not exist");
}

#[test]
fn unknown_model_name_lists_the_known_ones() {
    fails_with(&["tokenize", "--model", "llama-70b", "hi"], "known models: smollm2-135m");
}

#[test]
fn not_a_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("notes.gguf");
    std::fs::write(&p, "this is just text, not a model").unwrap();
    fails_with(&["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"], "not a readable GGUF");
}

#[test]
fn truncated_gguf() {
    let src = std::fs::read(model("smollm2-135m")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.gguf");
    std::fs::File::create(&p).unwrap().write_all(&src[..src.len() / 3]).unwrap();
    fails_with(&["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"], "truncated");
}

#[test]
fn unsupported_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mamba.gguf");
    let t = QTensor::quantize(
        &Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let arch = Value::String("mamba".into());
    let mut f = std::fs::File::create(&p).unwrap();
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &[("token_embd.weight", &t)]).unwrap();
    drop(f);
    fails_with(&["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"], "architecture `mamba`");
}

#[test]
fn prompt_longer_than_the_context() {
    let path = model("smollm2-135m");
    let long = "word ".repeat(9000);
    fails_with(
        &["generate", "--model", path.to_str().unwrap(), "--raw", "--prompt", &long, "--max-tokens", "4"],
        "context is 8192",
    );
}

#[test]
fn bad_sampling_parameters() {
    let path = model("smollm2-135m");
    let p = path.to_str().unwrap();
    fails_with(&["generate", "--model", p, "--prompt", "hi", "--temperature=-1"], "temperature");
    fails_with(
        &["generate", "--model", p, "--prompt", "hi", "--temperature", "1", "--top-p", "1.5"],
        "top-p",
    );
    fails_with(&["generate", "--model", p, "--prompt", "hi", "--max-tokens", "0"], "--max-tokens");
}

#[test]
fn bad_drafter_checkpoints_and_options() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing-here");
    let spec = format!("dspark:{}", missing.display());
    fails_with(&["generate", "--prompt", "hi", "--drafter", &spec], "a drafter is a folder with config.json");
    fails_with(&["generate", "--prompt", "hi", "--drafter", "medusa:x"], "unknown drafter `medusa`");
    let out = dir.path().join("d");
    let o = out.to_str().unwrap();
    fails_with(&["init-drafter", "--method", "medusa", "--out", o], "unknown method `medusa`");
    fails_with(&["init-drafter", "--head", "lstm", "--out", o], "unknown head `lstm`");
    fails_with(&["init-drafter", "--block", "0", "--out", o], "at least one token");
    fails_with(&["init-drafter", "--target-layers", "1,99", "--out", o], "target layer 99 does not exist");
    fails_with(&["init-drafter", "--draft-vocab", "0", "--out", o], "draft vocabulary size must be in");
    fails_with(&["init-drafter", "--target", "gemma3-270m", "--out", o], "gemma3 targets are not supported");
    // A DFlash checkpoint asked for as DSpark, and a garbled config.
    assert!(dspark(&["init-drafter", "--method", "dflash", "--block", "3", "--out", o]).status.success());
    fails_with(&["generate", "--prompt", "hi", "--drafter", &format!("dspark:{o}")], "is a dflash drafter");
    // γ beyond the block is refused the same way by every command.
    let dflash = format!("dflash:{o}");
    let too_long = "exceeds the drafter's block of 3 tokens";
    fails_with(&["generate", "--prompt", "hi", "--drafter", &dflash, "--draft-len", "5"], too_long);
    fails_with(&["serve", "--drafter", &dflash, "--draft-len", "5"], too_long);
    fails_with(&["serve", "--drafter", "draft:"], "names no model");
    std::fs::write(out.join("config.json"), "{not json").unwrap();
    fails_with(&["generate", "--prompt", "hi", "--drafter", &format!("dflash:{o}")], "config.json");
}

#[test]
fn hostile_numbers_and_files_get_clear_errors() {
    let path = model("smollm2-135m");
    let p = path.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "--model", p, "--prompt", "hi"];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run =
        |a: Vec<String>, needle: &str| fails_with(&a.iter().map(String::as_str).collect::<Vec<_>>(), needle);
    run(
        gen(&["--drafter", "none", "--max-tokens", "18446744073709551615"]),
        "exceeds the model's context of 8192",
    );
    run(gen(&["--drafter", "ngram", "--min-survival", "NaN"]), "--min-survival must be between 0 and 1");
    run(gen(&["--drafter", "ngram", "--policy", "dspark"]), "has no confidence head");
    run(gen(&["--drafter", "ngram", "--policy", "sometimes"]), "sometimes");
    run(gen(&["--drafter", "ngram", "--policy", "plain"]), "use --drafter none");
    run(gen(&["--drafter", "ngram", "--policy", "fixed", "--min-survival", "0.2"]), "give one of the two");
    fails_with(&["init-drafter", "--block", "100000", "--out", "/nonexistent/d"], "block_size is 100000");
    env_fails_with(&gen(&["--drafter", "none"]), "DSPARK_THREADS", "abc", "DSPARK_THREADS=abc");
    for v in ["bogus", "avx512-vnni-nope"] {
        env_fails_with(&gen(&["--drafter", "none"]), "DSPARK_KERNELS", v, "is not a kernel path");
    }
    // Refused even where no network drafter loads, so that a misspelt value is never ignored.
    env_fails_with(
        &gen(&["--drafter", "ngram"]),
        "DSPARK_DRAFTER_WEIGHTS",
        "q3",
        "DSPARK_DRAFTER_WEIGHTS=q3 is not one of",
    );
    // A FIFO as the model would block the read forever.
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    fails_with(&["generate", "--model", fifo.to_str().unwrap(), "--prompt", "hi"], "not a regular file");
}

#[test]
fn a_closed_pipe_ends_generate_quietly() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let path = model("smollm2-135m");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dspark"))
        .args(["generate", "--model", path.to_str().unwrap(), "--prompt", "Count to 100."])
        .args(["--max-tokens", "64", "--drafter", "none"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap(); // then the pipe closes
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
}
