//! Measures the cost table the hardware-aware policies plan with: one target forward at B new
//! tokens (after a realistic context), and one drafting round for R sequences.

use dspark_drafter_models::BlockModel;
use dspark_drafters::{propose_batch, BatchEntry, BlockSeq};
use dspark_model::{KvCache, Model, SeqInput, TapSpec};
use dspark_sampling::SamplingParams;
use dspark_schedule::CostTable;
use dspark_spec::{append_features, DraftError, Drafter, TargetFeatures};
use std::time::Instant;

/// Verify batch sizes measured (tokens in one forward).
pub const FORWARD_SIZES: [usize; 13] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96];
/// Sequences per drafting round measured.
pub const DRAFT_SIZES: [usize; 6] = [1, 2, 4, 8, 16, 32];
/// Context each measurement runs after, in tokens.
const CONTEXT: usize = 160;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `progress` hears about each size as it is measured.
pub fn profile(
    target: &Model,
    target_name: &str,
    drafter: Option<(&BlockModel, &str)>,
    reps: usize,
    mut progress: impl FnMut(&str),
) -> Result<CostTable, DraftError> {
    let taps = drafter
        .map(|(d, _)| TapSpec { layers: d.config.target_layer_ids.clone(), final_norm: false })
        .unwrap_or_default();
    let (tokens, mut cache, features) = context(target, &taps)?;
    let forward = forward_times(target, &mut cache, &tokens, &FORWARD_SIZES, &taps, reps, &mut progress)?;
    let mut draft = Vec::new();
    if let Some((net, _)) = drafter {
        let greedy = SamplingParams { temperature: 0.0, top_k: None, top_p: None };
        let context = &tokens[..CONTEXT + 1];
        for &r in &DRAFT_SIZES {
            let mut seqs: Vec<BlockSeq> =
                (0..r).map(|i| BlockSeq::new(net, &features, i as u64)).collect::<Result<_, _>>()?;
            let mut times = Vec::new();
            for _ in 0..reps.max(1) {
                let mut entries: Vec<BatchEntry> = seqs.iter_mut().map(|s| (s, context, &greedy)).collect();
                let t = Instant::now();
                propose_batch(net, &mut entries, net.gamma())?;
                times.push(t.elapsed().as_secs_f64());
            }
            let s = median(times);
            progress(&format!("draft   R={r:<3} {:8.2} ms", s * 1e3));
            draft.push((r, s));
        }
    }
    Ok(CostTable {
        model: target_name.to_string(),
        drafter: drafter.map(|(_, n)| n.to_string()),
        threads: dspark_model::pool().current_num_threads(),
        forward,
        draft,
    })
}

/// The single-request table `dspark generate` and `bench decode` plan with: forwards of 1 to
/// γ + 1 tokens and one drafting round of `drafter` (any method, through the [`Drafter`] trait),
/// each after the same realistic context (a drafter that does not draft on its first call is
/// left untimed). A few seconds, where [`profile`] takes a minute.
pub fn profile_one(
    target: &Model,
    target_name: &str,
    drafter: &mut dyn Drafter,
    gamma: usize,
    reps: usize,
    mut progress: impl FnMut(&str),
) -> Result<CostTable, DraftError> {
    let taps = drafter.taps();
    let (tokens, mut cache, features) = context(target, &taps)?;
    let sizes: Vec<usize> = (1..=gamma + 1).collect();
    let forward = forward_times(target, &mut cache, &tokens, &sizes, &taps, reps, &mut progress)?;
    let greedy = SamplingParams { temperature: 0.0, top_k: None, top_p: None };
    let context = &tokens[..CONTEXT + 1];
    drafter.begin(&tokens[..CONTEXT], &features, 0)?;
    let mut times = Vec::new();
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let drafted = !drafter.propose(context, gamma, &greedy)?.is_empty();
        // A drafter that gates itself (`auto` watches plain steps before it drafts) is not
        // timed: its own gate weighs its rounds, and the table calls drafting free.
        if !drafted {
            break;
        }
        times.push(t.elapsed().as_secs_f64());
    }
    let draft = if times.is_empty() {
        progress("draft   R=1   not timed (the drafter did not draft)");
        vec![]
    } else {
        let s = median(times);
        progress(&format!("draft   R=1   {:8.2} ms", s * 1e3));
        vec![(1, s)]
    };
    Ok(CostTable {
        model: target_name.to_string(),
        drafter: Some(drafter.name()),
        threads: dspark_model::pool().current_num_threads(),
        forward,
        draft,
    })
}

/// Pseudo-random tokens, a cache holding the first [`CONTEXT`] of them, and their features.
fn context(target: &Model, taps: &TapSpec) -> Result<(Vec<u32>, KvCache, TargetFeatures), DraftError> {
    let vocab = target.vocab_size() as u32;
    let tokens: Vec<u32> = (0..CONTEXT as u32 + 128).map(|i| (i * 7919 + 13) % vocab.min(20000)).collect();
    let mut cache = target.new_cache(CONTEXT + 128);
    let rows: Vec<usize> = (0..CONTEXT).collect();
    let tap_rows = if taps.layers.is_empty() { Vec::new() } else { rows.clone() };
    let mut pre =
        [SeqInput { cache: &mut cache, tokens: &tokens[..CONTEXT], logit_rows: Vec::new(), tap_rows }];
    let out = target.forward(&mut pre, taps)?.remove(0);
    let mut features = TargetFeatures::default();
    append_features(&mut features, out, CONTEXT, target.config.hidden);
    Ok((tokens, cache, features))
}

/// Median seconds of one forward over each of `sizes` new tokens after the cached context. The
/// sizes take turns within each repetition, so that a drift in the machine's speed (another
/// process, the clock) spreads over all of them instead of bending the curve.
fn forward_times(
    target: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    sizes: &[usize],
    taps: &TapSpec,
    reps: usize,
    progress: &mut impl FnMut(&str),
) -> Result<Vec<(usize, f64)>, DraftError> {
    let mut times = vec![Vec::new(); sizes.len()];
    for _ in 0..reps.max(1) {
        for (&b, t_b) in sizes.iter().zip(&mut times) {
            let block = &tokens[CONTEXT..CONTEXT + b];
            let rows: Vec<usize> = (0..b).collect();
            let tap_rows = if taps.layers.is_empty() { Vec::new() } else { rows.clone() };
            let t = Instant::now();
            let mut seq = [SeqInput { cache: &mut *cache, tokens: block, logit_rows: rows, tap_rows }];
            target.forward(&mut seq, taps)?;
            t_b.push(t.elapsed().as_secs_f64());
            cache.truncate(CONTEXT)?;
        }
    }
    let forward: Vec<(usize, f64)> = sizes.iter().zip(times).map(|(&b, t)| (b, median(t))).collect();
    for &(b, s) in &forward {
        progress(&format!("forward B={b:<3} {:8.2} ms", s * 1e3));
    }
    Ok(forward)
}
