//! Builders for tiny synthetic checkpoints (HF safetensors and MLX 4-bit).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;
use serde_json::{json, Value};
use slipstream_core::QuantType;
use slipstream_format::SlipModel;
use slipstream_repack::{repack, QuantChoice, RepackOptions, RepackReport, Result};

/// Shapes of the tiny test model.
#[derive(Clone, Debug)]
pub struct Tiny {
    pub vocab: usize,
    pub hidden: usize,
    /// true = full attention.
    pub full: Vec<bool>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub nk: usize,
    pub dk: usize,
    pub nv: usize,
    pub dv: usize,
    pub kernel: usize,
    pub experts: usize,
    pub top_k: usize,
    pub inter: usize,
    pub shared: usize,
}

impl Tiny {
    pub fn qwen35() -> Tiny {
        Tiny {
            vocab: 32,
            hidden: 64,
            full: vec![false, false, false, true],
            heads: 2,
            kv_heads: 1,
            head_dim: 32,
            nk: 2,
            dk: 16,
            nv: 4,
            dv: 16,
            kernel: 4,
            experts: 4,
            top_k: 2,
            inter: 64,
            shared: 64,
        }
    }
    pub fn qwen3() -> Tiny {
        Tiny {
            full: vec![true, true],
            shared: 0,
            ..Tiny::qwen35()
        }
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.nk * self.dk + self.nv * self.dv
    }

    /// `config` with the fields both architectures' configs share.
    fn with_common_fields(&self, mut config: Value) -> Value {
        let common = json!({
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.full.len(),
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": false,
        });
        let map = config.as_object_mut().expect("a config object");
        for (k, v) in common.as_object().expect("an object") {
            map.insert(k.clone(), v.clone());
        }
        config
    }

    /// `text_config` of a qwen3_5_moe checkpoint.
    pub fn qwen35_text_config(&self) -> Value {
        self.with_common_fields(json!({
            "model_type": "qwen3_5_moe_text",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "layer_types": self.full.iter().map(|f| if *f { "full_attention" } else { "linear_attention" }).collect::<Vec<_>>(),
            "linear_conv_kernel_dim": self.kernel,
            "linear_key_head_dim": self.dk,
            "linear_value_head_dim": self.dv,
            "linear_num_key_heads": self.nk,
            "linear_num_value_heads": self.nv,
            "moe_intermediate_size": self.inter,
            "shared_expert_intermediate_size": self.shared,
            "num_experts_per_tok": self.top_k,
            "num_experts": self.experts,
            "eos_token_id": 2,
        }))
    }

    pub fn qwen35_config(&self) -> Value {
        json!({
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "tie_word_embeddings": false,
            "text_config": self.qwen35_text_config(),
        })
    }

    pub fn qwen3_config(&self) -> Value {
        self.with_common_fields(json!({
            "model_type": "qwen3_moe",
            "rope_theta": 1e6,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": self.inter,
            "num_experts_per_tok": self.top_k,
            "num_experts": self.experts,
            "norm_topk_prob": true,
            "eos_token_id": [2, 3],
        }))
    }
}

