//! Synthetic models as GGUF files that llama.cpp loads (`qwen35moe`,
//! `qwen3next`, `qwen3moe`), and the GGML Q4_0 generator they share with `.slip`
//! (`--format slip --quant q4_0` writes the very same tensor bytes).
//!
//! The file is what llama.cpp's `convert_hf_to_gguf.py` followed by a Q4_0
//! quantization would hold for these weights: norms as stored (`1 + w` for
//! qwen3.5, our canonical form already), `ssm_a = -exp(A_log)`, conv
//! `[K, conv_dim]`, and for qwen35moe the linear-attention value heads in
//! llama.cpp's tiled order (V rows of `attn_qkv`, rows of `attn_gate`,
//! `ssm_beta`, `ssm_alpha`, entries of `ssm_a` and `ssm_dt.bias`, V channels
//! of `ssm_conv1d`, and the columns of `ssm_out`, which move as whole Q4_0
//! blocks since a value head spans whole blocks). Experts are the stacked
//! `ffn_{gate,up,down}_exps` tensors. Matrices are Q4_0; norms, conv, `ssm_a`,
//! `ssm_dt.bias` and the routers (`ffn_gate_inp`, `ffn_gate_inp_shexp`) are
//! f32, as llama.cpp's quantizer keeps them. qwen3next keeps transformers'
//! head order (no tiling) and fuses b and a into `ssm_ba` (`[b r, a r]`
//! rows per key head, as the converter leaves `in_proj_ba`). A synthetic gpt2-style
//! tokenizer of `vocab_size` tokens (256 byte tokens, letter words built by
//! merges, three ChatML specials at the end) is included.
//!
//! Importing the file back (`slipstream repack`) gives the `.slip` written
//! with [`SynthQuant::Q4_0`] byte for byte, except `A_log`, which comes back
//! as `ln(exp(A_log))` (within an ulp).

use std::time::Instant;

use half::f16;
use rayon::prelude::*;
use slipstream_core::config::LayerKind;
use slipstream_core::schema::{self, TensorKind, TensorSpec};
use slipstream_core::{Architecture, ModelConfig, QuantType};
use slipstream_gguf::{GgmlType, GgufWriter, TensorDecl, Value, ValueType};

use crate::gen::{row_rng, Group, GROUP};
use crate::{check, Dense, Gen, SynthError, SynthEvent, SynthOptions, SynthQuant, SynthReport};

/// Standard deviation of a uniform 4-bit code.
const CODE_STD_4: f32 = 4.609_772;

/// Runs `work` on each `(row index, row)` of `out`, rows `row_bytes` long,
/// in parallel when `parallel` (each row draws from its own stream, so the
/// bytes never depend on threading).
fn for_each_row(
    out: &mut [u8],
    row_bytes: usize,
    parallel: bool,
    work: impl Fn((usize, &mut [u8])) + Sync + Send,
) {
    if parallel {
        out.par_chunks_mut(row_bytes).enumerate().for_each(work);
    } else {
        out.chunks_mut(row_bytes).enumerate().for_each(work);
    }
}

/// A `[rows, cols]` GGML Q4_0 tensor (blocks of 32: f16 `d`, 16 bytes of
/// nibbles; element `j` in the low nibble of byte `j`, `j + 16` in the high
/// one; value `d * (q - 8)`), group `g` of 64 columns of row `r` given by
/// `spec(r, g)` like [`crate::gen::affine`]. `First(v)` is exact up to f16.
pub fn q4_0(
    rows: usize,
    cols: usize,
    seed: u64,
    parallel: bool,
    spec: &(dyn Fn(usize, usize) -> Group + Sync),
) -> Vec<u8> {
    assert!(cols % GROUP == 0, "cols {cols} not a multiple of 64");
    let row_bytes = cols / 32 * 18;
    let mut out = vec![0u8; rows * row_bytes];
    let work = |(r, row): (usize, &mut [u8])| {
        let mut rng = row_rng(seed, r);
        for (g, blocks) in row.chunks_exact_mut(36).enumerate() {
            let spec = spec(r, g);
            for (b, blk) in blocks.chunks_exact_mut(18).enumerate() {
                let (d, qs) = blk.split_at_mut(2);
                let dv = match spec {
                    Group::Rand(std) => {
                        rng.fill_bytes(qs);
                        let x = rng.next_u64();
                        let jitter = 0.75 + 0.5 * ((x >> 11) as f32 / (1u64 << 53) as f32);
                        let sign = if x & 1 == 0 { 1.0 } else { -1.0 };
                        sign * jitter * std / CODE_STD_4
                    }
                    Group::Zero => {
                        qs.fill(0x88);
                        0.0
                    }
                    Group::First(v) => {
                        qs.fill(0x88);
                        if b == 0 {
                            qs[0] = 0x80; // element 0 at code 0: value -8 d = v
                            -v / 8.0
                        } else {
                            0.0
                        }
                    }
                };
                d.copy_from_slice(&f16::from_f32(dv).to_le_bytes());
            }
        }
    };
    for_each_row(&mut out, row_bytes, parallel, work);
    out
}

