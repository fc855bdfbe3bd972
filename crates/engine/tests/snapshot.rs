//! Snapshots and the prompt cache: a restored state gives tokens and logits
//! bit-identical to a fresh run; a snapshot that cannot be used (other
//! model, version, corruption, truncation, interrupted write) is a clean
//! fallback to a fresh prefill.

use std::path::Path;
use std::sync::{Arc, Mutex};

use slipstream_engine::snapshot::{write_snapshot, SnapshotError};
use slipstream_engine::{Engine, GenerateRequest, PromptCache, RestoreOutcome, StoreChoice};
use slipstream_models::Logits;
use slipstream_repack::QuantChoice;
use slipstream_testkit::{open as engine, prompt, repacked, same_bits, sampled, streaming};

/// The fixtures of both architectures: hybrid (Gated DeltaNet) at q4 and
/// pure attention at f32.
const ARCHITECTURES: [(&str, QuantChoice); 2] = [
    ("qwen3_5_moe_fused", QuantChoice::Q4),
    ("qwen3_moe", QuantChoice::F32),
];

/// The sampled request every run here makes.
fn request(prompt: Vec<u32>) -> GenerateRequest {
    sampled(prompt, 10, 7)
}

/// Fresh run: tokens, logits rows (prompt rows then decode rows) and the
/// vocabulary size.
fn fresh(model: &Path, prompt: Vec<u32>) -> (Vec<u32>, Vec<f32>, usize) {
    let mut e = engine(model, StoreChoice::Resident, 4096);
    let g = e.generate(&request(prompt), &mut |_| true).unwrap();
    (g.tokens, g.logits, e.model_config().vocab_size)
}

/// Prefills `tokens` and writes a snapshot to `path`.
fn snapshot_of(model: &Path, store: StoreChoice, tokens: &[u32], path: &Path) {
    let mut e = engine(model, store, 4096);
    let mut st = e.new_state();
    e.prefill(&mut st, tokens, Logits::None).unwrap();
    let n = e.save_snapshot(path, &st).unwrap();
    assert_eq!(n, std::fs::metadata(path).unwrap().len());
}

#[test]
fn restore_equals_fresh_run_bit_for_bit_on_both_architectures() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, quant) in ARCHITECTURES {
        let model = repacked(name, quant, tmp.path());
        let p = prompt();
        let (tokens, logits, vocab) = fresh(&model, p.clone());
        let snap = tmp.path().join(format!("{name}.snap"));
        snapshot_of(&model, streaming(3), &p, &snap);
        for (store, warm) in [
            (streaming(3), true),
            (streaming(3), false),
            (streaming(1), true),
            (StoreChoice::Resident, true),
        ] {
            let mut e = engine(&model, store, 4096);
            let (mut st, outcome) = e.restore_for_prompt(&snap, &p, warm);
            match &outcome {
                RestoreOutcome::Restored { tokens, warmed } => {
                    assert_eq!(*tokens, p.len());
                    assert_eq!(warmed.is_some(), warm);
                }
                other => panic!("{name}: not restored: {other:?}"),
            }
            // The snapshot's logits are the fresh run's last prompt row.
            assert!(same_bits(
                &st.last_logits,
                &logits[(p.len() - 1) * vocab..p.len() * vocab]
            ));
            let g = e
                .generate_with_state(&mut st, &request(p.clone()), &mut |_| true)
                .unwrap();
            assert_eq!(g.stats.reused_prompt_tokens, p.len());
            assert_eq!(g.tokens, tokens, "{name}: tokens differ after restore");
            assert!(
                same_bits(&g.logits, &logits[p.len() * vocab..]),
                "{name}: decode logits differ after restore"
            );
        }
    }
}

#[test]
fn warming_fills_the_slots_the_snapshot_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let p = prompt();
    let snap = tmp.path().join("w.snap");
    snapshot_of(&model, streaming(3), &p, &snap);
    let recorded = {
        let e = engine(&model, streaming(3), 4096);
        e.load_snapshot(&snap).unwrap().resident
    };
    assert!(recorded.iter().all(|l| l.len() == 3));
    let mut e = engine(&model, streaming(3), 4096);
    let (_, outcome) = e.restore_for_prompt(&snap, &p, true);
    let RestoreOutcome::Restored {
        warmed: Some(w), ..
    } = outcome
    else {
        panic!("not warmed: {outcome:?}")
    };
    assert_eq!(w.experts, 3 * recorded.len());
    assert_eq!(w.misses, w.experts as u64);
    let mut now = e.resident_experts();
    let mut want = recorded.clone();
    for l in now.iter_mut().chain(want.iter_mut()) {
        l.sort_unstable();
    }
    assert_eq!(now, want);
    // Warming into fewer slots keeps the first ones listed.
    let mut small = engine(&model, streaming(1), 4096);
    let r = small.warm_experts(&recorded).unwrap();
    assert_eq!(r.experts, recorded.len());
    assert!(small.resident_experts().iter().all(|l| l.len() == 1));
}

