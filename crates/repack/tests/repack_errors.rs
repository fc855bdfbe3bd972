//! Each kind of bad checkpoint is a clear error naming what is wrong, and
//! leaves no output behind.

mod common;

use std::path::Path;

use common::*;
use safetensors::Dtype;
use serde_json::json;
use slipstream_repack::*;

// ------------------------------------------------------------ errors

fn err_of(input: &Path, out: &Path) -> String {
    let e = run(input, out, QuantChoice::Q4).expect_err("repack should fail");
    assert!(!out.exists(), "no output on error");
    e.to_string()
}

fn rewrite(input: &Path, f: impl FnOnce(&mut FloatMap)) {
    let t = Tiny::qwen3();
    let mut src = hf_tensors(&t, false, "model.", false, true);
    f(&mut src);
    save(input, &floats_to_raw(&src, Dtype::F32), 1);
}

#[test]
fn error_missing_tensor_names_it() {
    let d = tmp();
    let input = d.path().join("in");
    qwen3_checkpoint(&input);
    rewrite(&input, |m| {
        m.remove("model.layers.1.self_attn.k_norm.weight");
    });
    let e = err_of(&input, &d.path().join("out"));
    assert!(
        e.contains("model.layers.1.self_attn.k_norm.weight") && e.contains("missing"),
        "{e}"
    );

    rewrite(&input, |m| {
        m.remove("model.layers.0.mlp.experts.3.down_proj.weight");
    });
    let e = err_of(&input, &d.path().join("out"));
    assert!(
        e.contains("model.layers.0.mlp.experts.3.down_proj.weight"),
        "{e}"
    );
}

#[test]
fn error_wrong_shape_names_tensor_and_shapes() {
    let d = tmp();
    let input = d.path().join("in");
    qwen3_checkpoint(&input);
    rewrite(&input, |m| {
        m.insert(
            "model.layers.1.self_attn.q_proj.weight".into(),
            (vec![10, 64], values("x", 640)),
        );
    });
    let e = err_of(&input, &d.path().join("out"));
    assert!(e.contains("model.layers.1.self_attn.q_proj.weight"), "{e}");
    assert!(e.contains("[64, 64]") && e.contains("[10, 64]"), "{e}");
}

#[test]
fn error_unknown_architecture() {
    let d = tmp();
    let input = d.path().join("in");
    qwen3_checkpoint(&input);
    let mut cfg = Tiny::qwen3().qwen3_config();
    cfg["model_type"] = json!("llama");
    write_json(&input.join("config.json"), &cfg);
    let e = err_of(&input, &d.path().join("out"));
    assert!(
        e.contains("\"llama\"") && e.contains("qwen3_5_moe") && e.contains("qwen3_moe"),
        "{e}"
    );
}

#[test]
fn error_truncated_safetensors() {
    let d = tmp();
    let input = d.path().join("in");
    qwen3_checkpoint(&input);
    let f = input.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let e = err_of(&input, &d.path().join("out"));
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
    // Garbage header too.
    std::fs::write(&f, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!").unwrap();
    let e = err_of(&input, &d.path().join("out"));
    assert!(
        e.contains("model.safetensors") && e.contains("corrupt"),
        "{e}"
    );
}

#[test]
fn error_unsupported_dtype() {
    let d = tmp();
    let input = d.path().join("in");
    let (t, src) = qwen3_checkpoint(&input);
    let _ = t;
    let mut raw = floats_to_raw(&src, Dtype::F32);
    let name = "model.layers.0.input_layernorm.weight".to_string();
    let r = raw.get_mut(&name).unwrap();
    r.dtype = Dtype::I32; // same byte size, wrong type
    save(&input, &raw, 1);
    let e = err_of(&input, &d.path().join("out"));
    assert!(e.contains(&name) && e.contains("I32"), "{e}");

    let r = raw.get_mut(&name).unwrap();
    r.dtype = Dtype::F64;
    r.data.extend(vec![0u8; r.data.len()]);
    save(&input, &raw, 1);
    let e = err_of(&input, &d.path().join("out"));
    assert!(e.contains(&name) && e.contains("F64"), "{e}");
}

#[test]
fn error_unsupported_config_features() {
    let d = tmp();
    let input = d.path().join("in");
    qwen3_checkpoint(&input);
    let base = Tiny::qwen3().qwen3_config();
    for (key, val, needle) in [
        ("mlp_only_layers", json!([1]), "mlp_only_layers"),
        ("decoder_sparse_step", json!(2), "decoder_sparse_step"),
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 4.0}),
            "yarn",
        ),
    ] {
        let mut cfg = base.clone();
        cfg[key] = val;
        write_json(&input.join("config.json"), &cfg);
        let e = err_of(&input, &d.path().join("out"));
        assert!(e.contains(needle) && e.contains("unsupported"), "{e}");
    }
    // Missing config field.
    let mut cfg = base.clone();
    cfg.as_object_mut().unwrap().remove("hidden_size");
    write_json(&input.join("config.json"), &cfg);
    let e = err_of(&input, &d.path().join("out"));
    assert!(
        e.contains("hidden_size") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn error_no_checkpoint_files() {
    let d = tmp();
    let input = d.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    let e = err_of(&input, &d.path().join("out"));
    assert!(e.contains("config.json"), "{e}");
    write_json(&input.join("config.json"), &Tiny::qwen3().qwen3_config());
    let e = err_of(&input, &d.path().join("out"));
    assert!(e.contains("safetensors"), "{e}");
}

#[test]
fn error_bad_generation_config_value_names_it() {
    let d = tmp();
    let input = d.path().join("in");
    let t = Tiny::qwen3();
    save(
        &input,
        &floats_to_raw(&hf_tensors(&t, false, "model.", false, true), Dtype::F32),
        1,
    );
    write_json(&input.join("config.json"), &t.qwen3_config());
    write_tokenizer_files(&input);
    write_json(
        &input.join("generation_config.json"),
        &serde_json::json!({"top_p": 1.5}),
    );
    let e = err_of(&input, &d.path().join("out"));
    assert!(
        e.contains("generation_config.json") && e.contains("top_p"),
        "{e}"
    );
}