/// A `[rows, cols]` f32 tensor with the same group semantics (random groups
/// uniform with standard deviation `std`).
pub fn f32_matrix(
    rows: usize,
    cols: usize,
    seed: u64,
    parallel: bool,
    spec: &(dyn Fn(usize, usize) -> Group + Sync),
) -> Vec<u8> {
    assert!(cols % GROUP == 0, "cols {cols} not a multiple of 64");
    let mut out = vec![0u8; rows * cols * 4];
    let work = |(r, row): (usize, &mut [u8])| {
        let mut rng = row_rng(seed, r);
        for (g, grp) in row.chunks_exact_mut(GROUP * 4).enumerate() {
            let mut vals = [0f32; GROUP];
            match spec(r, g) {
                Group::Rand(std) => {
                    let a = std * 3f32.sqrt();
                    for v in vals.iter_mut() {
                        *v = (2.0 * rng.uniform() - 1.0) * a;
                    }
                }
                Group::Zero => {}
                Group::First(v) => vals[0] = v,
            }
            for (o, v) in grp.chunks_exact_mut(4).zip(vals) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
    };
    for_each_row(&mut out, cols * 4, parallel, work);
    out
}

/// Tiled position `p` of llama.cpp's value-head order holds grouped head
/// `(p % nk) * r + p / nk` (the converter's `_reorder_v_heads`).
fn tile_heads(nk: usize, r: usize) -> Vec<usize> {
    (0..nk * r).map(|p| (p % nk) * r + p / nk).collect()
}

/// Rows `start..` in whole heads of `d` rows, permuted to tiled order.
fn tile_rows(
    bytes: &[u8],
    row_bytes: usize,
    start: usize,
    nk: usize,
    r: usize,
    d: usize,
) -> Vec<u8> {
    let mut out = bytes[..start * row_bytes].to_vec();
    let hb = d * row_bytes;
    let base = start * row_bytes;
    for s in tile_heads(nk, r) {
        out.extend_from_slice(&bytes[base + s * hb..base + (s + 1) * hb]);
    }
    out.extend_from_slice(&bytes[base + nk * r * hb..]);
    out
}

fn ggml(q: QuantType) -> GgmlType {
    match q {
        QuantType::Q4_0 => GgmlType::Q4_0,
        QuantType::F32 => GgmlType::F32,
        other => unreachable!(
            "synthetic GGUF tensors are Q4_0 or f32, not {}",
            other.name()
        ),
    }
}

/// GGUF name (the importer's, [`slipstream_repack::gguf_tensor_name`])
/// and ggml dims of a canonical dense tensor: `[cols, rows]`, or `[n]` for
/// a vector.
fn gguf_name(cfg: &ModelConfig, t: &TensorSpec) -> crate::Result<(String, Vec<u64>)> {
    let name = slipstream_repack::gguf_tensor_name(cfg, t).ok_or_else(|| {
        SynthError::Invalid(format!("no GGUF name for canonical tensor {}", t.name))
    })?;
    let [rows, cols] = t.shape.map(|x| x as u64);
    let one_dim = matches!(t.key, "moe.shared_gate" | "gdn.A_log" | "gdn.dt_bias")
        || t.kind == TensorKind::Norm;
    Ok((
        name,
        if one_dim {
            vec![cols]
        } else {
            vec![cols, rows]
        },
    ))
}

/// qwen3next: replaces a layer's `gdn.in_proj_b` and `gdn.in_proj_a` by
/// one tensor (at b's place) with their rows interleaved as `ssm_ba`
/// holds them ([`slipstream_repack::qwen3next_ba_rows`]); no-op for a
/// full-attention layer.
fn fuse_ba(cfg: &ModelConfig, layer: &mut Vec<Dense>) -> crate::Result<()> {
    let at = |key: &str| layer.iter().position(|d| d.name.ends_with(key));
    let (Some(ib), Some(ia)) = (at("gdn.in_proj_b"), at("gdn.in_proj_a")) else {
        return Ok(());
    };
    let a = layer.remove(ia);
    let b = &mut layer[if ia < ib { ib - 1 } else { ib }];
    if a.qtype != b.qtype || a.shape != b.shape {
        return Err(SynthError::Invalid(format!(
            "{} and {} differ in type or shape",
            b.name, a.name
        )));
    }
    let row = b.qtype.nbytes(1, b.shape[1]);
    let mut fused = vec![0u8; 2 * b.bytes.len()];
    for (src, is_b) in [(&b.bytes, true), (&a.bytes, false)] {
        for (j, &to) in slipstream_repack::qwen3next_ba_rows(cfg, is_b)
            .iter()
            .enumerate()
        {
            fused[to * row..(to + 1) * row].copy_from_slice(&src[j * row..(j + 1) * row]);
        }
    }
    b.bytes = fused;
    b.shape[0] *= 2;
    Ok(())
}

/// Applies the converter's value changes to one canonical tensor.
fn forward(cfg: &ModelConfig, d: Dense) -> Vec<u8> {
    let base = d.name.rsplit_once("gdn.").map(|(_, b)| b);
    let Some(base) = base else { return d.bytes };
    if cfg.architecture == Architecture::Qwen3Next {
        // Heads in transformers' order: only `ssm_a = -exp(A_log)`.
        if base != "A_log" {
            return d.bytes;
        }
        return d
            .bytes
            .chunks_exact(4)
            .flat_map(|c| (-f32::from_le_bytes([c[0], c[1], c[2], c[3]]).exp()).to_le_bytes())
            .collect();
    }
    let (nk, nv, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
    );
    let r = nv / nk.max(1);
    let row_bytes = d.qtype.nbytes(1, d.shape[1]);
    let qk = 2 * nk * cfg.linear_key_head_dim;
    let f32s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let to_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    match base {
        "in_proj_qkv" | "conv" => tile_rows(&d.bytes, row_bytes, qk, nk, r, dv),
        "in_proj_z" => tile_rows(&d.bytes, row_bytes, 0, nk, r, dv),
        "in_proj_b" | "in_proj_a" => tile_rows(&d.bytes, row_bytes, 0, nk, r, 1),
        "A_log" | "dt_bias" => {
            let mut v = f32s(&d.bytes);
            if base == "A_log" {
                v = v.iter().map(|a| -a.exp()).collect();
            }
            let t: Vec<f32> = tile_heads(nk, r).iter().map(|&s| v[s]).collect();
            to_bytes(&t)
        }
        "out_proj" => {
            // Columns in whole value heads: dv / 32 Q4_0 blocks (or dv f32s).
            let per_head = d.qtype.nbytes(1, dv);
            let mut out = Vec::with_capacity(d.bytes.len());
            for row in d.bytes.chunks_exact(row_bytes) {
                for s in tile_heads(nk, r) {
                    out.extend_from_slice(&row[s * per_head..(s + 1) * per_head]);
                }
            }
            out
        }
        _ => d.bytes,
    }
}

/// GPT-2's byte-to-unicode map: the token string of each byte.
fn byte_tokens() -> Vec<String> {
    let mut bs: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![String::new(); 256];
    for (b, c) in bs.iter().zip(cs) {
        out[*b as usize] = char::from_u32(c).map(String::from).unwrap_or_default();
    }
    out
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// (tokens, token types, merges) of a synthetic byte-level BPE vocabulary.
fn vocab(n: usize) -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens = byte_tokens();
    let mut merges = Vec::new();
    let words = n.saturating_sub(256 + SPECIALS.len());
    let letters: Vec<char> = ('a'..='z').collect();
    let mut prev: Vec<String> = letters.iter().map(|c| c.to_string()).collect();
    'outer: while merges.len() < words {
        let mut next = Vec::new();
        for p in &prev {
            for c in &letters {
                if merges.len() >= words {
                    break 'outer;
                }
                let w = format!("{p}{c}");
                merges.push(format!("{p} {c}"));
                tokens.push(w.clone());
                next.push(w);
            }
        }
        prev = next;
    }
    tokens.truncate(n.saturating_sub(SPECIALS.len()));
    let mut types = vec![1i32; tokens.len()];
    for s in SPECIALS {
        tokens.push(s.to_string());
        types.push(3);
    }
    (tokens, types, merges)
}