/// Deterministic values in [-1, 1) from a name.
pub fn values(name: &str, n: usize) -> Vec<f32> {
    let mut s: u64 = 0xcbf29ce484222325;
    for b in name.bytes() {
        s = (s ^ b as u64).wrapping_mul(0x100000001b3);
    }
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// name -> (shape, values)
pub type FloatMap = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn put(m: &mut FloatMap, name: String, shape: &[usize]) {
    let n = shape.iter().product();
    let v = values(&name, n);
    m.insert(name, (shape.to_vec(), v));
}

/// HF float tensors. `prefix` is the text model's key prefix
/// (`model.language_model.` or `model.`); `fused` picks the expert layout.
pub fn hf_tensors(t: &Tiny, qwen35: bool, prefix: &str, fused: bool, lm_head: bool) -> FloatMap {
    let mut m = FloatMap::new();
    let h = t.hidden;
    put(
        &mut m,
        format!("{prefix}embed_tokens.weight"),
        &[t.vocab, h],
    );
    put(&mut m, format!("{prefix}norm.weight"), &[h]);
    if lm_head {
        put(&mut m, "lm_head.weight".into(), &[t.vocab, h]);
    }
    for (l, full) in t.full.iter().enumerate() {
        let p = format!("{prefix}layers.{l}.");
        put(&mut m, format!("{p}input_layernorm.weight"), &[h]);
        put(&mut m, format!("{p}post_attention_layernorm.weight"), &[h]);
        if *full {
            let q = t.heads * t.head_dim * if qwen35 { 2 } else { 1 };
            put(&mut m, format!("{p}self_attn.q_proj.weight"), &[q, h]);
            put(
                &mut m,
                format!("{p}self_attn.k_proj.weight"),
                &[t.kv_heads * t.head_dim, h],
            );
            put(
                &mut m,
                format!("{p}self_attn.v_proj.weight"),
                &[t.kv_heads * t.head_dim, h],
            );
            put(
                &mut m,
                format!("{p}self_attn.o_proj.weight"),
                &[h, t.heads * t.head_dim],
            );
            put(&mut m, format!("{p}self_attn.q_norm.weight"), &[t.head_dim]);
            put(&mut m, format!("{p}self_attn.k_norm.weight"), &[t.head_dim]);
        } else {
            let g = format!("{p}linear_attn.");
            put(&mut m, format!("{g}in_proj_qkv.weight"), &[t.conv_dim(), h]);
            put(&mut m, format!("{g}in_proj_z.weight"), &[t.nv * t.dv, h]);
            put(&mut m, format!("{g}in_proj_b.weight"), &[t.nv, h]);
            put(&mut m, format!("{g}in_proj_a.weight"), &[t.nv, h]);
            put(
                &mut m,
                format!("{g}conv1d.weight"),
                &[t.conv_dim(), 1, t.kernel],
            );
            put(&mut m, format!("{g}A_log"), &[t.nv]);
            put(&mut m, format!("{g}dt_bias"), &[t.nv]);
            put(&mut m, format!("{g}norm.weight"), &[t.dv]);
            put(&mut m, format!("{g}out_proj.weight"), &[h, t.nv * t.dv]);
        }
        put(&mut m, format!("{p}mlp.gate.weight"), &[t.experts, h]);
        if qwen35 {
            put(&mut m, format!("{p}mlp.shared_expert_gate.weight"), &[1, h]);
            let shared = format!("{p}mlp.shared_expert");
            put_mlp(&mut m, &shared, [t.shared, h], [h, t.shared]);
        }
        if fused {
            put(
                &mut m,
                format!("{p}mlp.experts.gate_up_proj"),
                &[t.experts, 2 * t.inter, h],
            );
            put(
                &mut m,
                format!("{p}mlp.experts.down_proj"),
                &[t.experts, h, t.inter],
            );
        } else {
            for e in 0..t.experts {
                let expert = format!("{p}mlp.experts.{e}");
                put_mlp(&mut m, &expert, [t.inter, h], [h, t.inter]);
            }
        }
    }
    m
}

/// An MLP's `gate_proj` and `up_proj` weights (both `up_shape`) and its
/// `down_proj` weight (`down_shape`) under `prefix`.
fn put_mlp(m: &mut FloatMap, prefix: &str, up_shape: [usize; 2], down_shape: [usize; 2]) {
    put(m, format!("{prefix}.gate_proj.weight"), &up_shape);
    put(m, format!("{prefix}.up_proj.weight"), &up_shape);
    put(m, format!("{prefix}.down_proj.weight"), &down_shape);
}

/// Rounds every value to bf16 (so the map holds what a bf16 file stores).
pub fn round_bf16(m: &mut FloatMap) {
    for (_, v) in m.values_mut() {
        for x in v.iter_mut() {
            *x = bf16::from_f32(*x).to_f32();
        }
    }
}

pub fn to_bytes(v: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::BF16 => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        _ => panic!("float dtype"),
    }
}