#[test]
fn prefix_extend_restores_and_prefills_only_the_suffix() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, quant) in ARCHITECTURES {
        let model = repacked(name, quant, tmp.path());
        let p = prompt();
        let (tokens, logits, vocab) = fresh(&model, p.clone());
        let snap = tmp.path().join(format!("{name}-13.snap"));
        snapshot_of(&model, StoreChoice::Resident, &p[..13], &snap);
        let mut e = engine(&model, streaming(2), 4);
        let (mut st, outcome) = e.restore_for_prompt(&snap, &p, true);
        assert!(matches!(
            outcome,
            RestoreOutcome::Restored { tokens: 13, .. }
        ));
        let g = e
            .generate_with_state(&mut st, &request(p.clone()), &mut |_| true)
            .unwrap();
        assert_eq!(g.stats.reused_prompt_tokens, 13);
        assert_eq!(g.tokens, tokens, "{name}");
        assert!(same_bits(&g.logits, &logits[13 * vocab..]), "{name}");
        // A snapshot of a different prompt is not used.
        let other: Vec<u32> = p.iter().map(|t| (t + 1) % 500).collect();
        let (st, outcome) = e.restore_for_prompt(&snap, &other, true);
        assert!(matches!(
            outcome,
            RestoreOutcome::DifferentPrompt { tokens: 13 }
        ));
        assert!(st.tokens.is_empty());
    }
}

fn cache_hook(cache: Arc<Mutex<PromptCache>>) -> slipstream_engine::PrefillHook {
    Box::new(move |cp| {
        cache.lock().unwrap().insert(cp.state, cp.resident).unwrap();
    })
}

#[test]
fn prompt_cache_restores_the_longest_shared_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let dir = tmp.path().join("pc");
    let p1 = prompt();
    let mut p2 = p1[..17].to_vec();
    p2.extend([5, 6, 7, 8, 9, 10]);
    let (tokens2, logits2, vocab) = fresh(&model, p2.clone());

    let mut e = engine(&model, streaming(4), 5);
    let cache = Arc::new(Mutex::new(e.open_prompt_cache(&dir, 1 << 30).unwrap()));
    e.set_prefill_hook(Some(cache_hook(cache.clone())));
    e.generate(&request(p1.clone()), &mut |_| true).unwrap();
    let mut lens: Vec<usize> = cache
        .lock()
        .unwrap()
        .entries()
        .iter()
        .map(|e| e.tokens)
        .collect();
    lens.sort_unstable();
    assert_eq!(lens, vec![5, 10, 15, 20, 23]);

    // A new engine (a new process) shares 17 tokens: the 15-token entry.
    let mut e = engine(&model, streaming(4), 5);
    let cache = e.open_prompt_cache(&dir, 1 << 30).unwrap();
    let snap = cache.lookup(&p2).expect("a cached prefix");
    assert_eq!(snap.state.tokens, p2[..15]);
    e.warm_experts(&snap.resident).unwrap();
    let mut st = snap.state;
    let g = e
        .generate_with_state(&mut st, &request(p2.clone()), &mut |_| true)
        .unwrap();
    assert_eq!(g.stats.reused_prompt_tokens, 15);
    assert_eq!(g.tokens, tokens2);
    assert!(same_bits(&g.logits, &logits2[15 * vocab..]));
    // The whole first prompt is cached: no prefill at all.
    let snap = cache.lookup(&p1).unwrap();
    assert_eq!(snap.state.tokens, p1);
    // No shared prefix: nothing.
    assert!(cache.lookup(&[499, 498, 497, 496, 495, 494]).is_none());
}

#[test]
fn prompt_cache_evicts_least_recently_used_by_size() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    let mut e = engine(&model, StoreChoice::Resident, 4096);
    let states: Vec<_> = [(0u32, 6usize), (100, 6), (200, 6)]
        .iter()
        .map(|&(base, n)| {
            let toks: Vec<u32> = (0..n as u32).map(|i| base + i).collect();
            let mut st = e.new_state();
            e.prefill(&mut st, &toks, Logits::None).unwrap();
            st
        })
        .collect();
    let dir = tmp.path().join("lru");
    let probe = e.open_prompt_cache(&dir, 1 << 30).unwrap();
    let one = probe.insert(&states[0], &[]).unwrap();
    assert!(one > 0);
    std::fs::remove_dir_all(&dir).unwrap();
    // Room for two entries.
    let cache = e.open_prompt_cache(&dir, one * 2 + one / 2).unwrap();
    cache.insert(&states[0], &[]).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    cache.insert(&states[1], &[]).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    // Using the first makes the second the least recently used.
    assert!(cache.lookup(&states[0].tokens).is_some());
    std::thread::sleep(std::time::Duration::from_millis(20));
    cache.insert(&states[2], &[]).unwrap();
    assert!(cache.total_bytes() <= cache.max_bytes());
    assert!(cache.lookup(&states[0].tokens).is_some());
    assert!(cache.lookup(&states[1].tokens).is_none(), "LRU entry kept");
    assert!(cache.lookup(&states[2].tokens).is_some());
    // An entry larger than the whole cache is not stored.
    let tiny = e.open_prompt_cache(&tmp.path().join("tiny"), 100).unwrap();
    assert_eq!(tiny.insert(&states[0], &[]).unwrap(), 0);
    assert!(tiny.entries().is_empty());
}

