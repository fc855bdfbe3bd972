//! Parity of the MTP head (multi-token prediction) with the float64 numpy
//! reference of `tools/reference/make_mtp_fixture.py`: the HF checkpoint
//! under `tests/fixtures/qwen3_5_moe_mtp` (with `mtp.*` tensors) is
//! repacked, and the main model's logits and final-normed hidden states and
//! the MTP head's logits are compared with the fixture's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use slipstream_engine::npy;
use slipstream_format::SlipModel;
use slipstream_models::{Logits, Transformer};
use slipstream_repack::{repack, QuantChoice, RepackOptions};
use slipstream_store::ResidentStore;

/// Max |ours - ref| / max |ref| (f32 against a float64 reference; about
/// 4e-7 is measured, the other parity tests allow 1e-4).
const TOLERANCE: f32 = 1e-5;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_moe_mtp")
}

fn rel_error(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let max_ref = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_diff = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    max_diff / max_ref
}

fn argmax_rows(v: &[f32], width: usize) -> Vec<usize> {
    v.chunks_exact(width)
        .map(|r| {
            r.iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                .0
        })
        .collect()
}

struct Loaded {
    _dir: tempfile::TempDir,
    model: Transformer,
    store: ResidentStore,
    tokens: Vec<u32>,
}

fn load() -> Loaded {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.slip");
    let report = repack(
        &RepackOptions {
            input: fixture(),
            output: out.clone(),
            overwrite: Default::default(),
            quant: QuantChoice::F32,
            ggml_to_affine: false,
        },
        &|_| {},
    )
    .unwrap();
    assert!(
        report.ignored_tensors.is_empty(),
        "MTP tensors must be kept: {:?}",
        report.ignored_tensors
    );
    let file = Arc::new(SlipModel::open(&out).unwrap());
    assert_eq!(file.manifest.config.mtp_num_layers, 1);
    assert_eq!(file.manifest.experts.num_layers, 3);
    let model = slipstream_models::load(&file.manifest.config, file.as_ref()).unwrap();
    let store = ResidentStore::open(file.clone()).unwrap();
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("reference.json")).unwrap()).unwrap();
    let tokens = json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    Loaded {
        _dir: dir,
        model,
        store,
        tokens,
    }
}

#[test]
fn mtp_head_matches_the_numpy_reference() {
    let Loaded {
        _dir,
        model,
        mut store,
        tokens,
    } = load();
    assert_eq!(model.mtp_depth(), 1);
    let (h, vocab) = (model.config.hidden_size, model.config.vocab_size);
    let t = tokens.len();

    // The main model, with the hidden states the head takes.
    let mut state = model.new_state();
    let (logits, hidden) = model
        .forward_hidden(&mut state, &tokens, &mut store, Logits::All)
        .unwrap();
    let (_, ref_logits) = npy::read_f32(&fixture().join("logits.npy")).unwrap();
    let (_, ref_hidden) = npy::read_f32(&fixture().join("hidden.npy")).unwrap();
    let err = rel_error(&logits, &ref_logits);
    eprintln!("main logits: max rel error {err:.3e}");
    assert!(err < TOLERANCE, "main logits: {err:e}");
    let err = rel_error(&hidden, &ref_hidden);
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
    let (shape, ref_mtp) = npy::read_f32(&fixture().join("mtp_logits.npy")).unwrap();
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
        let err = rel_error(&out.logits, &ref_mtp);
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
    let Loaded {
        _dir,
        model,
        mut store,
        tokens,
    } = load();
    let (h, vocab) = (model.config.hidden_size, model.config.vocab_size);
    let t = tokens.len();
    let (_, hidden) = npy::read_f32(&fixture().join("hidden.npy")).unwrap();
    let rows = t - 1;
    let mut whole = model.new_mtp_state().unwrap();
    let all = model
        .mtp_forward(
            0,
            &mut whole,
            &hidden[..rows * h],
            &tokens[1..],
            &mut store,
            Logits::All,
        )
        .unwrap();

    // Decode-style: one row per call, the cache growing by one each time.
    let mut step = model.new_mtp_state().unwrap();
    for i in 0..rows {
        let out = model
            .mtp_forward(
                0,
                &mut step,
                &hidden[i * h..(i + 1) * h],
                &tokens[i + 1..i + 2],
                &mut store,
                Logits::Last,
            )
            .unwrap();
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
    let redo = model
        .mtp_forward(
            0,
            &mut step,
            &hidden[keep * h..rows * h],
            &tokens[keep + 1..],
            &mut store,
            Logits::All,
        )
        .unwrap();
    assert_eq!(redo.logits, all.logits[keep * vocab..]);
    assert_eq!(step, whole);
}

#[test]
fn mtp_input_errors_are_reported() {
    let Loaded {
        _dir,
        model,
        mut store,
        tokens,
    } = load();
    let h = model.config.hidden_size;
    let mut mtp = model.new_mtp_state().unwrap();
    let hidden = vec![0.5f32; 2 * h];
    // Hidden rows that do not match the tokens.
    assert!(model
        .mtp_forward(0, &mut mtp, &hidden, &tokens[..1], &mut store, Logits::All)
        .is_err());
    // A token outside the vocabulary.
    assert!(model
        .mtp_forward(
            0,
            &mut mtp,
            &hidden[..h],
            &[1 << 20],
            &mut store,
            Logits::All
        )
        .is_err());
    // A depth the model does not have.
    assert!(model
        .mtp_forward(
            1,
            &mut mtp,
            &hidden[..h],
            &tokens[..1],
            &mut store,
            Logits::All
        )
        .is_err());
    assert_eq!(mtp.position(0), 0);
    // A state of another shape.
    let mut other = slipstream_models::MtpState {
        layers: vec![slipstream_models::state::AttnState::new(3)],
    };
    assert!(model
        .mtp_forward(
            0,
            &mut other,
            &hidden[..h],
            &tokens[..1],
            &mut store,
            Logits::All
        )
        .is_err());
}
