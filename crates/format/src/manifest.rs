//! `manifest.json`: the index of a `.slip` model.

use serde::{Deserialize, Serialize};
use slipstream_core::{ModelConfig, QuantType};

pub const FORMAT_NAME: &str = "slipstream";
/// 2: `manifest_checksum` covers the manifest itself.
pub const FORMAT_VERSION: u32 = 2;
/// 3: the expert pool's part types differ between layers
/// (`ExpertPoolIndex::layer_parts`); written only for such pools, so a
/// uniform pool stays readable by version-2 builds.
pub const FORMAT_VERSION_LAYER_PARTS: u32 = 3;

/// One dense tensor inside `dense.bin`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DenseEntry {
    /// Canonical name, e.g. `layers.3.attn.q_proj` (see `slipstream-models`).
    pub name: String,
    pub qtype: QuantType,
    /// `[rows, cols]`; 1-D tensors are `[1, n]`.
    pub shape: [usize; 2],
    /// Byte offset in `dense.bin`, a multiple of 64.
    pub offset: u64,
    pub nbytes: u64,
    /// xxh3-64 of the tensor bytes, lowercase hex.
    pub checksum: String,
}

/// One projection inside an expert record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertPart {
    /// `gate`, `up` or `down`.
    pub name: String,
    pub qtype: QuantType,
    /// `[rows, cols]`: gate/up `[intermediate, hidden]`, down `[hidden, intermediate]`.
    pub shape: [usize; 2],
    /// Byte offset inside the record.
    pub offset: u64,
    pub nbytes: u64,
}

/// Layout of `experts.bin`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExpertPoolIndex {
    pub num_layers: usize,
    pub num_experts: usize,
    /// Bytes of payload in the largest record (gate + up + down); a layer's
    /// own is [`ExpertPoolIndex::layer_record_bytes`].
    pub record_bytes: u64,
    /// Distance between records, a multiple of 4096.
    pub record_stride: u64,
    /// The parts of every layer's records (of layer 0's when `layer_parts`
    /// is given).
    pub parts: Vec<ExpertPart>,
    /// `layer_parts[layer]`: the parts of that layer's records, when the
    /// types differ between layers (a K-quant GGUF such as Q4_K_M keeps
    /// some layers' `down` as Q6_K); empty when every layer uses `parts`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_parts: Vec<Vec<ExpertPart>>,
    /// `checksums[layer][expert]`: xxh3-64 of the record's
    /// `layer_record_bytes(layer)`, hex.
    pub checksums: Vec<Vec<String>>,
}

impl ExpertPoolIndex {
    /// The parts of layer `layer`'s records.
    pub fn parts_of(&self, layer: usize) -> &[ExpertPart] {
        self.layer_parts.get(layer).unwrap_or(&self.parts)
    }

    /// Bytes of payload of a record of layer `layer`.
    pub fn layer_record_bytes(&self, layer: usize) -> u64 {
        self.parts_of(layer)
            .iter()
            .map(|p| p.offset.saturating_add(p.nbytes))
            .max()
            .unwrap_or(0)
    }

    /// File offset of a record.
    pub fn record_offset(&self, layer: usize, expert: usize) -> u64 {
        (layer * self.num_experts + expert) as u64 * self.record_stride
    }

    pub fn file_bytes(&self) -> u64 {
        (self.num_layers * self.num_experts) as u64 * self.record_stride
    }
}

/// Where the model came from (informational).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SourceInfo {
    /// `hf-safetensors` or `mlx`.
    pub kind: String,
    pub path: String,
    /// Requested quantization for float tensors (`q4`, `q8`, `bf16`, `f32`).
    pub quant: String,
}

/// Sampling settings the checkpoint recommends (its
/// `generation_config.json`, or a GGUF's `general.sampling.*`); each is
/// absent when the checkpoint does not set it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationDefaults {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// 0 disables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Hugging Face's (1 is off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// OpenAI's (0 is off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// Whether no setting is given.
    pub fn is_empty(&self) -> bool {
        *self == GenerationDefaults::default()
    }
}

/// The whole manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub config: ModelConfig,
    pub dense: Vec<DenseEntry>,
    pub dense_file_bytes: u64,
    pub experts: ExpertPoolIndex,
    /// File name of the HF tokenizer inside the model directory, if any.
    pub tokenizer: Option<String>,
    /// Jinja chat template from the checkpoint, if any.
    pub chat_template: Option<String>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Special tokens named by the tokenizer config (`bos_token`, `eos_token`, ...).
    #[serde(default)]
    pub special_tokens: std::collections::BTreeMap<String, String>,
    /// Recommended sampling settings; absent in manifests written before
    /// they were recorded, and when the checkpoint gives none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationDefaults>,
    pub source: SourceInfo,
    /// Identity of the weights: xxh3 over the config and every tensor and
    /// record checksum ([`Manifest::content_hash`], checked at open).
    /// Snapshots and caches made with one model are refused by another.
    pub model_hash: String,
    /// xxh3-64 (hex) of this manifest serialized with this field empty
    /// ([`Manifest::self_checksum`]): a one-byte edit of any value fails
    /// the open instead of running a different model under the same hash.
    #[serde(default)]
    pub manifest_checksum: String,
}

impl Manifest {
    /// The model hash its content gives: the config, then every dense
    /// tensor's name and checksum, then every expert record's checksum.
    pub fn content_hash(&self) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(
            serde_json::to_string(&self.config)
                .unwrap_or_default()
                .as_bytes(),
        );
        for e in &self.dense {
            h.update(e.name.as_bytes());
            h.update(e.checksum.as_bytes());
        }
        for row in &self.experts.checksums {
            for c in row {
                h.update(c.as_bytes());
            }
        }
        format!("{:016x}", h.digest())
    }

    /// The checksum `manifest_checksum` must hold: of the pretty JSON of
    /// this manifest with that field empty (serialization is deterministic:
    /// struct fields in order, maps ordered).
    pub fn self_checksum(&self) -> String {
        let mut unsealed = self.clone();
        unsealed.manifest_checksum.clear();
        let json = serde_json::to_vec_pretty(&unsealed).unwrap_or_default();
        format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&json))
    }
}