fn metadata(cfg: &ModelConfig, name: &str) -> Vec<(String, Value)> {
    let qwen35 = cfg.architecture.is_hybrid();
    let a = match cfg.architecture {
        Architecture::Qwen35Moe => "qwen35moe",
        Architecture::Qwen3Next => "qwen3next",
        Architecture::Qwen3Moe => "qwen3moe",
    };
    let u = |v: usize| Value::U32(v as u32);
    let mut m: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.into())),
    ];
    let mut k = |key: &str, v: Value| m.push((format!("{a}.{key}"), v));
    // llama.cpp's converter counts MTP layers as blocks and names how many.
    k("block_count", u(cfg.total_layers()));
    if cfg.mtp_num_layers > 0 {
        k("nextn_predict_layers", u(cfg.mtp_num_layers));
    }
    k("context_length", u(cfg.max_position_embeddings));
    k("embedding_length", u(cfg.hidden_size));
    k("attention.head_count", u(cfg.num_attention_heads));
    k("attention.head_count_kv", u(cfg.num_key_value_heads));
    k("rope.freq_base", Value::F32(cfg.rope_theta as f32));
    k(
        "attention.layer_norm_rms_epsilon",
        Value::F32(cfg.rms_norm_eps),
    );
    k("expert_count", u(cfg.num_experts));
    k("expert_used_count", u(cfg.num_experts_per_tok));
    k("attention.key_length", u(cfg.head_dim));
    k("attention.value_length", u(cfg.head_dim));
    k("expert_feed_forward_length", u(cfg.moe_intermediate_size));
    // qwen3next's plain RoPE has no multimodal sections.
    if cfg.architecture == Architecture::Qwen35Moe {
        let pairs = (cfg.rotary_dim / 2) as i32;
        let sections = if pairs == 32 {
            [11, 11, 10, 0]
        } else {
            [pairs - 2 * (pairs / 3), pairs / 3, pairs / 3, 0]
        };
        k(
            "rope.dimension_sections",
            Value::Array {
                ty: ValueType::I32,
                items: sections.iter().map(|&x| Value::I32(x)).collect(),
            },
        );
    }
    if qwen35 {
        k(
            "expert_shared_feed_forward_length",
            u(cfg.shared_expert_intermediate_size),
        );
        k("ssm.conv_kernel", u(cfg.linear_conv_kernel));
        k("ssm.state_size", u(cfg.linear_key_head_dim));
        k("ssm.group_count", u(cfg.linear_num_key_heads));
        k("ssm.time_step_rank", u(cfg.linear_num_value_heads));
        k(
            "ssm.inner_size",
            u(cfg.linear_num_value_heads * cfg.linear_value_head_dim),
        );
        k(
            "attention.recurrent_layers",
            Value::Array {
                ty: ValueType::Bool,
                items: (0..cfg.total_layers())
                    .map(|l| Value::Bool(cfg.layer_kind(l) == Some(LayerKind::LinearAttention)))
                    .collect(),
            },
        );
        let interval = cfg
            .layer_types
            .iter()
            .position(|t| *t == LayerKind::FullAttention)
            .map_or(cfg.num_layers() + 1, |p| p + 1);
        k("full_attention_interval", u(interval));
    }
    k("rope.dimension_count", u(cfg.rotary_dim));
    m.push(("general.file_type".into(), Value::U32(2))); // MOSTLY_Q4_0
    m.push(("general.quantization_version".into(), Value::U32(2)));
    let (tokens, types, merges) = vocab(cfg.vocab_size);
    let eos = tokens.len() - 1;
    let pad = tokens.len() - 3;
    m.push(("tokenizer.ggml.model".into(), Value::String("gpt2".into())));
    m.push((
        "tokenizer.ggml.pre".into(),
        Value::String(
            if cfg.architecture == Architecture::Qwen35Moe {
                "qwen35"
            } else {
                "qwen2"
            }
            .into(),
        ),
    ));
    m.push(("tokenizer.ggml.tokens".into(), Value::strings(tokens)));
    m.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array {
            ty: ValueType::I32,
            items: types.into_iter().map(Value::I32).collect(),
        },
    ));
    m.push(("tokenizer.ggml.merges".into(), Value::strings(merges)));
    m.push(("tokenizer.ggml.eos_token_id".into(), u(eos)));
    m.push(("tokenizer.ggml.padding_token_id".into(), u(pad)));
    m.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
    m.push((
        "tokenizer.chat_template".into(),
        Value::String(CHAT_TEMPLATE.into()),
    ));
    m
}

