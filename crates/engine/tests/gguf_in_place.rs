//! GGUF files run in place (docs/GGUF_IN_PLACE.md): a run of the GGUF
//! itself gives the logits and tokens of the same file repacked into a
//! `.slip`, bit for bit, resident and streaming at several slot counts; the
//! checksum table is built once, reused, rebuilt when the file changes,
//! and catches corrupted expert bytes; K-quant files whose expert types
//! differ between layers run in place and repack; bad files are errors.
//!
//! Every GGUF here is a copy in a temporary directory (its checksum table
//! is written beside it), never a committed fixture.

use std::path::{Path, PathBuf};

use slipstream_engine::sampler::Rng;
use slipstream_engine::{open_model, Engine, EngineConfig, StoreChoice};
use slipstream_format::SlipModel;
use slipstream_gguf::{GgmlType, GgufFile, GgufWriter, TensorDecl};
use slipstream_repack::{
    index_locations, open_gguf_in_place_with, InPlaceOptions, IndexUse, QuantChoice,
};
use slipstream_store::StreamConfig;
use slipstream_testkit::{
    fixture, greedy, open, rel_err, repack_into, same_bits, streaming, Reference,
};

/// Copies fixture `name`'s GGUF into `dir`.
fn copy_gguf(name: &str, dir: &Path) -> PathBuf {
    let to = dir.join(format!("{name}.gguf"));
    std::fs::copy(fixture(name).join("model.gguf"), &to).unwrap();
    to
}

/// Repacks `gguf` into `out` as a `.slip`, GGML blocks kept.
fn repack_gguf(gguf: &Path, out: &Path) {
    repack_into(gguf, out, QuantChoice::default(), false);
}

/// Greedy tokens and every logits row of `model` under `store`.
fn run(model: &Path, store: StoreChoice, prompt: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let mut e = open(model, store, 5);
    let g = greedy(&mut e, prompt, 8);
    (g.tokens, g.logits)
}

/// The stores a run is compared under: resident, streaming at 1, 3 and
/// every slot, and (where the filesystem takes it) direct I/O.
fn stores(experts: usize, dir: &Path) -> Vec<(String, StoreChoice)> {
    let mut v = vec![("resident".to_string(), StoreChoice::Resident)];
    for slots in [1, 3, experts] {
        v.push((format!("{slots} slots"), streaming(slots)));
    }
    if slipstream_store::supports_direct_io(dir) {
        v.push((
            "2 slots, direct I/O".into(),
            StoreChoice::Streaming(StreamConfig {
                slots: 2,
                direct_io: true,
                ..Default::default()
            }),
        ));
    }
    v
}

/// In place and repacked: same model hash, same bits everywhere.
fn check_bit_identity(gguf: &Path, prompt: &[u32]) {
    let dir = gguf.parent().unwrap();
    let slip = dir.join("repacked.slip");
    repack_gguf(gguf, &slip);
    let repacked = SlipModel::open(&slip).unwrap();
    let in_place = open_model(gguf, None).unwrap();
    assert!(in_place.is_in_place() && !repacked.is_in_place());
    // Same config, dense bytes and expert records: same content hash.
    assert_eq!(in_place.manifest.model_hash, repacked.manifest.model_hash);
    let experts = repacked.manifest.config.num_experts;
    drop((repacked, in_place));
    let (tokens, logits) = run(&slip, StoreChoice::Resident, prompt);
    for (what, store) in stores(experts, dir) {
        for model in [gguf, slip.as_path()] {
            let (t, l) = run(model, store.clone(), prompt);
            assert_eq!(t, tokens, "{}: {what}", model.display());
            assert!(
                same_bits(&l, &logits),
                "{}: {what}: logits differ (max rel {:e})",
                model.display(),
                rel_err(&l, &logits)
            );
        }
    }
}

#[test]
fn in_place_runs_are_bit_identical_to_the_repacked_gguf() {
    for name in [
        "gguf_qwen35moe_kquant",
        "gguf_qwen3next_q8_0",
        "gguf_qwen3moe_q4_0",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let gguf = copy_gguf(name, tmp.path());
        let prompt = Reference::read(&fixture(name)).prompt;
        check_bit_identity(&gguf, &prompt);
    }
}

