//! Writes a synthetic sharded Hugging Face `qwen3_moe` checkpoint of about a
//! requested size, for measuring repack throughput (see `repack_bench`).
//!
//! ```text
//! cargo run --release -p slipstream-repack --example synth_checkpoint -- \
//!     --output DIR [--gb 1.5] [--dtype bf16|f32]
//! ```
//!
//! Shapes: hidden 1024, 64 experts of intermediate 512 (per expert
//! `gate_proj`/`up_proj`/`down_proj`), 8 query / 2 KV heads of 128, vocab
//! 32768, untied `lm_head`. The layer count is chosen to reach the requested
//! size (with fewer experts, down to 8, when even one layer is too big; the
//! embedding and `lm_head` alone are 134 MB in bf16). Each layer is
//! one shard, and the embedding, `lm_head` and final norm one more; tensors
//! are generated and written in chunks, so memory stays at a few MB whatever
//! the size. Values are deterministic pseudo-random numbers in [-1, 1).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use half::bf16;
use serde_json::{json, Value};

const HIDDEN: usize = 1024;
const INTER: usize = 512;
const MAX_EXPERTS: usize = 64;
const TOP_K: usize = 8;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 128;
const VOCAB: usize = 32768;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Dt {
    Bf16,
    F32,
}

impl Dt {
    fn size(self) -> usize {
        match self {
            Dt::Bf16 => 2,
            Dt::F32 => 4,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Dt::Bf16 => "BF16",
            Dt::F32 => "F32",
        }
    }
}

/// Writes a synthetic sharded `qwen3_moe` checkpoint of about `--gb` GB.
#[derive(clap::Parser)]
struct Args {
    /// The checkpoint folder to write.
    #[arg(short, long)]
    output: PathBuf,
    /// About how many gigabytes (10^9 bytes) to write.
    #[arg(long, default_value_t = 1.5, value_parser = positive_gb)]
    gb: f64,
    /// The tensors' storage type.
    #[arg(long, value_enum, default_value = "bf16", ignore_case = true)]
    dtype: Dt,
}

fn positive_gb(v: &str) -> Result<f64, String> {
    v.parse()
        .ok()
        .filter(|g: &f64| g.is_finite() && *g > 0.0)
        .ok_or_else(|| format!("expected a positive number, found {v:?}"))
}

/// Layer count and expert count for about `target` bytes.
fn plan(target: f64, dt: Dt) -> (usize, usize) {
    let s = dt.size() as f64;
    let outer = (2 * VOCAB * HIDDEN + HIDDEN) as f64 * s;
    let attn = (HIDDEN * HEADS * HEAD_DIM * 2 + 2 * HIDDEN * KV_HEADS * HEAD_DIM) as f64;
    let dense = (attn + (2 * HIDDEN + 2 * HEAD_DIM) as f64) * s;
    let per_expert = (3 * INTER * HIDDEN) as f64 * s;
    let layer = |e: usize| dense + (e * HIDDEN) as f64 * s + e as f64 * per_expert;
    let layers = ((target - outer) / layer(MAX_EXPERTS)).round().max(1.0) as usize;
    if layers > 1 {
        return (layers, MAX_EXPERTS);
    }
    let e = ((target - outer - dense) / (per_expert + (HIDDEN as f64) * s)).round() as isize;
    (1, e.clamp(TOP_K as isize, MAX_EXPERTS as isize) as usize)
}

/// Deterministic pseudo-random values in [-1, 1), seeded from a name.
struct Gen(u64);

