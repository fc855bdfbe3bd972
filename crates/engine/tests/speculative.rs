//! Speculative decoding gives the output of plain decoding: greedy tokens
//! and logits bit for bit for every drafter, draft length and slot count;
//! sampled tokens draw for draw, so their distribution is the model's (a
//! chi-square test against the exact probabilities); a rolled-back state is
//! the state of the shorter pass; the governor turns a useless drafter off.

use std::path::{Path, PathBuf};

use slipstream_engine::{
    Drafter, Engine, GenerateRequest, Generation, SamplingParams, SpeculateMode, Speculation,
    StoreChoice,
};
use slipstream_models::Logits;
use slipstream_repack::QuantChoice;
use slipstream_testkit::{
    load_resident, open, repacked, repetitive_prompt, same_bits, small_hybrid_model, streaming,
};

/// The small hybrid test model with one MTP layer (hidden 128).
fn synthetic_mtp_model(dir: &Path) -> PathBuf {
    small_hybrid_model(dir, "synth-mtp.slip", 128, 1, 5)
}

fn speculation(mode: SpeculateMode, k: usize, auto_off: bool) -> Speculation {
    Speculation {
        mode,
        draft_tokens: k,
        auto_off,
    }
}

fn run(engine: &mut Engine, req: &GenerateRequest) -> Generation {
    engine
        .generate(req, &mut |_| true)
        .unwrap_or_else(|e| panic!("generation: {e}"))
}

/// Drafts, accepted drafts and verify passes of one mode, summed.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    drafted: u64,
    accepted: u64,
    verify_passes: u64,
}

/// Every mode and k = 1..=8 at each store, against plain greedy decoding
/// at the resident store; returns the totals of mtp, lookup and both.
fn check_greedy_identity(
    model: &Path,
    stores: &[(&str, StoreChoice)],
    max_new: usize,
) -> [Totals; 3] {
    let prompt = repetitive_prompt();
    let req = GenerateRequest::new(prompt, max_new).keeping_logits();
    let plain = run(&mut open(model, StoreChoice::Resident, 4096), &req);
    assert_eq!(plain.tokens.len(), max_new);
    assert!(plain.stats.speculation.is_none());
    let mut totals = [Totals::default(); 3];
    for (name, store) in stores {
        let mut engine = open(model, store.clone(), 4096);
        let modes = [
            SpeculateMode::Mtp,
            SpeculateMode::Lookup,
            SpeculateMode::Both,
        ];
        for (mode, total) in modes.into_iter().zip(totals.iter_mut()) {
            for k in 1..=8 {
                engine.set_speculation(speculation(mode, k, false)).unwrap();
                let g = run(&mut engine, &req);
                let what = format!("{name} {} k {k}", mode.name());
                assert_eq!(g.tokens, plain.tokens, "{what}: tokens differ");
                assert!(same_bits(&g.logits, &plain.logits), "{what}: logits differ");
                let s = g.stats.speculation.expect("speculation stats");
                assert!(s.drafted >= s.accepted, "{what}");
                assert!(s.turned_off.is_none(), "{what}: the governor is off");
                total.drafted += s.drafted;
                total.accepted += s.accepted;
                total.verify_passes += s.verify_passes;
            }
        }
    }
    totals
}

#[test]
fn greedy_with_speculation_is_bit_identical_on_a_synthetic_mtp_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = synthetic_mtp_model(tmp.path());
    let stores = [
        ("resident", StoreChoice::Resident),
        // Fewer slots than the 4 experts a token routes to, and a few more.
        ("slots 2", streaming(2)),
        ("slots 7", streaming(7)),
    ];
    let totals = check_greedy_identity(&model, &stores, 20);
    // Every drafter ran verify passes; lookup both hit and missed.
    assert!(totals.iter().all(|t| t.verify_passes > 0), "{totals:?}");
    let lookup = totals[1];
    assert!(
        lookup.accepted > 0 && lookup.accepted < lookup.drafted,
        "{lookup:?}"
    );
}

#[test]
fn greedy_with_speculation_is_bit_identical_on_the_mtp_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_mtp", QuantChoice::F32, tmp.path());
    let stores = [
        ("resident", StoreChoice::Resident),
        ("slots 1", streaming(1)),
        ("slots 3", streaming(3)),
    ];
    let totals = check_greedy_identity(&model, &stores, 16);
    // The MTP head drafts at every step (the fixture's text gives prompt
    // lookup few matches).
    assert!(
        totals[0].verify_passes > 0 && totals[2].verify_passes > 0,
        "{totals:?}"
    );
}