/// The memory guard measures the dense weights still to come from the map:
/// in place, tensors the importer converted at open are on the heap
/// (already in the footprint), so the mapped share is the dense bytes less
/// those; a repacked model maps every dense byte. Both fixtures have
/// tensors converted at open (qwen3next's `A_log` and norms, qwen3moe's
/// few small ones).
#[test]
fn the_mapped_dense_share_leaves_out_converted_tensors() {
    for name in ["gguf_qwen3next_q8_0", "gguf_qwen3moe_q4_0"] {
        let tmp = tempfile::tempdir().unwrap();
        let gguf = copy_gguf(name, tmp.path());
        let opts = InPlaceOptions { index_dir: None };
        let (m, _) = open_gguf_in_place_with(&gguf, &opts).unwrap();
        let (_, mapped) = m.dense_mapping();
        let dense = m.manifest.dense_file_bytes as usize;
        assert!(mapped > 0, "{name}");
        assert!(mapped < dense, "{name}: {mapped} of {dense}");
        let slip = tmp.path().join("m.slip");
        repack_gguf(&gguf, &slip);
        let r = SlipModel::open(&slip).unwrap();
        assert_eq!(
            r.dense_mapping().1,
            r.manifest.dense_file_bytes as usize,
            "{name}"
        );
    }
}

/// Sets a file's modification time to `t`.
fn set_mtime(path: &Path, t: std::time::SystemTime) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(t)
        .unwrap();
}

#[test]
fn the_checksum_table_is_built_reused_rebuilt_and_catches_corruption() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = copy_gguf("gguf_qwen3moe_q4_0", tmp.path());
    let opts = InPlaceOptions::default();
    let beside = index_locations(&gguf, &opts)[0].clone();
    assert!(beside.starts_with(tmp.path()));

    // What a table writer that died left (pid 0x7fff_fff0 is not running),
    // and a file of someone else's under a temp-like name.
    let dead = tmp.path().join(format!(
        ".{}.tmp-{}-0",
        beside.file_name().unwrap().to_string_lossy(),
        0x7fff_fff0u32
    ));
    std::fs::write(&dead, b"{\"format\":\"slipstream-gguf-index\",\"vers").unwrap();
    let foreign = dead.with_file_name(format!(
        ".{}.tmp-{}-1",
        beside.file_name().unwrap().to_string_lossy(),
        0x7fff_fff0u32
    ));
    std::fs::write(&foreign, b"notes").unwrap();

    let (m, used) = open_gguf_in_place_with(&gguf, &opts).unwrap();
    assert_eq!(used, IndexUse::Built(beside.clone()));
    assert!(!dead.exists(), "a dead writer's temp stays");
    assert_eq!(std::fs::read(&foreign).unwrap(), b"notes");
    let hash = m.manifest.model_hash.clone();
    drop(m);
    let (m, used) = open_gguf_in_place_with(&gguf, &opts).unwrap();
    assert_eq!(used, IndexUse::Reused(beside.clone()));
    assert_eq!(m.manifest.model_hash, hash);
    drop(m);

    // A file changed since (here only its time): the table is rebuilt.
    let t0 = std::fs::metadata(&gguf).unwrap().modified().unwrap();
    set_mtime(&gguf, t0 + std::time::Duration::from_secs(60));
    let (_, used) = open_gguf_in_place_with(&gguf, &opts).unwrap();
    assert_eq!(used, IndexUse::Built(beside.clone()));

    // A file of someone else's at the table's name is never written over:
    // the table goes to the index directory instead, or nowhere.
    std::fs::write(&beside, b"not ours").unwrap();
    let (_, used) = open_gguf_in_place_with(&gguf, &opts).unwrap();
    assert_eq!(used, IndexUse::BuiltUnsaved);
    let cache = InPlaceOptions {
        index_dir: Some(tmp.path().join("cache")),
    };
    let (_, used) = open_gguf_in_place_with(&gguf, &cache).unwrap();
    let elsewhere = index_locations(&gguf, &cache)[1].clone();
    assert!(elsewhere.starts_with(tmp.path().join("cache")));
    assert_eq!(used, IndexUse::Built(elsewhere.clone()));
    let (_, used) = open_gguf_in_place_with(&gguf, &cache).unwrap();
    assert_eq!(used, IndexUse::Reused(elsewhere));
    assert_eq!(std::fs::read(&beside).unwrap(), b"not ours");
    std::fs::remove_file(&beside).unwrap();
    let (m, _) = open_gguf_in_place_with(&gguf, &opts).unwrap();

    // Corrupt one expert's bytes behind the table's back (time kept): the
    // open still trusts the table, and the expert fails its check when read.
    let stamp = std::fs::metadata(&gguf).unwrap().modified().unwrap();
    let f = GgufFile::open(&gguf).unwrap();
    let up = f.tensor("blk.1.ffn_up_exps.weight").unwrap();
    let per = up.nbytes / m.manifest.config.num_experts as u64;
    let at = up.offset + 2 * per + per / 2;
    drop((f, m));
    let mut bytes = std::fs::read(&gguf).unwrap();
    bytes[at as usize] ^= 0x5a;
    std::fs::write(&gguf, &bytes).unwrap();
    set_mtime(&gguf, stamp);
    let (m, used) = open_gguf_in_place_with(&gguf, &opts).unwrap();
    assert_eq!(used, IndexUse::Reused(beside));
    let mut buf = vec![0u8; m.expert_buf_bytes()];
    m.read_expert(1, 1, &mut buf).unwrap();
    let e = m.read_expert(1, 2, &mut buf).unwrap_err().to_string();
    assert!(
        e.contains("expert 2 of layer 1") && e.contains("checksum"),
        "{e}"
    );
    drop(m);
    // Through the engine: resident (read at open) and streaming (at use).
    let e = Engine::open(
        &gguf,
        EngineConfig {
            store: StoreChoice::Resident,
            ..Default::default()
        },
    )
    .err()
    .expect("a corrupted expert fails the resident open")
    .to_string();
    assert!(e.contains("expert 2 of layer 1"), "{e}");
}

