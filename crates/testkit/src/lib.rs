//! Test scaffolding shared by the integration tests of the engine, the CLI
//! and the CUDA backend. A dev-dependency only: nothing here ships.
//!
//! Helpers panic on failure (they are test code); each names what failed.

pub mod cli;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use slipstream_engine::{
    npy, BackendChoice, Engine, EngineConfig, GenerateRequest, Generation, SamplingParams,
    SlipModel, StoreChoice,
};
use slipstream_models::Transformer;
use slipstream_repack::{repack, QuantChoice, RepackOptions, RepackReport};
use slipstream_store::{ResidentStore, StreamConfig};

/// The committed fixtures directory, `tests/fixtures/` at the workspace
/// root: where the test was built, or else under the current directory (a
/// test binary copied to another machine and run from the repository root,
/// as scripts/cuda_device_test.sh does).
pub fn fixtures() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    }
}

/// A committed fixture checkpoint under `tests/fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// Repacks `input` (a checkpoint directory or a GGUF file) into `output`
/// with `quant`, converting GGML block weights to affine when
/// `ggml_to_affine`.
pub fn repack_into(
    input: &Path,
    output: &Path,
    quant: QuantChoice,
    ggml_to_affine: bool,
) -> RepackReport {
    repack(
        &RepackOptions {
            input: input.to_path_buf(),
            output: output.to_path_buf(),
            overwrite: Default::default(),
            quant,
            ggml_to_affine,
        },
        &|_| {},
    )
    .unwrap_or_else(|e| panic!("repacking {}: {e}", input.display()))
}

/// Repacks fixture `name` with `quant` into `dir` and returns the model path.
pub fn repacked(name: &str, quant: QuantChoice, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}-{quant}.slip"));
    repack_into(&fixture(name), &out, quant, false);
    out
}

/// Repacks GGUF fixture `name` (its `model.gguf`, repack's default quant:
/// GGML blocks kept) into `dir` and returns the model path.
pub fn repacked_gguf(name: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}.slip"));
    repack_into(
        &fixture(name).join("model.gguf"),
        &out,
        QuantChoice::default(),
        false,
    );
    out
}

/// A model opened beneath the engine, for tests that drive
/// [`Transformer`] directly: the file, its weights, every expert resident.
pub struct ResidentModel {
    pub file: Arc<SlipModel>,
    pub model: Transformer,
    pub store: ResidentStore,
}

/// Loads the `.slip` at `path` as a [`ResidentModel`].
pub fn load_resident(path: &Path) -> ResidentModel {
    let file = Arc::new(
        SlipModel::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display())),
    );
    let model = slipstream_models::load(&file.manifest.config, file.as_ref())
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let store = ResidentStore::open(file.clone())
        .unwrap_or_else(|e| panic!("opening the experts of {}: {e}", path.display()));
    ResidentModel { file, model, store }
}

/// Repacks `input` with `quant` into `dir` (as `model.slip`), checks that
/// no tensor was left out (an MTP head's included) and loads the result as
/// a [`ResidentModel`].
pub fn repack_resident(input: &Path, quant: QuantChoice, dir: &Path) -> ResidentModel {
    let out = dir.join("model.slip");
    let report = repack_into(input, &out, quant, false);
    assert!(
        report.ignored_tensors.is_empty(),
        "{}: tensors left out: {:?}",
        input.display(),
        report.ignored_tensors
    );
    load_resident(&out)
}

/// The prompt the streaming, snapshot, activation and hook tests share:
/// 23 token ids below 500.
pub fn prompt() -> Vec<u32> {
    (0..23).map(|i| (i * 37 + 11) % 500).collect()
}

/// A streaming store of `slots` expert slots per layer, other settings
/// default.
pub fn streaming(slots: usize) -> StoreChoice {
    StoreChoice::Streaming(StreamConfig {
        slots,
        ..Default::default()
    })
}

/// Opens `model` on the CPU with `store`, prefilling `chunk` tokens at a
/// time.
pub fn open(model: &Path, store: StoreChoice, chunk: usize) -> Engine {
    open_on(model, store, chunk, BackendChoice::Cpu)
}

/// [`open`] on `backend`.
pub fn open_on(model: &Path, store: StoreChoice, chunk: usize, backend: BackendChoice) -> Engine {
    Engine::open(
        model,
        EngineConfig {
            prefill_chunk: chunk,
            store,
            backend,
            ..EngineConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("opening {}: {e}", model.display()))
}

/// A request for `max_new_tokens` tokens after `prompt`, sampled at
/// temperature 0.9 and top-p 0.95 from `seed`, keeping every logits row:
/// the sampled run the cache, snapshot and state-cache tests compare.
pub fn sampled(prompt: Vec<u32>, max_new_tokens: usize, seed: u64) -> GenerateRequest {
    GenerateRequest::new(prompt, max_new_tokens)
        .with_sampling(SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed,
            ..Default::default()
        })
        .keeping_logits()
}

