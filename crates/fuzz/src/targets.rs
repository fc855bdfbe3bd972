//! The fuzz targets: each reader of untrusted bytes, fed through the same
//! entry point the program uses (a file it opens, a body it parses). An
//! error is the right answer to a broken input; a panic, an abort or a
//! hang is a finding.

use std::path::{Path, PathBuf};

use slipstream_engine::{Engine, EngineConfig, SnapshotExpect, StoreChoice};
use slipstream_format::{Manifest, SlipModel};

/// Feeds one input to a reader; `Err` only for a failure of the harness
/// itself (a scratch file it could not write).
pub type Runner = Box<dyn FnMut(&[u8]) -> std::io::Result<()>>;

/// One reader under test.
pub struct Target {
    pub name: &'static str,
    /// Inputs the mutations start from.
    pub seeds: Vec<Vec<u8>>,
    /// The input is text (JSON and the like): text edits apply.
    pub text: bool,
    /// Most edits land in the first this many bytes (the header).
    pub focus: usize,
    pub run: Runner,
}

/// The repository root (committed fixtures).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(path: &str) -> std::io::Result<Vec<u8>> {
    let p = root().join(path);
    std::fs::read(&p).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))
}

/// Every target, their scratch files under `work`.
pub fn all(work: &Path) -> Result<Vec<Target>, String> {
    let s = |e: &dyn std::fmt::Display| e.to_string();
    // One repacked model for the readers that need one.
    let model = work.join("model.slip");
    slipstream_repack::repack(
        &slipstream_repack::RepackOptions {
            input: root().join("tests/fixtures/qwen3_moe"),
            output: model.clone(),
            overwrite: Default::default(),
            quant: slipstream_repack::QuantChoice::Q4,
            ggml_to_affine: false,
        },
        &|_| {},
    )
    .map_err(|e| s(&e))?;
    Ok(vec![
        gguf(work).map_err(|e| s(&e))?,
        safetensors(work).map_err(|e| s(&e))?,
        config(work).map_err(|e| s(&e))?,
        manifest(work, &model).map_err(|e| s(&e))?,
        snapshot(work, &model)?,
        prompt_cache(work, &model)?,
        route_trace(work).map_err(|e| s(&e))?,
        openai_request()?,
        anthropic_request()?,
        responses_request()?,
    ])
}

fn gguf(work: &Path) -> std::io::Result<Target> {
    let path = work.join("fuzz.gguf");
    Ok(Target {
        name: "gguf",
        seeds: vec![
            fixture("tests/fixtures/gguf_qwen3moe_q4_0/model.gguf")?,
            fixture("tests/fixtures/gguf_qwen35moe_q8_0/model.gguf")?,
        ],
        text: false,
        focus: 16 << 10,
        run: Box::new(move |bytes| {
            std::fs::write(&path, bytes)?;
            if let Ok(f) = slipstream_gguf::GgufFile::open(&path) {
                for (k, _) in &f.metadata {
                    let _ = f.get(k);
                }
                for t in &f.tensors {
                    let _ = (f.data(t).len(), t.rows(), t.cols(), t.row_bytes());
                }
            }
            Ok(())
        }),
    })
}

fn safetensors(work: &Path) -> std::io::Result<Target> {
    let dir = work.join("safetensors");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("config.json"),
        fixture("tests/fixtures/qwen3_moe/config.json")?,
    )?;
    let file = dir.join("model.safetensors");
    Ok(Target {
        name: "safetensors",
        seeds: vec![fixture("tests/fixtures/qwen3_moe/model.safetensors")?],
        text: false,
        focus: 8 << 10,
        run: Box::new(move |bytes| {
            std::fs::write(&file, bytes)?;
            let _ = slipstream_repack::read_checkpoint_tensors(&dir);
            Ok(())
        }),
    })
}

fn config(work: &Path) -> std::io::Result<Target> {
    let dir = work.join("config");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("config.json");
    let seeds = [
        "models/demo/config.json",
        "tests/fixtures/qwen3_moe/config.json",
        "tests/fixtures/qwen3_5_moe_fused/config.json",
        "tests/fixtures/qwen3_5_moe_mlx4/config.json",
    ]
    .iter()
    .map(|p| fixture(p))
    .collect::<std::io::Result<Vec<_>>>()?;
    Ok(Target {
        name: "config",
        seeds,
        text: true,
        focus: usize::MAX,
        run: Box::new(move |bytes| {
            std::fs::write(&file, bytes)?;
            let _ = slipstream_repack::read_checkpoint_config(&dir);
            Ok(())
        }),
    })
}