/// Random Q6_K blocks for `[rows, cols]` whose values have roughly `std`.
fn random_q6k(rows: usize, cols: usize, std: f32, seed: u64) -> Vec<u8> {
    // The sampler's SplitMix64.
    let mut rng = Rng::new(seed);
    let mut next = move || rng.next_u64();
    let mut out = Vec::new();
    for _ in 0..rows * cols / 256 {
        // ql[128], qh[64], scales[16] (i8), d (f16): value d * scale * (q - 32).
        for _ in 0..192 {
            out.push(next() as u8);
        }
        for _ in 0..16 {
            out.push(((next() % 17) as i8 - 8) as u8);
        }
        out.extend_from_slice(&half::f16::from_f32(std / 64.0).to_le_bytes());
    }
    out
}

/// A tensor's new `(type, bytes)` from its name and stored bytes, or
/// `None` to keep it.
type Replace<'a> = &'a dyn Fn(&str, &[u8]) -> Option<(GgmlType, Vec<u8>)>;

/// Rewrites `src` with the tensors `replace` names swapped.
fn rewrite(src: &Path, dst: &Path, replace: Replace) {
    let f = GgufFile::open(src).unwrap();
    let data: Vec<(TensorDecl, Vec<u8>)> = f
        .tensors
        .iter()
        .map(|t| {
            let (ty, bytes) = replace(&t.name, f.data(t)).unwrap_or((t.ty, f.data(t).to_vec()));
            (TensorDecl::new(t.name.clone(), &t.dims, ty), bytes)
        })
        .collect();
    let decls = data.iter().map(|d| d.0.clone()).collect();
    let mut w = GgufWriter::create(dst, &f.metadata, decls, Default::default()).unwrap();
    for (_, bytes) in &data {
        w.write(bytes).unwrap();
    }
    w.finish().unwrap();
}

