//! Training on a tiny random target: gradients reach every trainable tensor, the training
//! forward is the drafting forward, and a resumed run ends where an uninterrupted one does.

use candle_core::Tensor;
use dspark_drafter_models::{BlockLayout, ContextCache, DrafterNet, HeadKind, InitOptions, Method};
use dspark_model::testing::{weights, write_hf, Tiny};
use dspark_model::Model;
use dspark_train::data::Sample;
use dspark_train::trainer::{TrainConfig, Trainer};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn target(dir: &Path) -> Arc<Model> {
    let t = Tiny { family: "qwen2", hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, layers: 3, ffn: 96 };
    write_hf(dir, &t, &weights(&t, 3));
    Arc::new(Model::load(dir).unwrap())
}

fn samples() -> Vec<Sample> {
    (0..6)
        .map(|s| Sample {
            index: s,
            tokens: (0..40u32).map(|i| (i * 7 + s as u32 * 13) % 93).collect(),
            prompt_len: 5 + s,
        })
        .collect()
}

fn opts(method: Method, head: HeadKind, vocab: Option<Vec<u32>>) -> InitOptions {
    InitOptions {
        method,
        layers: 1,
        intermediate: None,
        gamma: 4,
        head,
        rank: 8,
        draft_vocab: vocab,
        target_layers: Some(vec![0, 1]),
        mask_token: Some(93),
        layout: if method == Method::Dflash { BlockLayout::Dflash } else { BlockLayout::Dspark },
        std: 0.1,
        seed: 1,
    }
}

fn cfg(steps: usize) -> TrainConfig {
    TrainConfig {
        steps,
        batch: 2,
        anchors: 3,
        max_len: 32,
        lr: 1e-3,
        checkpoint_every: 2,
        ..Default::default()
    }
}

fn cases() -> Vec<(&'static str, InitOptions)> {
    let reduced: Vec<u32> = (0..96).filter(|i| i % 2 == 0).collect();
    vec![
        ("dspark-markov", opts(Method::Dspark, HeadKind::Markov, None)),
        ("dspark-rnn-reduced", opts(Method::Dspark, HeadKind::Rnn, Some(reduced.clone()))),
        ("dflash", opts(Method::Dflash, HeadKind::Markov, None)),
        ("eagle3-reduced", opts(Method::Eagle3, HeadKind::Markov, Some(reduced))),
    ]
}

#[test]
fn every_trainable_tensor_receives_a_gradient() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path());
    for (name, o) in cases() {
        let init = tempfile::tempdir().unwrap();
        dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(init.path()).unwrap();
        let out = tempfile::tempdir().unwrap();
        let tr = Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(4), out.path(), false).unwrap();
        let (loss, _, positions) = tr.batch_loss(0).unwrap();
        assert!(positions > 0);
        let grads = loss.backward().unwrap();
        assert!(tr.opt.vars.len() >= 10, "{name}: only {} trainable tensors", tr.opt.vars.len());
        for (v, var) in &tr.opt.vars {
            let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient for {v}"));
            let s = g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(s > 0.0 && s.is_finite(), "{name}: gradient of {v} is {s}");
        }
    }
}

/// The first 30 tokens of sample 0, the target's forward over them (taps of layers 0 and 1) and
/// those taps stacked as a drafter's context features.
fn first_30_tokens(t: &Model) -> (Vec<u32>, dspark_model::SeqOutput, Tensor) {
    let tokens = samples()[0].tokens[..30].to_vec();
    let mut cache = t.new_cache(30);
    let seq = dspark_model::SeqInput {
        cache: &mut cache,
        tokens: &tokens,
        logit_rows: vec![],
        tap_rows: (0..30).collect(),
    };
    let out = t
        .forward(&mut [seq], &dspark_model::TapSpec { layers: vec![0, 1], final_norm: false })
        .unwrap()
        .remove(0);
    let feats = dspark_drafter_models::common::stack_taps(&out.taps, 30, 64, 2).unwrap();
    (tokens, out, feats)
}

#[test]
fn the_training_forward_is_the_drafting_forward() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path());
    let o = opts(Method::Dspark, HeadKind::Markov, None);
    let DrafterNet::Block(m) = dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap() else { panic!() };
    let (tokens, out, feats) = first_30_tokens(&t);
    let tokens = &tokens[..];
    let anchors = [7usize, 12, 20];
    let trained = m.train_hidden(&feats, tokens, &anchors).unwrap();
    for (a, &p) in anchors.iter().enumerate() {
        let mut c = ContextCache::default();
        let rows: Vec<Vec<f32>> = out.taps.iter().map(|x| x[..p * 64].to_vec()).collect();
        m.extend(&mut c, &rows, p).unwrap();
        let h = m.block_hidden(&[(&c, tokens[p])]).unwrap();
        let want: Vec<f32> = h.flatten_all().unwrap().to_vec1().unwrap();
        let got: Vec<f32> = trained.narrow(0, a * 4, 4).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let worst = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "anchor {p}: training and drafting hidden states differ by {worst}");
    }
}