/// `manifest.json` of a copy of `model`; half the mutants have their
/// checksum and hash recomputed, so the checks behind them are reached.
fn manifest(work: &Path, model: &Path) -> std::io::Result<Target> {
    let dir = work.join("manifest.slip");
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(model)? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.join(entry.file_name()))?;
    }
    let file = dir.join("manifest.json");
    let seed = std::fs::read(&file)?;
    let mut reseal = false;
    Ok(Target {
        name: "manifest",
        seeds: vec![seed],
        text: true,
        focus: usize::MAX,
        run: Box::new(move |bytes| {
            reseal = !reseal;
            let sealed = if reseal {
                serde_json::from_slice::<Manifest>(bytes).ok().map(|mut m| {
                    m.model_hash = m.content_hash();
                    m.manifest_checksum = m.self_checksum();
                    serde_json::to_vec_pretty(&m).unwrap_or_default()
                })
            } else {
                None
            };
            std::fs::write(&file, sealed.as_deref().unwrap_or(bytes))?;
            if let Ok(m) = SlipModel::open(&dir) {
                for d in &m.manifest.dense {
                    let _ = m.tensor(&d.name);
                }
                let record = m.expert_buf_bytes();
                if record <= 64 << 20 {
                    let mut buf = vec![0u8; record];
                    if m.read_expert(0, 0, &mut buf).is_ok() {
                        let _ = m.expert_views(0, 0, &buf);
                    }
                }
                if let Some(t) = &m.manifest.tokenizer {
                    let _ = m.read_file(t);
                }
            }
            Ok(())
        }),
    })
}

/// An engine on `model` with a five-token state.
fn engine_with_state(model: &Path) -> Result<(Engine, slipstream_engine::ModelState), String> {
    let mut engine = Engine::open(
        model,
        EngineConfig {
            prefill_chunk: 16,
            store: StoreChoice::Resident,
            ..EngineConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let mut state = engine.new_state();
    engine
        .prefill(
            &mut state,
            &[1, 2, 3, 4, 5],
            slipstream_models::Logits::Last,
        )
        .map_err(|e| e.to_string())?;
    Ok((engine, state))
}

fn snapshot(work: &Path, model: &Path) -> Result<Target, String> {
    let (engine, state) = engine_with_state(model)?;
    let path = work.join("fuzz.snapshot");
    engine
        .save_snapshot(&path, &state)
        .map_err(|e| e.to_string())?;
    let seed = std::fs::read(&path).map_err(|e| e.to_string())?;
    let expect: SnapshotExpect = engine.snapshot_expect();
    Ok(Target {
        name: "snapshot",
        seeds: vec![seed],
        text: false,
        focus: 256,
        run: Box::new(move |bytes| {
            std::fs::write(&path, bytes)?;
            let _ = slipstream_engine::snapshot::read_snapshot(&path, &expect);
            let _ = slipstream_engine::snapshot::peek_tokens(&path);
            Ok(())
        }),
    })
}

/// A prompt cache holding one entry, whose file each mutant replaces.
fn prompt_cache(work: &Path, model: &Path) -> Result<Target, String> {
    let (engine, state) = engine_with_state(model)?;
    let dir = work.join("prompt-cache");
    let cache = engine
        .open_prompt_cache(&dir, 1 << 30)
        .map_err(|e| e.to_string())?;
    cache
        .insert(&state, &engine.resident_experts())
        .map_err(|e| e.to_string())?;
    let entry = cache
        .entries()
        .first()
        .map(|e| e.path.clone())
        .ok_or("the prompt cache kept no entry")?;
    let seed = std::fs::read(&entry).map_err(|e| e.to_string())?;
    let prompt = state.tokens.clone();
    Ok(Target {
        name: "prompt_cache",
        seeds: vec![seed],
        text: false,
        focus: 256,
        run: Box::new(move |bytes| {
            std::fs::write(&entry, bytes)?;
            let _ = cache.lookup(&prompt);
            Ok(())
        }),
    })
}

fn route_trace(work: &Path) -> std::io::Result<Target> {
    use slipstream_store::trace::{read_trace, TraceHeader, TraceWriter};
    use slipstream_store::Phase;
    let path = work.join("fuzz.trace");
    let header = TraceHeader {
        layers: 4,
        experts: 16,
        top_k: 4,
    };
    let mut w = TraceWriter::create(&path, header)?;
    for step in 0..6u32 {
        let phase = if step == 0 {
            Phase::Prefill
        } else {
            Phase::Decode
        };
        for layer in 0..4 {
            let experts: Vec<u32> = (0..4)
                .map(|k| (step * 3 + layer as u32 + k * 4) % 16)
                .collect();
            let mut sorted = experts.clone();
            sorted.sort();
            sorted.dedup();
            let counts = vec![if step == 0 { 7 } else { 1 }; sorted.len()];
            w.record(
                phase,
                layer,
                if step == 0 { 7 } else { 1 },
                &sorted,
                &counts,
            )?;
        }
    }
    w.finish()?;
    let seed = std::fs::read(&path)?;
    Ok(Target {
        name: "route_trace",
        seeds: vec![seed],
        text: true,
        focus: usize::MAX,
        run: Box::new(move |bytes| {
            std::fs::write(&path, bytes)?;
            if let Ok((header, records)) = read_trace(&path) {
                for policy in ["lru", "belady"] {
                    let _ = slipstream_store::replay::replay(
                        &header,
                        &records,
                        2,
                        policy,
                        Default::default(),
                    );
                }
            }
            Ok(())
        }),
    })
}

/// The demo model's chat template, which request conversions render into.
fn demo_template() -> Result<slipstream_engine::ChatTemplate, String> {
    let tc: serde_json::Value = serde_json::from_slice(
        &fixture("models/demo/tokenizer_config.json").map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let src = tc["chat_template"]
        .as_str()
        .ok_or("models/demo/tokenizer_config.json has no chat_template")?;
    slipstream_engine::ChatTemplate::new(src).map_err(|e| e.to_string())
}

fn request_seeds() -> Result<Vec<Vec<u8>>, String> {
    let dir = root().join("crates/server/tests/fixtures");
    let mut seeds = Vec::new();
    for sub in [dir.clone(), dir.join("clients")] {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&sub)
            .map_err(|e| format!("{}: {e}", sub.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        for p in paths {
            let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            // Client fixtures hold the request under "body" when recorded
            // with their headers; a bare request is used as it is.
            let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
            match v.get("body") {
                Some(b) => seeds.push(serde_json::to_vec(b).map_err(|e| e.to_string())?),
                None => seeds.push(bytes),
            }
        }
    }
    seeds.push(
        br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}}],"max_tokens":5}"#
            .to_vec(),
    );
    seeds.push(
        br#"{"model":"m","max_tokens":5,"system":[{"type":"text","text":"be brief"}],"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"x"},{"type":"tool_use","id":"t1","name":"f","input":{"a":1}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"ok"}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"thinking":{"type":"enabled","budget_tokens":100}}"#
            .to_vec(),
    );
    Ok(seeds)
}