#[test]
fn a_rolled_back_verify_pass_is_the_shorter_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let model_path = synthetic_mtp_model(tmp.path());
    let mut engine = open(&model_path, StoreChoice::Resident, 4096);
    let prompt = repetitive_prompt();
    let mut base = engine.new_state();
    engine
        .prefill(&mut base, &prompt, Logits::Last)
        .expect("prefill");
    let pass = [11u32, 22, 33, 44, 55, 66];
    let m = engine.model.clone();
    let mut store = load_resident(&model_path).store;
    for keep in 1..=pass.len() {
        let mut verified = base.clone();
        let v = m
            .forward_verify(&mut verified, &pass, &mut store, true, None)
            .unwrap();
        verified.rollback(&v.trail, keep).unwrap();
        let mut plain = base.clone();
        let logits = m
            .forward(&mut plain, &pass[..keep], &mut store, Logits::All, None)
            .unwrap();
        plain.last_logits.clear();
        verified.last_logits.clear();
        assert_eq!(verified, plain, "keep {keep}: states differ");
        assert!(
            same_bits(&v.logits[..logits.len()], &logits),
            "keep {keep}: logits"
        );
        // The next token from either state: the same bits.
        let a = m
            .forward(&mut verified, &[77], &mut store, Logits::Last, None)
            .unwrap();
        let b = m
            .forward(&mut plain, &[77], &mut store, Logits::Last, None)
            .unwrap();
        assert!(same_bits(&a, &b), "keep {keep}: the step after differs");
    }
    // A rollback the trail cannot serve is an error, not a panic.
    let mut s = base.clone();
    let v = m
        .forward_verify(&mut s, &pass, &mut store, false, None)
        .unwrap();
    assert!(s.rollback(&v.trail, 0).is_err());
    assert!(s.rollback(&v.trail, pass.len() + 1).is_err());
    assert!(base.clone().rollback(&v.trail, 2).is_err());
}

/// Drafts from a table: history's last token -> drafts.
struct TableDrafter(std::collections::HashMap<u32, Vec<u32>>);

impl Drafter for TableDrafter {
    fn draft(&mut self, history: &[u32], k: usize) -> Vec<u32> {
        let mut d = self
            .0
            .get(history.last().unwrap())
            .cloned()
            .unwrap_or_default();
        d.truncate(k);
        d
    }
}

/// The top `n` ids of a row, most likely first, and their probabilities
/// at temperature 1 renormalised over those `n` (top-k sampling).
fn top_probs(row: &[f32], n: usize) -> Vec<(u32, f64)> {
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    ids.truncate(n);
    let max = row[ids[0] as usize] as f64;
    let w: Vec<f64> = ids
        .iter()
        .map(|&i| (row[i as usize] as f64 - max).exp())
        .collect();
    let total: f64 = w.iter().sum();
    ids.into_iter()
        .zip(w.into_iter().map(|x| x / total))
        .collect()
}

#[test]
fn sampled_output_keeps_the_model_distribution() {
    const TOP_K: usize = 3;
    const RUNS: u64 = 1200;
    let tmp = tempfile::tempdir().unwrap();
    let model = synthetic_mtp_model(tmp.path());
    let prompt: Vec<u32> = vec![5, 17, 301, 42, 9, 77];
    let mut engine = open(&model, StoreChoice::Resident, 4096);
    // The exact joint distribution of the first two sampled tokens.
    let first = run(
        &mut engine,
        &GenerateRequest::new(prompt.clone(), 1).keeping_logits(),
    );
    let vocab = engine.model_config().vocab_size;
    let row1 = &first.logits[(prompt.len() - 1) * vocab..];
    let mut expected = Vec::new();
    let mut table = std::collections::HashMap::new();
    for (t1, p1) in top_probs(row1, TOP_K) {
        let mut p = prompt.clone();
        p.push(t1);
        let g = run(
            &mut engine,
            &GenerateRequest::new(p.clone(), 1).keeping_logits(),
        );
        let second = top_probs(&g.logits[(p.len() - 1) * vocab..], TOP_K);
        // Draft the second most likely token (accepted about a third of
        // the time), then an arbitrary one.
        table.insert(t1, vec![second[1].0, second[0].0]);
        for (t2, p2) in second {
            expected.push(((t1, t2), p1 * p2));
        }
    }
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        top_k: TOP_K,
        seed,
        ..Default::default()
    };
    let mut plain = open(&model, StoreChoice::Resident, 4096);
    engine.set_drafter(Some(Box::new(TableDrafter(table))));
    engine
        .set_speculation(speculation(SpeculateMode::Custom, 2, false))
        .unwrap();
    let mut counts = std::collections::HashMap::new();
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..RUNS {
        let req = GenerateRequest::new(prompt.clone(), 3).with_sampling(sampling(seed));
        let g = run(&mut engine, &req);
        let s = g.stats.speculation.unwrap();
        drafted += s.drafted;
        accepted += s.accepted;
        if seed < 100 {
            // Draw for draw: the same tokens as plain sampling.
            assert_eq!(g.tokens, run(&mut plain, &req).tokens, "seed {seed}");
        }
        *counts.entry((g.tokens[0], g.tokens[1])).or_insert(0u64) += 1;
    }
    assert!(
        accepted > 0 && accepted < drafted,
        "{accepted} of {drafted}"
    );
    let outside: u64 = counts
        .iter()
        .filter(|(k, _)| !expected.iter().any(|(e, _)| e == *k))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(outside, 0, "tokens outside the top-{TOP_K} sets");
    let chi2: f64 = expected
        .iter()
        .map(|(pair, p)| {
            let e = p * RUNS as f64;
            let o = *counts.get(pair).unwrap_or(&0) as f64;
            (o - e).powi(2) / e
        })
        .sum();
    // 8 degrees of freedom: 26.12 is the 0.1 % tail. Seeds are fixed, so
    // the statistic is the same on every run.
    assert!(chi2 < 26.12, "chi-square {chi2:.2} over {RUNS} runs");
}

