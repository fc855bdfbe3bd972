//! Checkpoints a hostile or broken source produces: non-finite weights,
//! invalid config values, counts that would allocate without bound. Each is
//! a clear error naming the tensor or key, before anything is written.

mod common;

use std::path::Path;

use common::*;
use safetensors::Dtype;
use serde_json::Value;
use slipstream_repack::*;

fn repack_to(input: &Path, output: &Path) -> std::result::Result<RepackReport, String> {
    repack(
        &RepackOptions {
            input: input.to_path_buf(),
            output: output.to_path_buf(),
            overwrite: Default::default(),
            quant: QuantChoice::Q4,
            ggml_to_affine: false,
        },
        &|_| {},
    )
    .map_err(|e| e.to_string())
}

#[test]
fn non_finite_weights_are_refused_by_name() {
    for (value, dtype) in [(f32::NAN, Dtype::F32), (f32::INFINITY, Dtype::BF16)] {
        let d = tempfile::tempdir().unwrap();
        let input = d.path().join("in");
        let t = Tiny::qwen3();
        let mut src = hf_tensors(&t, false, "model.", false, true);
        let name = "model.layers.1.self_attn.o_proj.weight".to_string();
        src.get_mut(&name).expect("tensor in the fixture").1[5] = value;
        save(&input, &floats_to_raw(&src, dtype), 1);
        write_json(&input.join("config.json"), &t.qwen3_config());
        let out = d.path().join("m.slip");
        let e = repack_to(&input, &out).unwrap_err();
        assert!(
            e.contains("o_proj") && e.contains("not a finite number"),
            "{e}"
        );
        assert!(!out.exists());
    }
}

#[test]
fn invalid_or_unbounded_config_values_are_refused_by_key() {
    let cases: [(&str, Value, &str); 4] = [
        ("rms_norm_eps", Value::from(-1.0), "rms_norm_eps"),
        (
            "num_hidden_layers",
            Value::from(1u64 << 40),
            "num_hidden_layers",
        ),
        (
            "num_hidden_layers",
            Value::from(u64::MAX),
            "num_hidden_layers",
        ),
        ("rope_theta", Value::from(0.0), "rope_theta"),
    ];
    for (key, value, named) in cases {
        let d = tempfile::tempdir().unwrap();
        let input = d.path().join("in");
        let t = Tiny::qwen3();
        let src = hf_tensors(&t, false, "model.", false, true);
        save(&input, &floats_to_raw(&src, Dtype::F32), 1);
        let mut cfg = t.qwen3_config();
        cfg[key] = value;
        write_json(&input.join("config.json"), &cfg);
        let e = repack_to(&input, &d.path().join("m.slip")).unwrap_err();
        assert!(e.contains(named), "{key}: {e}");
    }
}

#[test]
fn a_file_that_is_not_gguf_is_named_as_such() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("model.gguf");
    std::fs::write(&input, b"GGUX and then some bytes that are not a model").unwrap();
    let out = d.path().join("m.slip");
    let e = repack_to(&input, &out).unwrap_err();
    assert!(
        e.contains("model.gguf") && e.contains("not a GGUF file"),
        "{e}"
    );
    assert!(!e.contains("config.json"), "{e}");
    assert!(!out.exists());
}