/// A raw tensor to serialize.
pub struct Raw {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

pub fn floats_to_raw(m: &FloatMap, dtype: Dtype) -> BTreeMap<String, Raw> {
    m.iter()
        .map(|(k, (shape, v))| {
            (
                k.clone(),
                Raw {
                    dtype,
                    shape: shape.clone(),
                    data: to_bytes(v, dtype),
                },
            )
        })
        .collect()
}

fn serialize(tensors: &BTreeMap<String, Raw>, names: &[&String]) -> Vec<u8> {
    let views: Vec<(String, StView)> = names
        .iter()
        .map(|n| {
            let r = &tensors[*n];
            (
                (*n).clone(),
                StView::new(r.dtype, r.shape.clone(), &r.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Writes `model.safetensors` (shards == 1) or `shards` files plus an index.
pub fn save(dir: &Path, tensors: &BTreeMap<String, Raw>, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let names: Vec<&String> = tensors.keys().collect();
    if shards <= 1 {
        std::fs::write(dir.join("model.safetensors"), serialize(tensors, &names)).unwrap();
        return;
    }
    let per = names.len().div_ceil(shards);
    let mut map = serde_json::Map::new();
    for (i, chunk) in names.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
        std::fs::write(dir.join(&file), serialize(tensors, chunk)).unwrap();
        for n in chunk {
            map.insert((*n).clone(), Value::String(file.clone()));
        }
    }
    let index = json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
}

pub fn write_json(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// A tiny tokenizer.json / tokenizer_config.json / generation_config.json.
pub fn write_tokenizer_files(dir: &Path) {
    write_json(
        &dir.join("tokenizer.json"),
        &json!({
            "version": "1.0",
            "added_tokens": [
                {"id": 5, "content": "<|endoftext|>", "special": true},
                {"id": 7, "content": "<|im_end|>", "special": true}
            ],
            "model": {"type": "BPE", "vocab": {}, "merges": []}
        }),
    );
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "bos_token": null,
            "eos_token": {"content": "<|im_end|>", "lstrip": false},
            "pad_token": "<|endoftext|>",
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        }),
    );
    write_json(
        &dir.join("generation_config.json"),
        // Qwen3.6's recommended sampling, as its checkpoint writes it.
        &json!({"eos_token_id": [2, 7], "do_sample": true, "temperature": 0.6,
            "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0}),
    );
}

// ---------------------------------------------------------------- MLX

/// One MLX-quantized tensor: codes as u32 words, bf16 scales/biases.
pub struct MlxQ {
    pub words: Vec<u32>,
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
    /// leading dims + [rows, cols] (logical, unpacked)
    pub shape: Vec<usize>,
    pub bits: usize,
    pub group: usize,
}

impl MlxQ {
    /// Random codes and scales for a logical `[.., rows, cols]` tensor.
    pub fn random(name: &str, shape: &[usize], bits: usize, group: usize) -> MlxQ {
        let cols = *shape.last().unwrap();
        let n: usize = shape.iter().product();
        let r = values(name, n * bits / 32 + 2 * (n / group));
        let nw = n * bits / 32;
        let words: Vec<u32> = values(&format!("{name}#w"), nw)
            .iter()
            .map(|x| (x.to_bits()).wrapping_mul(2654435761))
            .collect();
        let ng = n / group;
        let scales = r[nw..nw + ng]
            .iter()
            .map(|x| bf16::from_f32(*x * 0.1).to_bits())
            .collect();
        let biases = r[nw + ng..nw + 2 * ng]
            .iter()
            .map(|x| bf16::from_f32(*x).to_bits())
            .collect();
        assert_eq!(cols % group, 0);
        MlxQ {
            words,
            scales,
            biases,
            shape: shape.to_vec(),
            bits,
            group,
        }
    }

    pub fn insert(&self, base: &str, out: &mut BTreeMap<String, Raw>) {
        let mut wshape = self.shape.clone();
        let cols = wshape.pop().unwrap();
        let mut sshape = wshape.clone();
        wshape.push(cols * self.bits / 32);
        sshape.push(cols / self.group);
        out.insert(
            format!("{base}.weight"),
            Raw {
                dtype: Dtype::U32,
                shape: wshape,
                data: self.words.iter().flat_map(|w| w.to_le_bytes()).collect(),
            },
        );
        out.insert(
            format!("{base}.scales"),
            Raw {
                dtype: Dtype::BF16,
                shape: sshape.clone(),
                data: self.scales.iter().flat_map(|w| w.to_le_bytes()).collect(),
            },
        );
        out.insert(
            format!("{base}.biases"),
            Raw {
                dtype: Dtype::BF16,
                shape: sshape,
                data: self.biases.iter().flat_map(|w| w.to_le_bytes()).collect(),
            },
        );
    }

    /// Our stored bytes for the whole tensor: codes, scales, biases.
    pub fn stored(&self) -> Vec<u8> {
        self.stored_slice(0, 1)
    }

    /// Stored bytes of slice `i` of `n` along the leading dim.
    pub fn stored_slice(&self, i: usize, n: usize) -> Vec<u8> {
        let w: Vec<u8> = self.words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let s: Vec<u8> = self.scales.iter().flat_map(|w| w.to_le_bytes()).collect();
        let b: Vec<u8> = self.biases.iter().flat_map(|w| w.to_le_bytes()).collect();
        let (cw, cs) = (w.len() / n, s.len() / n);
        let mut out = w[i * cw..(i + 1) * cw].to_vec();
        out.extend_from_slice(&s[i * cs..(i + 1) * cs]);
        out.extend_from_slice(&b[i * cs..(i + 1) * cs]);
        out
    }
}

// ------------------------------------------------------------ repack runs

pub fn run(input: &Path, output: &Path, quant: QuantChoice) -> Result<RepackReport> {
    repack(
        &RepackOptions {
            input: input.to_path_buf(),
            output: output.to_path_buf(),
            overwrite: Default::default(),
            quant,
            ggml_to_affine: false,
        },
        &|_| {},
    )
}

pub fn f32_of(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The stored f32 values of a dense tensor (must be F32).
pub fn stored_f32(m: &SlipModel, name: &str) -> Vec<f32> {
    let t = m.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.qtype, QuantType::F32, "{name} should be f32");
    f32_of(t.view().data)
}

pub fn bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: {x} vs {y}");
    }
}

pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

pub fn qwen3_checkpoint(input: &Path) -> (Tiny, FloatMap) {
    let t = Tiny::qwen3();
    let src = hf_tensors(&t, false, "model.", false, true);
    save(input, &floats_to_raw(&src, Dtype::F32), 1);
    write_json(&input.join("config.json"), &t.qwen3_config());
    (t, src)
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}
