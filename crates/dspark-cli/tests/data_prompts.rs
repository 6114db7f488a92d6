//! `dspark data prompts --from FILE --append`: more prompts join a training prompt file after
//! the ones already there (whose indices answers and feature caches depend on), with the same
//! benchmark filter as ShareGPT's prompts.

mod common;
use common::{bench_prompts, dspark};

fn prompts_of(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt"].as_str().unwrap().to_string()
        })
        .collect()
}

fn write_prompts(path: &std::path::Path, prompts: &[&str]) {
    let lines: Vec<String> = prompts.iter().map(|p| serde_json::json!({ "prompt": p }).to_string()).collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn appended_prompts_follow_the_existing_ones_without_duplicates_or_benchmark_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let (out, from) = (dir.path().join("train.jsonl"), dir.path().join("more.jsonl"));
    let existing = ["Write a Rust function that reverses a linked list.", "How do I read a CSV file in Go?"];
    write_prompts(&out, &existing);
    // A last line without its newline (an editor's save) must not swallow the first new prompt.
    let text = std::fs::read_to_string(&out).unwrap();
    std::fs::write(&out, text.trim_end()).unwrap();
    let mbpp = bench_prompts("mbpp-test.jsonl", "text", 1).remove(0);
    let new = [
        "Implement `heapify(x)` in Python. Transform list into a heap, in-place, in O(len(x)) time.",
        // The same as an existing prompt up to case and spacing: not added again.
        "write a rust function that   reverses a linked list.",
        &mbpp,
        "Write a Python class `Counter` that counts hashable items and reports the most common.",
    ];
    write_prompts(&from, &new);
    let append = || {
        let run = dspark(&[
            "data",
            "prompts",
            "--from",
            from.to_str().unwrap(),
            "--append",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    };
    append();
    let got = prompts_of(&out);
    assert_eq!(got[..2], existing.map(String::from), "the existing prompts keep their places");
    let mut added = got[2..].to_vec();
    added.sort();
    let mut want = vec![new[0].to_string(), new[3].to_string()];
    want.sort();
    assert_eq!(added, want, "only the two new, non-benchmark prompts are appended");

    // Appending the same candidates again adds nothing.
    append();
    assert_eq!(prompts_of(&out).len(), 4);
}

#[test]
fn a_candidate_file_without_prompts_is_refused_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let from = dir.path().join("bad.jsonl");
    std::fs::write(&from, "{\"prompt\": \"fine\"}\n{\"answer\": 3}\n").unwrap();
    let out = dir.path().join("out.jsonl");
    let run = dspark(&["data", "prompts", "--from", from.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("line 2") && err.contains("prompt"), "{err}");
    assert!(!out.exists(), "nothing is written from a bad candidate file");
}
