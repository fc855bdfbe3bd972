//! The demo model's trained MTP head (`models/demo/`, `mtp.*` written by
//! `tools/demo/train_mtp.py`): it is imported and loaded, its logits match
//! the training script's torch module on the same weights
//! (`tests/fixtures/demo_mtp/`, from that script), the main model's greedy
//! tokens are still the ones `train_demo.py` logged, and its greedy drafts
//! agree with the runtime's own greedy decoding often enough for
//! speculative decoding to pay.

use std::path::{Path, PathBuf};

use slipstream_engine::npy;
use slipstream_engine::sampler::argmax;
use slipstream_models::{Logits, Transformer};
use slipstream_repack::QuantChoice;
use slipstream_store::ResidentStore;
use slipstream_testkit::{fixture, read_json, rel_err, repack_resident, token_ids, ResidentModel};

/// Max |ours - torch| / max |torch| of the MTP logits, f32 against torch's
/// f32 on the same bf16 weights (the other parity tests allow 1e-4).
const TOLERANCE: f32 = 1e-4;

/// Torch top-2 logit gap above which the runtime's argmax must agree (an
/// error within [`TOLERANCE`] moves a logit by well under this).
const ARGMAX_MARGIN: f32 = 0.05;

/// Greedy tokens decoded after the prompt for the acceptance test.
const NEW_TOKENS: usize = 128;

/// Acceptance floors (share of MTP drafts equal to the main model's next
/// greedy token): measured 0.827 (f32, as torch's) and 0.890 (q4, its own
/// greedy text) on AVX2; the margin covers other ISAs' rounding changing a
/// greedy token and so the text that follows.
const FLOOR_F32: f64 = 0.70;
const FLOOR_Q4: f64 = 0.70;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `models/demo` repacked at `quant` and loaded with every expert resident
/// (the directory holding it comes first: keep it alive); the MTP head
/// must come along.
fn load(quant: QuantChoice) -> (tempfile::TempDir, Transformer, ResidentStore) {
    let dir = tempfile::tempdir().unwrap();
    let ResidentModel { file, model, store } =
        repack_resident(&repo().join("models/demo"), quant, dir.path());
    assert_eq!(file.manifest.config.mtp_num_layers, 1);
    assert_eq!(model.mtp_depth(), 1);
    (dir, model, store)
}

