//! `dspark draft-trace`: a drafter's rounds along a fixed decode path, printed for comparison
//! with a reference implementation (the official Python code, the goldens in
//! `data/golden/drafters/`). The path does not depend on verification: round 0 anchors on the
//! target's greedy token after the prompt, and after each round N drafts are accepted whatever
//! the target says, with the target's greedy token at verify slot N as the next anchor. Two
//! implementations that agree on round 0 therefore keep drafting from the same state, even from
//! random weights whose drafts the target would reject.

use anyhow::{bail, Context, Result};
use clap::Args;
use dspark_drafter_models::{ContextCache, DraftTrace, DrafterNet, EagleCache};
use dspark_model::{KvCache, Model, SeqInput, TapSpec};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct TraceArgs {
    /// The target model (name, .gguf file or Hugging Face directory).
    #[arg(long)]
    target: String,
    /// The drafter checkpoint folder (ours or a public DeepSpec / z-lab / SafeAILab one).
    #[arg(long)]
    drafter: PathBuf,
    /// The prompt as token ids, comma-separated (no template is applied).
    #[arg(long, value_delimiter = ',', required = true)]
    prompt_tokens: Vec<u32>,
    /// Drafting rounds to run.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Drafts accepted after each round whatever verification says (at most the drafts per
    /// round).
    #[arg(long)]
    accept: usize,
    /// Drafts per round (default: the drafter's γ; EAGLE-3 chains may be shortened or longer,
    /// a block drafter's only shortened).
    #[arg(long)]
    draft_len: Option<usize>,
    /// Print `{"rounds": [{"draft_tokens", "logits", "confidence_logits"}, ...]}`.
    #[arg(long)]
    json: bool,
}

/// The drafter's state between rounds.
enum State {
    Block(ContextCache),
    Eagle(EagleCache),
}

