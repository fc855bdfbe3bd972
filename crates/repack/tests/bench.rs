//! Repack throughput on a ~1.3 GB synthetic bf16 qwen3_moe checkpoint.
//! Ignored by default: `cargo test -p slipstream-repack --release --test bench -- --ignored --nocapture`.
//! Set `SLIP_BENCH_DIR` to keep the checkpoint somewhere other than a temp dir.

mod common;

use std::collections::BTreeMap;

use common::*;
use safetensors::Dtype;
use serde_json::json;
use slipstream_repack::*;

#[test]
#[ignore]
fn bench_repack_throughput() {
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var_os("SLIP_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let input = root.join("bench-in");
    let (h, inter, experts, layers, vocab) = (1024usize, 512usize, 64usize, 10usize, 32768usize);
    if !input.join("config.json").exists() {
        std::fs::create_dir_all(&input).unwrap();
        // One shard per layer, written as we go, so memory stays small.
        let mut map = serde_json::Map::new();
        let fill = |name: &str, shape: Vec<usize>, out: &mut BTreeMap<String, Raw>| {
            let n: usize = shape.iter().product();
            let v = values(name, n);
            out.insert(
                name.to_string(),
                Raw {
                    dtype: Dtype::BF16,
                    shape,
                    data: to_bytes(&v, Dtype::BF16),
                },
            );
        };
        for shard in 0..=layers {
            let mut raw = BTreeMap::new();
            if shard == layers {
                fill("model.embed_tokens.weight", vec![vocab, h], &mut raw);
                fill("lm_head.weight", vec![vocab, h], &mut raw);
                fill("model.norm.weight", vec![h], &mut raw);
            } else {
                let p = format!("model.layers.{shard}.");
                fill(&format!("{p}input_layernorm.weight"), vec![h], &mut raw);
                fill(
                    &format!("{p}post_attention_layernorm.weight"),
                    vec![h],
                    &mut raw,
                );
                fill(
                    &format!("{p}self_attn.q_proj.weight"),
                    vec![1024, h],
                    &mut raw,
                );
                fill(
                    &format!("{p}self_attn.k_proj.weight"),
                    vec![256, h],
                    &mut raw,
                );
                fill(
                    &format!("{p}self_attn.v_proj.weight"),
                    vec![256, h],
                    &mut raw,
                );
                fill(
                    &format!("{p}self_attn.o_proj.weight"),
                    vec![h, 1024],
                    &mut raw,
                );
                fill(&format!("{p}self_attn.q_norm.weight"), vec![128], &mut raw);
                fill(&format!("{p}self_attn.k_norm.weight"), vec![128], &mut raw);
                fill(&format!("{p}mlp.gate.weight"), vec![experts, h], &mut raw);
                for e in 0..experts {
                    fill(
                        &format!("{p}mlp.experts.{e}.gate_proj.weight"),
                        vec![inter, h],
                        &mut raw,
                    );
                    fill(
                        &format!("{p}mlp.experts.{e}.up_proj.weight"),
                        vec![inter, h],
                        &mut raw,
                    );
                    fill(
                        &format!("{p}mlp.experts.{e}.down_proj.weight"),
                        vec![h, inter],
                        &mut raw,
                    );
                }
            }
            let dir = input.join(format!("s{shard}"));
            save(&dir, &raw, 1);
            let file = format!("model-{shard:05}.safetensors");
            std::fs::rename(dir.join("model.safetensors"), input.join(&file)).unwrap();
            std::fs::remove_dir(&dir).unwrap();
            for k in raw.keys() {
                map.insert(k.clone(), json!(file));
            }
        }
        write_json(
            &input.join("model.safetensors.index.json"),
            &json!({"weight_map": map}),
        );
        write_json(
            &input.join("config.json"),
            &json!({
                "model_type": "qwen3_moe", "vocab_size": vocab, "hidden_size": h,
                "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
                "head_dim": 128, "moe_intermediate_size": inter, "num_experts": experts,
                "num_experts_per_tok": 8, "norm_topk_prob": true, "rope_theta": 1e6
            }),
        );
    }
    for quant in [
        QuantChoice::Bf16,
        QuantChoice::F32,
        QuantChoice::Q4,
        QuantChoice::Q8,
    ] {
        let out = root.join(format!("bench-{quant}.slip"));
        let r = repack(
            &RepackOptions {
                input: input.clone(),
                output: out.clone(),
                quant,
            },
            &|_| {},
        )
        .unwrap();
        eprintln!(
            "repack bf16 -> {quant}: {:.2} GB in, {:.2} GB out, {:.2} s, {:.0} MB/s",
            r.bytes_in as f64 / 1e9,
            r.bytes_out as f64 / 1e9,
            r.seconds,
            r.mb_per_s
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Single-thread cost of the conversion steps, to see what bounds a repack.
#[test]
#[ignore]
fn bench_conversion_steps() {
    let n = 1 << 24;
    let v = values("q", n);
    let bytes = to_bytes(&v, Dtype::BF16);
    let t = std::time::Instant::now();
    let mut back = vec![0f32; n];
    for (o, b) in back.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
    let dt = t.elapsed().as_secs_f64();
    eprintln!("bf16 decode: {:.0} M elem/s", n as f64 / dt / 1e6);
    for bits in [4u8, 8] {
        let t = std::time::Instant::now();
        let q = slipstream_kernels::quantize::quantize_affine(
            &back,
            n / 1024,
            1024,
            bits,
            64,
            slipstream_core::ScaleType::F16,
        );
        let dt = t.elapsed().as_secs_f64();
        eprintln!(
            "quantize q{bits}: {:.0} M elem/s ({} bytes)",
            n as f64 / dt / 1e6,
            q.len()
        );
    }
    let t = std::time::Instant::now();
    let h = xxhash_rust_free_checksum(&bytes);
    eprintln!(
        "sum {h}: {:.0} MB/s",
        bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e6
    );
}

fn xxhash_rust_free_checksum(b: &[u8]) -> u64 {
    slipstream_format::checksum(b)
}