#[test]
fn demo_mtp_head_matches_the_torch_module_and_the_main_model_is_unchanged() {
    let (_dir, model, mut store) = load(QuantChoice::F32);
    let json = read_json(&fixture("demo_mtp").join("reference.json"));
    let tokens = token_ids(&json, "tokens");
    let prompt = json["prompt_tokens"].as_u64().unwrap() as usize;
    let (h, vocab, n) = (
        model.config.hidden_size,
        model.config.vocab_size,
        tokens.len(),
    );

    let mut state = model.new_state();
    let (logits, hidden) = model
        .forward_hidden(&mut state, &tokens, &mut store, Logits::All)
        .unwrap();
    // The fixture's tokens are torch's greedy continuation; the runtime's
    // main model picks the same ones, and they start with the greedy tokens
    // train_demo.py logged before the head existed.
    let greedy: Vec<u32> = logits[(prompt - 1) * vocab..(n - 1) * vocab]
        .chunks_exact(vocab)
        .map(argmax)
        .collect();
    assert_eq!(greedy, tokens[prompt..], "main model greedy tokens");
    let logged = token_ids(
        &read_json(&repo().join("tools/demo/train_log.json")),
        "greedy_tokens",
    );
    assert_eq!(tokens[..logged.len()], logged[..]);

    // MTP row t: h_t and token t+1 -> token t+2; the last row's token t+2
    // is past the sequence, the fixture keeps rows 0..n-2.
    let mut mtp = model.new_mtp_state().unwrap();
    let out = model
        .mtp_forward(
            0,
            &mut mtp,
            &hidden[..(n - 1) * h],
            &tokens[1..],
            &mut store,
            Logits::All,
        )
        .unwrap();
    let rows = token_ids(&json, "rows");
    let (shape, reference) = npy::read_f32(&fixture("demo_mtp").join("mtp_logits.npy")).unwrap();
    assert_eq!(shape, vec![rows.len(), vocab]);
    let ours: Vec<f32> = rows
        .iter()
        .flat_map(|&r| out.logits[r as usize * vocab..(r as usize + 1) * vocab].to_vec())
        .collect();
    let err = rel_err(&ours, &reference);
    eprintln!("demo MTP logits vs torch, rows {rows:?}: max rel error {err:.3e}");
    assert!(err < TOLERANCE, "demo MTP logits: {err:e}");

    let torch_greedy = token_ids(&json, "mtp_greedy");
    let margins: Vec<f32> = json["mtp_top2_margin"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(torch_greedy.len(), n - 2);
    let mut checked = 0;
    for (r, (&want, &margin)) in torch_greedy.iter().zip(&margins).enumerate() {
        if margin > ARGMAX_MARGIN {
            let got = argmax(&out.logits[r * vocab..(r + 1) * vocab]);
            assert_eq!(got, want, "MTP row {r} (torch top-2 gap {margin})");
            checked += 1;
        }
    }
    eprintln!("MTP argmax equal to torch's on {checked} of {} rows", n - 2);
    assert!(checked * 10 >= (n - 2) * 9, "too few clear rows: {checked}");
}

/// Decodes [`NEW_TOKENS`] greedily after the prompt with the runtime's main
/// model, then runs the MTP head over the sequence: the share of rows `t`
/// (from the last prompt token on) whose argmax is the token the main model
/// chose at `t + 2`, i.e. the acceptance of one-token greedy speculation.
fn greedy_acceptance(quant: QuantChoice) -> f64 {
    let (_dir, model, mut store) = load(quant);
    let json = read_json(&fixture("demo_mtp").join("reference.json"));
    let prompt = json["prompt_tokens"].as_u64().unwrap() as usize;
    let mut tokens = token_ids(&json, "tokens")[..prompt].to_vec();
    let (h, vocab) = (model.config.hidden_size, model.config.vocab_size);

    let mut state = model.new_state();
    let (mut logits, mut hidden) = model
        .forward_hidden(&mut state, &tokens, &mut store, Logits::Last)
        .unwrap();
    for _ in 0..NEW_TOKENS {
        let next = argmax(&logits[logits.len() - vocab..]);
        tokens.push(next);
        let (l, hd) = model
            .forward_hidden(&mut state, &[next], &mut store, Logits::Last)
            .unwrap();
        logits = l;
        hidden.extend_from_slice(&hd);
    }
    let n = tokens.len();
    assert_eq!(hidden.len(), n * h);

    let mut mtp = model.new_mtp_state().unwrap();
    let out = model
        .mtp_forward(
            0,
            &mut mtp,
            &hidden[..(n - 2) * h],
            &tokens[1..n - 1],
            &mut store,
            Logits::All,
        )
        .unwrap();
    let rows = (prompt - 1)..(n - 2);
    let hits = rows
        .clone()
        .filter(|&t| argmax(&out.logits[t * vocab..(t + 1) * vocab]) == tokens[t + 2])
        .count();
    hits as f64 / rows.len() as f64
}

#[test]
fn demo_mtp_drafts_agree_with_greedy_decoding() {
    for (quant, floor) in [(QuantChoice::F32, FLOOR_F32), (QuantChoice::Q4, FLOOR_Q4)] {
        let acc = greedy_acceptance(quant);
        eprintln!(
            "demo MTP greedy acceptance ({}): {acc:.3} over {NEW_TOKENS} tokens",
            quant.name()
        );
        assert!(
            acc >= floor,
            "{}: acceptance {acc:.3} below {floor}",
            quant.name()
        );
    }
}