fn body(bytes: &[u8]) -> Result<axum::body::Bytes, axum::extract::rejection::BytesRejection> {
    Ok(axum::body::Bytes::copy_from_slice(bytes))
}

fn openai_request() -> Result<Target, String> {
    use slipstream_server::error::{parse_body, Flavor};
    let template = demo_template()?;
    Ok(Target {
        name: "openai_request",
        seeds: request_seeds()?,
        text: true,
        focus: usize::MAX,
        run: Box::new(move |bytes| {
            if let Ok(req) =
                parse_body::<slipstream_server::openai::ChatRequest>(Flavor::OpenAi, body(bytes))
            {
                if let Ok(conv) = slipstream_server::openai::conversation(&req) {
                    let _ = slipstream_server::prompt::render(&conv, Some(&template));
                    let _ = slipstream_server::prompt::render(&conv, None);
                }
            }
            Ok(())
        }),
    })
}

fn anthropic_request() -> Result<Target, String> {
    use slipstream_server::anthropic_request::{conversation, thinking, MessagesRequest};
    use slipstream_server::error::{parse_body, Flavor};
    let template = demo_template()?;
    Ok(Target {
        name: "anthropic_request",
        seeds: request_seeds()?,
        text: true,
        focus: usize::MAX,
        run: Box::new(move |bytes| {
            if let Ok(req) = parse_body::<MessagesRequest>(Flavor::Anthropic, body(bytes)) {
                let _ = thinking(&req);
                if let Ok(mapped) = conversation(&req) {
                    let _ = slipstream_server::prompt::render(&mapped.conv, Some(&template));
                }
            }
            Ok(())
        }),
    })
}

/// The Responses API's input items and tools as the server maps them onto a
/// chat conversation (`instructions`, `input` as a string or items, `tools`
/// with namespaces), then the mapped messages through the OpenAI conversion
/// and the template.
fn responses_request() -> Result<Target, String> {
    use slipstream_server::responses::input::{messages, tools};
    let template = demo_template()?;
    let mut seeds = request_seeds()?;
    seeds.push(
        br#"{"model":"m","instructions":"be brief","input":[{"type":"message","role":"developer","content":[{"type":"input_text","text":"rules"}]},{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"hm"}]},{"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\":1}"},{"type":"function_call_output","call_id":"c1","output":"ok"}],"tools":[{"type":"function","name":"f","parameters":{"type":"object"}},{"type":"namespace","name":"ns","tools":[{"type":"function","name":"g","parameters":{"type":"object"}}]},{"type":"web_search"}]}"#
            .to_vec(),
    );
    Ok(Target {
        name: "responses_request",
        seeds,
        text: true,
        focus: usize::MAX,
        run: Box::new(move |bytes| {
            let Ok(req) = serde_json::from_slice::<serde_json::Value>(bytes) else {
                return Ok(());
            };
            if let Some(list) = req.get("tools").and_then(|t| t.as_array()) {
                let _ = tools(list);
            }
            let instructions = req.get("instructions").and_then(|i| i.as_str());
            let input = req.get("input").cloned().unwrap_or_default();
            if let Ok(msgs) = messages(instructions, &input) {
                let chat = serde_json::json!({"model": "m", "messages": msgs});
                if let Ok(chat) =
                    serde_json::from_value::<slipstream_server::openai::ChatRequest>(chat)
                {
                    if let Ok(conv) = slipstream_server::openai::conversation(&chat) {
                        let _ = slipstream_server::prompt::render(&conv, Some(&template));
                    }
                }
            }
            Ok(())
        }),
    })
}
