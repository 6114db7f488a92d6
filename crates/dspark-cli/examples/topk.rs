//! Prints our top-5 logits next to the golden ones, teacher-forced on the golden continuation.
use dspark_model::{Model, SeqInput, TapSpec};
fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let model = Model::load(std::path::Path::new(&a[1]))?;
    let (mut sum_err, mut n_err, mut agree, mut total) = (0f64, 0usize, 0usize, 0usize);
    for line in std::fs::read_to_string(&a[2])?.lines() {
        let g: serde_json::Value = serde_json::from_str(line)?;
        let p: Vec<u32> = serde_json::from_value(g["prompt_tokens"].clone())?;
        let gt: Vec<u32> = serde_json::from_value(g["greedy_tokens"].clone())?;
        let mut all = p.clone();
        all.extend(&gt);
        let mut cache = model.new_cache(all.len());
        let mut seq = [SeqInput::logits_all(&mut cache, &all)];
        let out = model.forward(&mut seq, &TapSpec::default())?.remove(0);
        let v = model.vocab_size();
        for i in 0..gt.len() {
            let row = out.logits_row(p.len() - 1 + i, v);
            let mut idx: Vec<usize> = (0..v).collect();
            idx.sort_by(|&x, &y| row[y].total_cmp(&row[x]));
            let ours: Vec<(usize, f32)> = idx[..3].iter().map(|&j| (j, row[j])).collect();
            let gold = &g["top5_logits"][i];
            for e in gold.as_array().unwrap() {
                let (t, lv) = (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap() as f32);
                sum_err += (row[t] - lv).abs() as f64;
                n_err += 1;
            }
            agree += (ours[0].0 as u64 == gold[0][0].as_u64().unwrap()) as usize;
            total += 1;
            let flag = if ours[0].0 as u64 != gold[0][0].as_u64().unwrap() { "  <-- DIFF" } else { "" };
            println!(
                "{i:>3} ours {:?} gold {} {}",
                ours,
                gold.to_string().chars().take(70).collect::<String>(),
                flag
            );
        }
        println!();
    }
    println!("mean |logit - llama.cpp| {:.4}  top-1 agreement {}/{}", sum_err / n_err as f64, agree, total);
    Ok(())
}