/// `max_new_tokens` greedy tokens after `prompt`, keeping every logits row
/// (`[prompt + generated - 1, vocab]`).
pub fn greedy(engine: &mut Engine, prompt: &[u32], max_new_tokens: usize) -> Generation {
    engine
        .generate(
            &GenerateRequest::new(prompt.to_vec(), max_new_tokens).keeping_logits(),
            &mut |_| true,
        )
        .unwrap_or_else(|e| panic!("greedy generation: {e}"))
}

/// Whether `a` and `b` are the same floats, bit for bit.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `max |a - b| / max |b|` (the absolute difference when `b` is all zero).
/// Panics on different lengths or a non-finite value in `a`.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|v| v.is_finite()), "non-finite output");
    let m = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    if m == 0.0 {
        d
    } else {
        d / m
    }
}

/// The `transformers` reference committed beside a fixture
/// (`reference.json` and `logits.npy`, written by `tools/reference`).
pub struct Reference {
    /// `prompt_text`, where the fixture has one.
    pub text: Option<String>,
    pub prompt: Vec<u32>,
    /// Greedy continuation of the prompt.
    pub greedy: Vec<u32>,
    /// `[positions, vocab]` of `logits`.
    pub shape: Vec<usize>,
    pub logits: Vec<f32>,
}

impl Reference {
    /// Reads the reference in fixture directory `dir`.
    pub fn read(dir: &Path) -> Reference {
        let json = read_json(&dir.join("reference.json"));
        let (shape, logits) = npy::read_f32(&dir.join("logits.npy")).unwrap();
        Reference {
            text: json["prompt_text"].as_str().map(str::to_string),
            prompt: token_ids(&json, "prompt_tokens"),
            greedy: token_ids(&json, "greedy_tokens"),
            shape,
            logits,
        }
    }

    pub fn vocab(&self) -> usize {
        self.shape[1]
    }

    /// Runs `model` greedily on the reference prompt (every expert
    /// resident, prefill chunks of `chunk` tokens) and checks the greedy
    /// tokens against the reference's up to where generation stopped (an
    /// EOS) and that a logits row came back for every position. Returns the
    /// generation, the max relative logit error against the reference
    /// ([`rel_err`]) and the positions compared.
    pub fn run_greedy(&self, what: &str, model: &Path, chunk: usize) -> (Generation, f32, usize) {
        let mut engine = open(model, StoreChoice::Resident, chunk);
        let gen = greedy(&mut engine, &self.prompt, self.greedy.len());
        let n = gen.tokens.len();
        assert_eq!(
            gen.tokens[..],
            self.greedy[..n],
            "{what}: greedy tokens differ"
        );
        let rows = gen.logits.len() / self.vocab();
        assert_eq!(rows, self.prompt.len() + n - 1);
        let err = rel_err(&gen.logits, &self.logits[..rows * self.vocab()]);
        (gen, err, rows)
    }
}

/// The JSON file at `path`.
pub fn read_json(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The token id array `key` of a reference JSON.
pub fn token_ids(json: &serde_json::Value, key: &str) -> Vec<u32> {
    json[key]
        .as_array()
        .unwrap_or_else(|| panic!("reference has no {key} array"))
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// A small skewed synthetic model with the 35B preset's structure: 4
/// layers (3 Gated DeltaNet, 1 gated attention), 32 experts top-4, a
/// shared expert, vocabulary 512, hidden width `hidden`, `mtp_layers` MTP
/// layers; written to `dir/name` from `seed`.
/// A prompt whose n-grams repeat, so prompt lookup has matches (ids
/// below 500).
pub fn repetitive_prompt() -> Vec<u32> {
    let phrase: Vec<u32> = (0..9).map(|i| (i * 53 + 7) % 500).collect();
    let mut p = phrase.clone();
    p.extend([3, 1, 4]);
    p.extend(&phrase);
    p.extend([2, 7]);
    p.extend(&phrase[..4]);
    p
}

pub fn small_hybrid_model(
    dir: &Path,
    name: &str,
    hidden: usize,
    mtp_layers: usize,
    seed: u64,
) -> PathBuf {
    use slipstream_core::config::LayerKind;
    let config = slipstream_core::ModelConfig {
        vocab_size: 512,
        hidden_size: hidden,
        layer_types: vec![
            LayerKind::LinearAttention,
            LayerKind::LinearAttention,
            LayerKind::LinearAttention,
            LayerKind::FullAttention,
        ],
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        rotary_dim: 16,
        linear_num_key_heads: 2,
        linear_key_head_dim: 64,
        linear_num_value_heads: 4,
        linear_value_head_dim: 64,
        num_experts: 32,
        num_experts_per_tok: 4,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: 64,
        mtp_num_layers: mtp_layers,
        ..slipstream_synth::preset_config(slipstream_synth::Preset::Qwen36_35bA3b, Some(4))
    };
    let out = dir.join(name);
    slipstream_synth::synthesize(
        &slipstream_synth::SynthOptions {
            config,
            seed,
            skew: slipstream_synth::Skew::DEFAULT,
            output: out.clone(),
            preset_name: "test".into(),
            batch: 8,
            overwrite: Default::default(),
        },
        &|_| {},
    )
    .unwrap_or_else(|e| panic!("synthesizing {}: {e}", out.display()));
    out
}