fn weights_of(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let mut m: Vec<(String, Tensor)> =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m.into_iter()
        .filter(|(n, _)| n != "d2t")
        .map(|(n, t)| {
            (n, t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect()
}

#[test]
fn a_resumed_run_ends_where_the_uninterrupted_one_does() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path());
    for (name, o) in [cases().remove(1), cases().remove(3)] {
        let init = tempfile::tempdir().unwrap();
        dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(init.path()).unwrap();
        let full = tempfile::tempdir().unwrap();
        let never = AtomicBool::new(false);
        Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(6), full.path(), false)
            .unwrap()
            .run(&never, |_| {})
            .unwrap();
        let cut = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(false);
        let mut tr =
            Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(6), cut.path(), false).unwrap();
        let done = tr
            .run(&stop, |r| {
                if r.step == 3 {
                    stop.store(true, Ordering::SeqCst); // Ctrl-C after step 3 (checkpoint at 2)
                }
            })
            .unwrap();
        assert!(!done);
        drop(tr);
        let mut tr =
            Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(99), cut.path(), true).unwrap();
        assert_eq!(tr.state.step, 3);
        assert!(tr.run(&never, |_| {}).unwrap());
        let (a, b) = (weights_of(full.path()), weights_of(cut.path()));
        assert_eq!(a.len(), b.len());
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-6, "{name}: {n} differs by {worst} after resume");
        }
        let init_w = weights_of(init.path());
        assert!(init_w.iter().zip(&a).any(|((_, x), (_, y))| x != y), "{name}: training changed nothing");
    }
}

#[test]
fn cached_features_train_like_features_computed_on_the_fly() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path());
    let (name, o) = cases().remove(0);
    let init = tempfile::tempdir().unwrap();
    dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(init.path()).unwrap();
    let fdir = tempfile::tempdir().unwrap();
    // Built in two goes (an interruption), with more layers than the drafter reads.
    dspark_train::features::build(&t, &samples()[..2], &[0, 1, 2], 32, fdir.path(), |_, _| {}).unwrap();
    dspark_train::features::build(&t, &samples(), &[0, 1, 2], 32, fdir.path(), |_, _| {}).unwrap();
    let out = tempfile::tempdir().unwrap();
    let mut tr = Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(4), out.path(), false).unwrap();
    let fly = tr.batch_loss(1).unwrap().0.to_scalar::<f32>().unwrap();
    tr.cache = Some(dspark_train::features::FeatureCache::open(fdir.path()).unwrap());
    let cached = tr.batch_loss(1).unwrap().0.to_scalar::<f32>().unwrap();
    assert!((fly - cached).abs() < 2e-3 * fly.abs().max(1.0), "{name}: {fly} vs {cached} (f16 cache)");
    assert!(fly != cached, "the cache should have been used (f16 rounding shows)");
}