/// `[rows, cols]` of ggml type `ty` in `bytes`, dequantized to f32 bytes.
fn to_f32(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<u8> {
    let q = match ty {
        GgmlType::Q4_K => slipstream_core::QuantType::Q4K,
        GgmlType::Q6_K => slipstream_core::QuantType::Q6K,
        other => panic!("no dequantization here for {other:?}"),
    };
    let view = slipstream_core::TensorView::new(q, rows, cols, bytes).unwrap();
    let mut row = vec![0f32; cols];
    let mut out = Vec::with_capacity(rows * cols * 4);
    for r in 0..rows {
        slipstream_kernels::dequantize_row(&view, r, &mut row);
        out.extend(row.iter().flat_map(|v| v.to_le_bytes()));
    }
    out
}

/// A Q4_K_M-style mix: layer 1's `ffn_gate_exps` becomes Q6_K while layer
/// 0's stays Q4_K (the columns of gate are the hidden size, 256: whole K
/// blocks). Repack (once refused) and in place give the same bits, and the
/// same model with every layer's gate dequantized to F32 (one type, the
/// same values) gives the same tokens and logits to summation order.
#[test]
fn expert_types_mixed_across_layers_run_in_place_and_repacked() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "gguf_qwen35moe_kquant";
    let plain = copy_gguf(name, tmp.path());
    let f = GgufFile::open(&plain).unwrap();
    let gate0 = f.tensor("blk.0.ffn_gate_exps.weight").unwrap().clone();
    assert_eq!(gate0.ty, GgmlType::Q4_K, "the fixture's expert gate");
    drop(f);
    let (cols, rows) = (gate0.dims[0] as usize, gate0.rows() as usize);
    let q6 = random_q6k(rows, cols, 0.05, 7);

    let mixed_dir = tmp.path().join("mixed");
    std::fs::create_dir(&mixed_dir).unwrap();
    let mixed = mixed_dir.join("mixed.gguf");
    rewrite(&plain, &mixed, &|n, _| {
        (n == "blk.1.ffn_gate_exps.weight").then(|| (GgmlType::Q6_K, q6.clone()))
    });
    let f32_dir = tmp.path().join("f32");
    std::fs::create_dir(&f32_dir).unwrap();
    let as_f32 = f32_dir.join("gate-f32.gguf");
    rewrite(&mixed, &as_f32, &|n, b| {
        n.ends_with("ffn_gate_exps.weight").then(|| {
            let ty = if n.starts_with("blk.1.") {
                GgmlType::Q6_K
            } else {
                GgmlType::Q4_K
            };
            (GgmlType::F32, to_f32(ty, rows, cols, b))
        })
    });

    let m = open_model(&mixed, None).unwrap();
    let pool = &m.manifest.experts;
    assert_eq!(
        m.manifest.version,
        slipstream_format::FORMAT_VERSION_LAYER_PARTS
    );
    assert_eq!(pool.parts_of(0)[0].qtype, slipstream_core::QuantType::Q4K);
    assert_eq!(pool.parts_of(1)[0].qtype, slipstream_core::QuantType::Q6K);
    drop(m);
    let prompt = Reference::read(&fixture(name)).prompt;
    // Repacks it too (a version-3 .slip) and compares every store.
    check_bit_identity(&mixed, &prompt);
    let slip = mixed_dir.join("repacked.slip");
    assert_eq!(
        SlipModel::open(&slip).unwrap().manifest.version,
        slipstream_format::FORMAT_VERSION_LAYER_PARTS
    );

    let (t_mixed, l_mixed) = run(&slip, StoreChoice::Resident, &prompt);
    let (t_f32, l_f32) = run(&as_f32, StoreChoice::Resident, &prompt);
    assert_eq!(t_mixed, t_f32);
    let err = rel_err(&l_mixed, &l_f32);
    assert!(err < 1e-4, "mixed vs dequantized: {err:e}");
}

#[test]
fn bad_gguf_files_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = copy_gguf("gguf_qwen3moe_q4_0", tmp.path());
    let bytes = std::fs::read(&gguf).unwrap();

    // Truncated inside the data: the file names what is cut.
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 1000]).unwrap();
    let e = open_model(&cut, None).err().unwrap().to_string();
    assert!(e.contains("cut.gguf"), "{e}");
    // Truncated inside the header.
    std::fs::write(&cut, &bytes[..100]).unwrap();
    let e = open_model(&cut, None).err().unwrap().to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");

    // A tensor missing: named.
    let missing = tmp.path().join("missing.gguf");
    let f = GgufFile::open(&gguf).unwrap();
    let decls: Vec<(TensorDecl, Vec<u8>)> = f
        .tensors
        .iter()
        .filter(|t| t.name != "blk.1.ffn_down_exps.weight")
        .map(|t| {
            (
                TensorDecl::new(t.name.clone(), &t.dims, t.ty),
                f.data(t).to_vec(),
            )
        })
        .collect();
    let mut w = GgufWriter::create(
        &missing,
        &f.metadata,
        decls.iter().map(|d| d.0.clone()).collect(),
        Default::default(),
    )
    .unwrap();
    for (_, b) in &decls {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
    let e = open_model(&missing, None).err().unwrap().to_string();
    assert!(e.contains("blk.1.ffn_down_exps.weight"), "{e}");
    // Nothing was written beside a file that failed.
    for p in [&cut, &missing] {
        assert!(!index_locations(p, &InPlaceOptions::default())[0].exists());
    }
}