pub fn run(a: TraceArgs) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let prompt = &a.prompt_tokens;
    if prompt.is_empty() {
        bail!("--prompt-tokens needs at least one token id");
    }
    let target_path = dspark_hub::resolve(&a.target, true)?;
    let target = Arc::new(
        Model::load(&target_path).with_context(|| format!("loading target {}", target_path.display()))?,
    );
    let vocab = target.config.vocab_size;
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!("prompt token {bad} is outside the target's vocabulary of {vocab}");
    }
    let target_name = crate::ModelArg { model: a.target.clone() }.name();
    // f32 throughout (no quantized drafting weights): the point is to compare numbers.
    let net = dspark_drafter_models::load(&a.drafter, target.clone(), &target_name)
        .with_context(|| format!("loading drafter {}", a.drafter.display()))?;
    let gamma = net.config().gamma();
    let n = a.draft_len.unwrap_or(gamma);
    if n == 0 {
        bail!("--draft-len must be at least 1");
    }
    if matches!(net, DrafterNet::Block(_)) && n > gamma {
        bail!("--draft-len {n} exceeds this block drafter's {gamma} drafts per round");
    }
    if a.accept > n {
        bail!("--accept {} exceeds the {n} drafts per round; use at most {n}", a.accept);
    }
    // Each round after the first commits the anchor and N drafts; the last verify block holds
    // the anchor and n drafts.
    let needed = prompt.len() + (a.rounds - 1) * (a.accept + 1) + n + 1;
    if needed > target.config.context_length {
        bail!(
            "the trace needs {needed} positions but the target's context is {}; use a shorter \
             prompt or fewer rounds",
            target.config.context_length
        );
    }
    let taps = TapSpec { layers: net.config().target_layer_ids.clone(), final_norm: false };

    let mut cache = target.new_cache(needed);
    let (logits, features) =
        target_rows(&target, &mut cache, prompt, prompt.len() - 1, 0..prompt.len(), &taps)?;
    let mut anchor = dspark_sampling::argmax(&logits) as u32;
    let mut state = match &net {
        DrafterNet::Block(m) => {
            let mut c = ContextCache::default();
            m.extend(&mut c, &features, prompt.len())?;
            State::Block(c)
        }
        DrafterNet::Eagle3(m) => {
            // EAGLE-3 pairs the feature at position p with the token at p + 1.
            let mut c = EagleCache::default();
            let next: Vec<u32> = prompt[1..].iter().copied().chain([anchor]).collect();
            m.extend(&mut c, &features, prompt.len(), &next)?;
            State::Eagle(c)
        }
    };

    let mut rounds = Vec::with_capacity(a.rounds);
    for r in 0..a.rounds {
        let trace = match (&net, &state) {
            (DrafterNet::Block(m), State::Block(c)) => {
                let hidden = m.block_hidden(&[(c, anchor)])?;
                let raw = m.raw_logits(&hidden)?;
                m.draft(&hidden, &raw, anchor, n, |_, row| Ok(dspark_sampling::argmax(row)))?
            }
            (DrafterNet::Eagle3(m), State::Eagle(c)) => {
                m.draft(c, n, |_, row| Ok(dspark_sampling::argmax(row)))?
            }
            _ => unreachable!("the state is built from the network's kind"),
        };
        let verify: Vec<u32> = std::iter::once(anchor).chain(trace.tokens.iter().copied()).collect();
        rounds.push((anchor, trace));
        if r + 1 == a.rounds {
            break;
        }
        // The target scores the anchor and the drafts; the anchor and the first N drafts stay
        // committed, and the token it predicts after them opens the next round.
        let kept = a.accept + 1;
        let before = cache.len();
        let (logits, features) = target_rows(&target, &mut cache, &verify, a.accept, 0..kept, &taps)?;
        cache.truncate(before + kept)?;
        let next = dspark_sampling::argmax(&logits) as u32;
        match (&net, &mut state) {
            (DrafterNet::Block(m), State::Block(c)) => m.extend(c, &features, kept)?,
            (DrafterNet::Eagle3(m), State::Eagle(c)) => {
                let paired: Vec<u32> = verify[1..kept].iter().copied().chain([next]).collect();
                m.extend(c, &features, kept, &paired)?
            }
            _ => unreachable!("the state is built from the network's kind"),
        }
        anchor = next;
    }

    if a.json {
        let rounds: Vec<serde_json::Value> = rounds.iter().map(|(_, t)| round_json(t)).collect();
        println!("{}", serde_json::json!({ "rounds": rounds }));
    } else {
        for (r, (anchor, t)) in rounds.iter().enumerate() {
            println!("round {r}: anchor {anchor}, drafts {:?}", t.tokens);
            for (k, row) in t.logits.iter().enumerate() {
                let best = dspark_sampling::argmax(row);
                let conf = t
                    .confidence_logits
                    .as_ref()
                    .and_then(|c| c.get(k))
                    .map(|z| format!(", confidence logit {z:.6}"))
                    .unwrap_or_default();
                println!("  draft {k}: draft-vocabulary index {best}, logit {:.6}{conf}", row[best]);
            }
        }
    }
    Ok(())
}

/// One round as `--json` prints it. A drafter without a confidence head gives an empty
/// `confidence_logits`, so that every round has the same shape.
fn round_json(t: &DraftTrace) -> serde_json::Value {
    serde_json::json!({
        "draft_tokens": t.tokens,
        "logits": t.logits,
        "confidence_logits": t.confidence_logits.clone().unwrap_or_default(),
    })
}

/// Runs `tokens` after the cache; returns the logits of row `logit_row` and the taps of
/// `rows`, one `rows × hidden` slice per tapped layer.
fn target_rows(
    target: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    logit_row: usize,
    rows: std::ops::Range<usize>,
    taps: &TapSpec,
) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let seq = SeqInput { cache, tokens, logit_rows: vec![logit_row], tap_rows: rows.collect() };
    let out = target.forward(&mut [seq], taps)?.remove(0);
    Ok((out.logits, out.taps))
}