/// A kill at every point of a save: resume continues from the new checkpoint when it was
/// committed, else from the previous one, never from a mix, and ends where the uninterrupted
/// run does; nothing the kill left behind survives the resume.
#[test]
fn a_kill_during_a_save_resumes_from_one_whole_checkpoint() {
    use dspark_train::checkpoint;
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path());
    let (_, o) = cases().remove(0);
    let init = tempfile::tempdir().unwrap();
    dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(init.path()).unwrap();
    let never = AtomicBool::new(false);
    let full = tempfile::tempdir().unwrap();
    Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(5), full.path(), false)
        .unwrap()
        .run(&never, |_| {})
        .unwrap();
    let want = weights_of(full.path());
    for stages in 0..=6 {
        let cut = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(false);
        let mut tr =
            Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(5), cut.path(), false).unwrap();
        // Step 2 is checkpointed; the save of step 3 is killed after `stages` stages.
        tr.run(&stop, |r| {
            if r.step == 2 {
                stop.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
        tr.step().unwrap();
        tr.save_stages(stages).unwrap();
        drop(tr);
        let committed = stages >= 4;
        let mut tr =
            Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(5), cut.path(), true).unwrap();
        assert_eq!(tr.state.step, if committed { 3 } else { 2 }, "killed after {stages} stages");
        let left: Vec<String> = std::fs::read_dir(cut.path().join(checkpoint::DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(left.iter().all(|n| n.starts_with("step-")), "temporaries left: {left:?}");
        assert!(tr.run(&never, |_| {}).unwrap());
        let got = weights_of(cut.path());
        for ((n, x), (_, y)) in want.iter().zip(&got) {
            let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-6, "killed after {stages} stages: {n} differs by {worst}");
        }
        assert_eq!(checkpoint::list(cut.path()).unwrap().len(), 1, "old checkpoints are pruned");
    }
    // A checkpoint whose parts come from two saves is refused, not silently resumed.
    let dir = checkpoint::latest(full.path()).unwrap();
    let st = dir.join(checkpoint::STATE);
    let text = std::fs::read_to_string(&st).unwrap().replace("\"step\": 5", "\"step\": 4");
    std::fs::write(&st, text).unwrap();
    let err = Trainer::new(t.clone(), "tiny", init.path(), samples(), cfg(5), full.path(), true)
        .err()
        .expect("a mixed checkpoint is refused")
        .to_string();
    assert!(err.contains("mixes two checkpoints"), "{err}");
}

/// A drafter deepened by `grow` drafts exactly what it did: the new layers' residual branches
/// start at zero. Refusals: no deeper than it is, and never EAGLE-3.
#[test]
fn a_grown_drafter_computes_what_it_grew_from() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path());
    let (tokens, _, feats) = first_30_tokens(&t);
    let tokens = &tokens[..];
    for (name, o) in cases().into_iter().take(3) {
        let dir = tempfile::tempdir().unwrap();
        let (small, big) = (dir.path().join("one"), dir.path().join("three"));
        dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(&small).unwrap();
        dspark_drafter_models::grow(&small, 3, &big).unwrap();
        let hidden = |d: &Path| {
            let DrafterNet::Block(m) = dspark_drafter_models::load(d, t.clone(), "tiny").unwrap() else {
                panic!("{name}: a block drafter")
            };
            assert_eq!(m.config.num_hidden_layers, if d == small { 1 } else { 3 }, "{name}");
            m.train_hidden(&feats, tokens, &[7, 12, 20])
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(hidden(&small), hidden(&big), "{name}: the grown drafter computes something else");
        let again = dir.path().join("again");
        let err = dspark_drafter_models::grow(&big, 3, &again).unwrap_err().to_string();
        assert!(err.contains("already"), "{err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let (_, eagle) = cases().pop().unwrap();
    dspark_drafter_models::init(t.clone(), "tiny", &eagle).unwrap().save(dir.path()).unwrap();
    let err = dspark_drafter_models::grow(dir.path(), 2, &dir.path().join("g")).unwrap_err().to_string();
    assert!(err.contains("EAGLE-3"), "{err}");
}

/// `ce_weight` scales DSpark's cross-entropy term alone: the loss is linear in it with a
/// positive slope (the cross-entropy), the paper's 0.1 is the default, and a run saved before
/// the field existed reads back with the paper's mix.
#[test]
fn the_cross_entropy_weight_moves_only_the_cross_entropy_term() {
    let tdir = tempfile::tempdir().unwrap();
    let t = target(tdir.path());
    let (_, o) = cases().remove(0);
    let init = tempfile::tempdir().unwrap();
    dspark_drafter_models::init(t.clone(), "tiny", &o).unwrap().save(init.path()).unwrap();
    let loss_at = |w: Option<f64>| {
        let out = tempfile::tempdir().unwrap();
        let c = TrainConfig { ce_weight: w, ..cfg(4) };
        let tr = Trainer::new(t.clone(), "tiny", init.path(), samples(), c, out.path(), false).unwrap();
        tr.batch_loss(1).unwrap().0.to_scalar::<f32>().unwrap() as f64
    };
    let (paper, w01, w11, w21) = (loss_at(None), loss_at(Some(0.1)), loss_at(Some(1.1)), loss_at(Some(2.1)));
    assert!((paper - w01).abs() < 1e-6, "default {paper} vs 0.1 {w01}");
    let (d1, d2) = (w11 - w01, w21 - w11);
    assert!(d1 > 0.1, "one unit of cross-entropy weight added {d1}");
    assert!((d1 - d2).abs() < 1e-4 * d1, "not linear: {d1} then {d2}");
    let mut old = serde_json::to_value(cfg(4)).unwrap();
    assert!(old.get("ce_weight").is_none(), "an unset weight is not written");
    old.as_object_mut().unwrap().remove("ce_weight");
    let back: TrainConfig = serde_json::from_value(old).unwrap();
    assert_eq!(back.ce_weight, None);
}
