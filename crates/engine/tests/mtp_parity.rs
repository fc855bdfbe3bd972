//! Parity of the MTP head (multi-token prediction) with the float64 numpy
//! reference of `tools/reference/make_mtp_fixture.py`: the HF checkpoint
//! under `tests/fixtures/qwen3_5_moe_mtp` (with `mtp.*` tensors) is
//! repacked, and the main model's logits and final-normed hidden states and
//! the MTP head's logits are compared with the fixture's.

use slipstream_engine::npy;
use slipstream_engine::sampler::argmax;
use slipstream_models::{Logits, MtpState, Transformer};
use slipstream_repack::QuantChoice;
use slipstream_store::ResidentStore;
use slipstream_testkit::{fixture, read_json, rel_err, repack_resident, token_ids, ResidentModel};

/// Max |ours - ref| / max |ref| (f32 against a float64 reference; about
/// 4e-7 is measured, the other parity tests allow 1e-4).
const TOLERANCE: f32 = 1e-5;

const FIXTURE: &str = "qwen3_5_moe_mtp";

/// The argmax of each `width`-wide row of `v`.
fn argmax_rows(v: &[f32], width: usize) -> Vec<u32> {
    v.chunks_exact(width).map(argmax).collect()
}

/// The fixture repacked at f32 and loaded with every expert resident (the
/// directory holding it comes first: keep it alive), and the reference's
/// tokens.
fn load() -> (tempfile::TempDir, Transformer, ResidentStore, Vec<u32>) {
    let dir = tempfile::tempdir().unwrap();
    let ResidentModel { file, model, store } =
        repack_resident(&fixture(FIXTURE), QuantChoice::F32, dir.path());
    assert_eq!(file.manifest.config.mtp_num_layers, 1);
    assert_eq!(file.manifest.experts.num_layers, 3);
    let json = read_json(&fixture(FIXTURE).join("reference.json"));
    (dir, model, store, token_ids(&json, "tokens"))
}

#[test]
fn mtp_head_matches_the_numpy_reference() {
    let (_dir, model, mut store, tokens) = load();
    assert_eq!(model.mtp_depth(), 1);
    let (h, vocab) = (model.config.hidden_size, model.config.vocab_size);
    let t = tokens.len();

    // The main model, with the hidden states the head takes.
    let mut state = model.new_state();
    let (logits, hidden) = model
        .forward_hidden(&mut state, &tokens, &mut store, Logits::All)
        .unwrap();
    let (_, ref_logits) = npy::read_f32(&fixture(FIXTURE).join("logits.npy")).unwrap();
    let (_, ref_hidden) = npy::read_f32(&fixture(FIXTURE).join("hidden.npy")).unwrap();
    let err = rel_err(&logits, &ref_logits);
    eprintln!("main logits: max rel error {err:.3e}");
    assert!(err < TOLERANCE, "main logits: {err:e}");
    let err = rel_err(&hidden, &ref_hidden);
    eprintln!("main hidden: max rel error {err:.3e}");
    assert!(err < TOLERANCE, "main hidden: {err:e}");
    // forward_hidden's logits are forward's, bit for bit.
    let mut plain = model.new_state();
    let again = model
        .forward(&mut plain, &tokens, &mut store, Logits::All, None)
        .unwrap();
    assert_eq!(again, logits);

    // The MTP head on the reference's hidden states (the head alone), then
    // on ours (the chain a drafting loop runs).
    let (shape, ref_mtp) = npy::read_f32(&fixture(FIXTURE).join("mtp_logits.npy")).unwrap();
    assert_eq!(shape, vec![t - 1, vocab]);
    for (what, input) in [("reference", &ref_hidden), ("own", &hidden)] {
        let mut mtp = model.new_mtp_state().unwrap();
        let out = model
            .mtp_forward(
                0,
                &mut mtp,
                &input[..(t - 1) * h],
                &tokens[1..],
                &mut store,
                Logits::All,
            )
            .unwrap();
        let err = rel_err(&out.logits, &ref_mtp);
        eprintln!("MTP logits on the {what} hidden states: max rel error {err:.3e}");
        assert!(err < TOLERANCE, "MTP logits ({what} hidden): {err:e}");
        assert_eq!(
            argmax_rows(&out.logits, vocab),
            argmax_rows(&ref_mtp, vocab)
        );
        assert_eq!(out.hidden.len(), (t - 1) * h);
        assert_eq!(mtp.position(0), t - 1);
    }
}

#[test]
fn mtp_rows_one_at_a_time_and_after_truncation_are_bit_identical() {
    let (_dir, model, mut store, tokens) = load();
    let (h, vocab) = (model.config.hidden_size, model.config.vocab_size);
    let t = tokens.len();
    let (_, hidden) = npy::read_f32(&fixture(FIXTURE).join("hidden.npy")).unwrap();
    let rows = t - 1;
    // The first MTP layer on `hidden` rows and the tokens after them.
    let mut head = |state: &mut MtpState, hidden: &[f32], tokens: &[u32], want| {
        model
            .mtp_forward(0, state, hidden, tokens, &mut store, want)
            .unwrap()
    };
    let mut whole = model.new_mtp_state().unwrap();
    let all = head(&mut whole, &hidden[..rows * h], &tokens[1..], Logits::All);

    // Decode-style: one row per call, the cache growing by one each time.
    let mut step = model.new_mtp_state().unwrap();
    for i in 0..rows {
        let out = head(
            &mut step,
            &hidden[i * h..(i + 1) * h],
            &tokens[i + 1..i + 2],
            Logits::Last,
        );
        assert_eq!(
            out.logits,
            all.logits[i * vocab..(i + 1) * vocab],
            "row {i}"
        );
        assert_eq!(out.hidden, all.hidden[i * h..(i + 1) * h], "row {i}");
    }
    assert_eq!(step, whole);

    // Rejected drafts: truncating the cache and running the rows again
    // gives the same numbers.
    let keep = 5;
    step.truncate(keep);
    assert_eq!(step.position(0), keep);
    let redo = head(
        &mut step,
        &hidden[keep * h..rows * h],
        &tokens[keep + 1..],
        Logits::All,
    );
    assert_eq!(redo.logits, all.logits[keep * vocab..]);
    assert_eq!(step, whole);
}

#[test]
fn mtp_input_errors_are_reported() {
    let (_dir, model, mut store, tokens) = load();
    let h = model.config.hidden_size;
    let mut mtp = model.new_mtp_state().unwrap();
    let hidden = vec![0.5f32; 2 * h];
    let mut rejects = |depth, state: &mut MtpState, hidden: &[f32], tokens: &[u32]| {
        model
            .mtp_forward(depth, state, hidden, tokens, &mut store, Logits::All)
            .is_err()
    };
    assert!(
        rejects(0, &mut mtp, &hidden, &tokens[..1]),
        "hidden rows that do not match the tokens"
    );
    assert!(
        rejects(0, &mut mtp, &hidden[..h], &[1 << 20]),
        "a token outside the vocabulary"
    );
    assert!(
        rejects(1, &mut mtp, &hidden[..h], &tokens[..1]),
        "a depth the model does not have"
    );
    assert_eq!(mtp.position(0), 0);
    let mut other = MtpState {
        layers: vec![slipstream_models::state::AttnState::new(3)],
    };
    assert!(
        rejects(0, &mut other, &hidden[..h], &tokens[..1]),
        "a state of another shape"
    );
}