/// Always wrong: drafts the token after the one greedy decoding picks.
struct WrongDrafter {
    greedy: Vec<u32>,
    prompt_len: usize,
    vocab: u32,
}

impl Drafter for WrongDrafter {
    fn draft(&mut self, history: &[u32], k: usize) -> Vec<u32> {
        let at = history.len() - self.prompt_len;
        self.greedy
            .iter()
            .skip(at)
            .take(k)
            .map(|t| (t + 1) % self.vocab)
            .collect()
    }
}

#[test]
fn the_governor_turns_a_useless_drafter_off() {
    let tmp = tempfile::tempdir().unwrap();
    let model = synthetic_mtp_model(tmp.path());
    let prompt = repetitive_prompt();
    let mut engine = open(&model, StoreChoice::Resident, 4096);
    let req = GenerateRequest::new(prompt.clone(), 40).keeping_logits();
    let plain = run(&mut engine, &req);
    engine.set_drafter(Some(Box::new(WrongDrafter {
        greedy: plain.tokens.clone(),
        prompt_len: prompt.len(),
        vocab: engine.model_config().vocab_size as u32,
    })));
    engine
        .set_speculation(speculation(SpeculateMode::Custom, 3, true))
        .unwrap();
    let g = run(&mut engine, &req);
    assert_eq!(g.tokens, plain.tokens);
    assert!(same_bits(&g.logits, &plain.logits));
    let s = g.stats.speculation.unwrap();
    assert_eq!(s.accepted, 0);
    assert!(s.drafted > 0);
    let why = s.turned_off.expect("turned off");
    assert!(why.contains("acceptance"), "{why}");
    assert!(s.off_at_end);
    // 2 plain steps timed, 2 verify passes accepting nothing, off; 32
    // plain steps, a probe of 2 verify passes, off again; 1 plain step.
    assert_eq!(s.verify_passes, 4);
    // Without the governor it keeps verifying every step.
    engine
        .set_speculation(speculation(SpeculateMode::Custom, 3, false))
        .unwrap();
    let g = run(&mut engine, &req);
    assert_eq!(g.tokens, plain.tokens);
    let s = g.stats.speculation.unwrap();
    assert!(s.turned_off.is_none() && s.verify_passes >= 30);
}

#[test]
fn mtp_speculation_needs_a_head_and_k_in_range() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::F32, tmp.path());
    let mut engine = open(&model, StoreChoice::Resident, 4096);
    for mode in [SpeculateMode::Mtp, SpeculateMode::Both] {
        let e = engine
            .set_speculation(speculation(mode, 4, true))
            .unwrap_err();
        assert!(e.to_string().contains("MTP head"), "{e}");
    }
    for k in [0, 17] {
        assert!(engine
            .set_speculation(speculation(SpeculateMode::Lookup, k, true))
            .is_err());
    }
    engine
        .set_speculation(speculation(SpeculateMode::Custom, 2, true))
        .unwrap();
    let e = engine
        .generate(&GenerateRequest::new(vec![1, 2, 3], 4), &mut |_| true)
        .unwrap_err();
    assert!(e.to_string().contains("drafter"), "{e}");
}