/// Generates with whatever `restore_for_prompt` gives and checks the output
/// is the fresh run's.
fn falls_back_cleanly(model: &Path, snap: &Path, what: &str) {
    let p = prompt();
    let (tokens, logits, _) = fresh(model, p.clone());
    let mut e = engine(model, streaming(2), 4096);
    let (mut st, outcome) = e.restore_for_prompt(snap, &p, true);
    assert!(
        matches!(outcome, RestoreOutcome::Rejected(_)),
        "{what}: accepted: {outcome:?}"
    );
    assert!(st.tokens.is_empty());
    let g = e
        .generate_with_state(&mut st, &request(p), &mut |_| true)
        .unwrap();
    assert_eq!(g.stats.reused_prompt_tokens, 0);
    assert_eq!(g.tokens, tokens, "{what}");
    assert!(same_bits(&g.logits, &logits), "{what}");
}

fn rejected(e: &Engine, path: &Path) -> SnapshotError {
    e.load_snapshot(path).expect_err("accepted a bad snapshot")
}

#[test]
fn every_mismatch_and_corruption_falls_back_to_a_fresh_prefill() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let other = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    let p = prompt();
    let good = tmp.path().join("good.snap");
    snapshot_of(&model, streaming(2), &p, &good);
    let bytes = std::fs::read(&good).unwrap();
    let e = engine(&model, StoreChoice::Resident, 4096);
    e.load_snapshot(&good).unwrap();

    let write = |name: &str, b: &[u8]| {
        let path = tmp.path().join(name);
        std::fs::write(&path, b).unwrap();
        path
    };

    // Another model's snapshot.
    let foreign = tmp.path().join("foreign.snap");
    snapshot_of(&other, StoreChoice::Resident, &p, &foreign);
    assert!(matches!(
        rejected(&e, &foreign),
        SnapshotError::OtherModel { .. }
    ));
    falls_back_cleanly(&model, &foreign, "other model");

    // Another model's state under this model's hash: shapes are checked.
    let shaped = tmp.path().join("shaped.snap");
    {
        let o = engine(&other, StoreChoice::Resident, 4096);
        let mut st = o.new_state();
        let mut o = o;
        o.prefill(&mut st, &p, Logits::None).unwrap();
        write_snapshot(&shaped, e.model_hash(), &st, &o.resident_experts()).unwrap();
    }
    assert!(matches!(rejected(&e, &shaped), SnapshotError::Shape(_)));
    falls_back_cleanly(&model, &shaped, "wrong shapes");

    // A bumped version.
    let mut b = bytes.clone();
    b[8] += 1;
    let path = write("version.snap", &b);
    assert!(matches!(rejected(&e, &path), SnapshotError::Version { .. }));
    falls_back_cleanly(&model, &path, "version");

    // A flipped byte anywhere in the payload (and in the header's checksum).
    for at in [40, bytes.len() / 3, bytes.len() / 2, bytes.len() - 1, 27] {
        let mut b = bytes.clone();
        b[at] ^= 0x10;
        let path = write(&format!("flip{at}.snap"), &b);
        let err = rejected(&e, &path);
        assert!(
            matches!(
                err,
                SnapshotError::Checksum
                    | SnapshotError::Shape(_)
                    | SnapshotError::Truncated(_)
                    | SnapshotError::OtherModel { .. }
            ),
            "flip at {at}: {err}"
        );
        falls_back_cleanly(&model, &path, &format!("flip at {at}"));
    }

    // Truncated at several points, including inside the header.
    for len in [0, 5, 31, 32, 40, bytes.len() / 2, bytes.len() - 1] {
        let path = write(&format!("trunc{len}.snap"), &bytes[..len]);
        assert!(matches!(rejected(&e, &path), SnapshotError::Truncated(_)));
        falls_back_cleanly(&model, &path, &format!("truncated to {len}"));
    }
    // Padded.
    let mut b = bytes.clone();
    b.extend_from_slice(&[0; 7]);
    let path = write("padded.snap", &b);
    assert!(matches!(rejected(&e, &path), SnapshotError::Truncated(_)));

    // Garbage, with and without a valid header in front.
    let garbage: Vec<u8> = (0..5000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let path = write("garbage.snap", &garbage);
    assert!(matches!(rejected(&e, &path), SnapshotError::NotASnapshot));
    falls_back_cleanly(&model, &path, "garbage");
    let mut b = bytes[..32].to_vec();
    b[16..24].copy_from_slice(&(garbage.len() as u64).to_le_bytes());
    b.extend_from_slice(&garbage);
    let path = write("garbage-payload.snap", &b);
    rejected(&e, &path);
    falls_back_cleanly(&model, &path, "garbage payload");
    // Huge lengths inside a payload whose header length matches the file.
    let mut b = bytes.clone();
    let hash_len = u32::from_le_bytes(b[32..36].try_into().unwrap()) as usize;
    let tok_at = 32 + 4 + hash_len + 4;
    b[tok_at..tok_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let path = write("huge.snap", &b);
    assert!(matches!(rejected(&e, &path), SnapshotError::Truncated(_)));
    falls_back_cleanly(&model, &path, "huge length");

    // A directory where the file should be.
    let dir = tmp.path().join("adir.snap");
    std::fs::create_dir(&dir).unwrap();
    falls_back_cleanly(&model, &dir, "directory");
}

#[test]
fn a_write_killed_midway_leaves_nothing_that_is_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let p = prompt();
    let good = tmp.path().join("good.snap");
    snapshot_of(&model, streaming(2), &p, &good);
    let bytes = std::fs::read(&good).unwrap();
    let mut e = engine(&model, streaming(2), 4096);

    // Killed before the rename: only the temporary file exists.
    let target = tmp.path().join("killed.snap");
    let leftover = tmp.path().join(".killed.snap.tmp.999.0");
    std::fs::write(&leftover, &bytes[..bytes.len() / 2]).unwrap();
    let (st, outcome) = e.restore_for_prompt(&target, &p, true);
    assert!(matches!(outcome, RestoreOutcome::Missing));
    assert!(st.tokens.is_empty());
    // A complete temporary file is still never read.
    std::fs::write(&leftover, &bytes).unwrap();
    assert!(matches!(
        e.restore_for_prompt(&target, &p, true).1,
        RestoreOutcome::Missing
    ));

    // A final-named file whose data never reached the disk (a filesystem
    // without ordered writes): right size, zeroed or half-written payload.
    let mut b = bytes.clone();
    for x in &mut b[bytes.len() / 2..] {
        *x = 0;
    }
    std::fs::write(&target, &b).unwrap();
    rejected(&e, &target);
    falls_back_cleanly(&model, &target, "half-written");
    // Zeroed data inside the state (lengths intact): the checksum catches it.
    let mut b = bytes.clone();
    let mid = bytes.len() / 2;
    for x in &mut b[mid..mid + 64] {
        *x = 0;
    }
    std::fs::write(&target, &b).unwrap();
    assert!(matches!(rejected(&e, &target), SnapshotError::Checksum));
    // The header written last (placeholder zeros) is not a snapshot.
    let mut b = bytes.clone();
    for x in &mut b[..32] {
        *x = 0;
    }
    std::fs::write(&target, &b).unwrap();
    assert!(matches!(rejected(&e, &target), SnapshotError::NotASnapshot));

    // A prompt cache ignores temporary files of interrupted inserts.
    let dir = tmp.path().join("pc");
    let cache = e.open_prompt_cache(&dir, 1 << 30).unwrap();
    let key = slipstream_engine::prompt_cache::prefix_key(e.model_hash(), &p);
    std::fs::write(dir.join(format!(".{key}-23.snap.tmp.1.0")), &bytes).unwrap();
    assert!(cache.lookup(&p).is_none());
    // A truncated entry under the right name is removed, not restored.
    std::fs::write(dir.join(format!("{key}-23.snap")), &bytes[..100]).unwrap();
    assert!(cache.lookup(&p).is_none());
    assert!(!dir.join(format!("{key}-23.snap")).exists());
    // And the real entry works.
    std::fs::write(dir.join(format!("{key}-23.snap")), &bytes).unwrap();
    assert_eq!(cache.lookup(&p).unwrap().state.tokens, p);
}

/// A FIFO given as a snapshot is refused at once instead of blocking.
#[test]
fn a_fifo_snapshot_is_refused_without_blocking() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    let e = engine(&model, StoreChoice::Resident, 4096);
    let fifo = tmp.path().join("s.snap");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let err = e.load_snapshot(&fifo).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
}