fn gguf_err(e: slipstream_gguf::GgufError) -> SynthError {
    SynthError::Invalid(e.to_string())
}

/// Writes `opts` as a Q4_0 GGUF at `opts.output` (a file, replaced
/// atomically); see the module doc.
pub fn synthesize_gguf(
    opts: &SynthOptions,
    progress: &dyn Fn(SynthEvent),
) -> crate::Result<SynthReport> {
    let t0 = Instant::now();
    let cfg = &opts.config;
    check(cfg)?;
    if cfg.layer_types.contains(&LayerKind::LinearAttention) && cfg.linear_value_head_dim % 32 != 0
    {
        return Err(SynthError::Invalid(
            "linear value head dim must be a multiple of 32".into(),
        ));
    }
    let g = Gen {
        cfg,
        seed: opts.seed,
        skew: opts.skew,
        quant: SynthQuant::Q4_0,
    };
    let n_layers = cfg.total_layers();
    let e_count = cfg.num_experts;

    // Declared in the order written: embed, per layer its dense tensors
    // then its stacked experts (ggml dims [cols, rows, E]), the output.
    let mut decls = Vec::new();
    let next = cfg.architecture == Architecture::Qwen3Next;
    let declare = |decls: &mut Vec<TensorDecl>, t: &TensorSpec| -> crate::Result<()> {
        // qwen3next: `ssm_ba` declared once, at b, twice its rows.
        if next && t.key == "gdn.in_proj_a" {
            return Ok(());
        }
        let (n, mut dims) = gguf_name(cfg, t)?;
        if next && t.key == "gdn.in_proj_b" {
            dims[1] *= 2;
        }
        decls.push(TensorDecl::new(n, &dims, ggml(g.quant.qtype_of(t.kind))));
        Ok(())
    };
    declare(&mut decls, &schema::embed_tensor(cfg))?;
    let parts = schema::expert_parts(cfg);
    for l in 0..n_layers {
        for t in schema::layer_tensors(cfg, l) {
            declare(&mut decls, &t)?;
        }
        for p in &parts {
            let [rows, cols] = p.shape.map(|x| x as u64);
            decls.push(TensorDecl::new(
                slipstream_repack::gguf_experts_name(l, p),
                &[cols, rows, e_count as u64],
                ggml(g.quant.qtype(4)),
            ));
        }
    }
    for t in schema::output_tensors(cfg) {
        declare(&mut decls, &t)?;
    }
    let total: u64 = decls
        .iter()
        .map(|d| d.ty.row_bytes(d.dims[0]).unwrap_or(0) * d.dims[1..].iter().product::<u64>())
        .sum();
    progress(SynthEvent::Started { total_bytes: total });

    let name = format!(
        "slipstream synthetic {} seed {}",
        opts.preset_name, opts.seed
    );
    let meta = metadata(cfg, &name);
    let mut w = GgufWriter::create(&opts.output, &meta, decls, opts.overwrite).map_err(gguf_err)?;
    let put = |w: &mut GgufWriter, d: Dense| -> crate::Result<()> {
        let bytes = forward(cfg, d);
        w.write(&bytes).map_err(gguf_err)?;
        progress(SynthEvent::Bytes(bytes.len() as u64));
        Ok(())
    };
    put(&mut w, g.embed())?;
    let batch = opts.batch.max(1);
    for l in 0..n_layers {
        let mut layer = g.layer(l)?;
        if next {
            fuse_ba(cfg, &mut layer)?;
        }
        for d in layer {
            put(&mut w, d)?;
        }
        for k in 0..3 {
            let mut first = 0;
            while first < e_count {
                let end = (first + batch).min(e_count);
                let parts: Vec<Vec<u8>> = (first..end)
                    .into_par_iter()
                    .map(|e| g.expert_part(l, e, k))
                    .collect();
                for p in parts {
                    w.write(&p).map_err(gguf_err)?;
                    progress(SynthEvent::Bytes(p.len() as u64));
                }
                first = end;
            }
        }
    }
    for d in g.head_tail() {
        put(&mut w, d)?;
    }
    progress(SynthEvent::Finishing);
    let bytes_out = w.finish().map_err(gguf_err)?;
    let seconds = t0.elapsed().as_secs_f64();
    Ok(SynthReport {
        bytes_out,
        dense_bytes: 0,
        expert_bytes: 0,
        seconds,
        mb_per_s: bytes_out as f64 / 1e6 / seconds.max(1e-9),
        model_hash: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_groups_decode_as_specified() {
        let spec = |r: usize, g: usize| match (r, g) {
            (0, 0) => Group::First(2.5),
            (0, _) => Group::Zero,
            _ => Group::Rand(0.1),
        };
        let b = q4_0(2, 128, 7, false, &spec);
        assert_eq!(b.len(), 2 * 4 * 18);
        let deq = |blk: &[u8]| -> Vec<f32> {
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            (0..32)
                .map(|j| {
                    let q = if j < 16 {
                        blk[2 + j] & 15
                    } else {
                        blk[2 + j - 16] >> 4
                    };
                    d * (q as f32 - 8.0)
                })
                .collect()
        };
        let row0: Vec<f32> = b[..72].chunks(18).flat_map(deq).collect();
        assert_eq!(row0[0], 2.5);
        assert!(row0[1..].iter().all(|&v| v == 0.0));
        let row1: Vec<f32> = b[72..].chunks(18).flat_map(deq).collect();
        let std = (row1.iter().map(|v| v * v).sum::<f32>() / 128.0).sqrt();
        assert!(std > 0.05 && std < 0.2, "{std}");
        assert_eq!(q4_0(2, 128, 7, true, &spec), b);
    }

    #[test]
    fn tile_order_matches_the_converter() {
        // nk = 2, r = 3: grouped [G0v0 G0v1 G0v2 G1v0 G1v1 G1v2] -> tiled
        // [G0v0 G1v0 G0v1 G1v1 G0v2 G1v2].
        assert_eq!(tile_heads(2, 3), vec![0, 3, 1, 4, 2, 5]);
    }

    #[test]
    fn synthetic_vocab_is_consistent() {
        let (t, ty, m) = vocab(1000);
        assert_eq!(t.len(), 1000);
        assert_eq!(ty.len(), 1000);
        assert_eq!(&t[997..], &SPECIALS);
        let set: std::collections::HashSet<&String> = t.iter().collect();
        assert_eq!(set.len(), 1000, "duplicate tokens");
        for merge in &m {
            let (a, b) = merge.split_once(' ').unwrap();
            assert!(set.contains(&a.to_string()) && set.contains(&b.to_string()));
            assert!(set.contains(&format!("{a}{b}")));
        }
    }
}