impl Gen {
    fn new(name: &str) -> Gen {
        let mut s: u64 = 0xcbf29ce484222325;
        for b in name.bytes() {
            s = (s ^ b as u64).wrapping_mul(0x100000001b3);
        }
        Gen(s | 1)
    }
    fn next(&mut self) -> f32 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

struct Tensor {
    name: String,
    shape: Vec<usize>,
}

impl Tensor {
    fn new(name: String, shape: &[usize]) -> Tensor {
        Tensor {
            name,
            shape: shape.to_vec(),
        }
    }
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Streams `tensors` into a safetensors file; returns the data bytes written.
fn write_shard(path: &Path, tensors: &[Tensor], dt: Dt) -> std::io::Result<u64> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut off = 0usize;
    for t in tensors {
        let end = off + t.len() * dt.size();
        header.insert(
            t.name.clone(),
            json!({"dtype": dt.name(), "shape": t.shape, "data_offsets": [off, end]}),
        );
        off = end;
    }
    let mut head = serde_json::to_vec(&Value::Object(header))?;
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let mut w = BufWriter::with_capacity(1 << 20, File::create(path)?);
    w.write_all(&(head.len() as u64).to_le_bytes())?;
    w.write_all(&head)?;
    const CHUNK: usize = 1 << 18;
    let mut buf = Vec::with_capacity(CHUNK * 4);
    for t in tensors {
        let mut g = Gen::new(&t.name);
        let mut left = t.len();
        while left > 0 {
            let n = left.min(CHUNK);
            buf.clear();
            match dt {
                Dt::Bf16 => {
                    for _ in 0..n {
                        buf.extend_from_slice(&bf16::from_f32(g.next()).to_bits().to_le_bytes());
                    }
                }
                Dt::F32 => {
                    for _ in 0..n {
                        buf.extend_from_slice(&g.next().to_le_bytes());
                    }
                }
            }
            w.write_all(&buf)?;
            left -= n;
        }
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(off as u64)
}

fn layer_tensors(l: usize, experts: usize) -> Vec<Tensor> {
    let p = format!("model.layers.{l}.");
    let h = HIDDEN;
    let mut v = vec![
        Tensor::new(format!("{p}input_layernorm.weight"), &[h]),
        Tensor::new(format!("{p}post_attention_layernorm.weight"), &[h]),
        Tensor::new(
            format!("{p}self_attn.q_proj.weight"),
            &[HEADS * HEAD_DIM, h],
        ),
        Tensor::new(
            format!("{p}self_attn.k_proj.weight"),
            &[KV_HEADS * HEAD_DIM, h],
        ),
        Tensor::new(
            format!("{p}self_attn.v_proj.weight"),
            &[KV_HEADS * HEAD_DIM, h],
        ),
        Tensor::new(
            format!("{p}self_attn.o_proj.weight"),
            &[h, HEADS * HEAD_DIM],
        ),
        Tensor::new(format!("{p}self_attn.q_norm.weight"), &[HEAD_DIM]),
        Tensor::new(format!("{p}self_attn.k_norm.weight"), &[HEAD_DIM]),
        Tensor::new(format!("{p}mlp.gate.weight"), &[experts, h]),
    ];
    for e in 0..experts {
        let q = format!("{p}mlp.experts.{e}.");
        v.push(Tensor::new(format!("{q}gate_proj.weight"), &[INTER, h]));
        v.push(Tensor::new(format!("{q}up_proj.weight"), &[INTER, h]));
        v.push(Tensor::new(format!("{q}down_proj.weight"), &[h, INTER]));
    }
    v
}

fn write_json(path: &Path, v: &Value) -> std::io::Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(v)?)
}

fn run(args: &Args) -> std::io::Result<()> {
    let (layers, experts) = plan(args.gb * 1e9, args.dtype);
    let dir = &args.output;
    std::fs::create_dir_all(dir)?;
    let start = std::time::Instant::now();
    let shards = layers + 1;
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    let mut count = 0usize;
    for s in 0..shards {
        let tensors = if s < layers {
            layer_tensors(s, experts)
        } else {
            vec![
                Tensor::new("model.embed_tokens.weight".into(), &[VOCAB, HIDDEN]),
                Tensor::new("model.norm.weight".into(), &[HIDDEN]),
                Tensor::new("lm_head.weight".into(), &[VOCAB, HIDDEN]),
            ]
        };
        let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, shards);
        let bytes = write_shard(&dir.join(&file), &tensors, args.dtype)?;
        eprintln!(
            "  {file}: {} tensors, {:.1} MB",
            tensors.len(),
            bytes as f64 / 1e6
        );
        total += bytes;
        count += tensors.len();
        for t in &tensors {
            weight_map.insert(t.name.clone(), json!(file));
        }
    }
    write_json(
        &dir.join("model.safetensors.index.json"),
        &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
    )?;
    write_json(
        &dir.join("config.json"),
        &json!({
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "torch_dtype": if args.dtype == Dt::Bf16 { "bfloat16" } else { "float32" },
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": layers,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": false,
            "rope_theta": 1e6,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": INTER,
            "num_experts": experts,
            "num_experts_per_tok": TOP_K,
            "norm_topk_prob": true,
            "eos_token_id": 2,
        }),
    )?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {}: qwen3_moe {} checkpoint, {layers} layers x {experts} experts, {shards} shards, \
         {count} tensors, {:.3} GB of tensor data in {secs:.1} s",
        dir.display(),
        args.dtype.name().to_ascii_lowercase(),
        total as f64 / 1e9,
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = <Args as clap::Parser>::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: writing {}: {e}", args.output.display());
            ExitCode::FAILURE
        }
    }
}
