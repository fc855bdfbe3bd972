//! Write a small model, read it back, then damage it in each way a user's
//! disk can and check every damage is a clear error.

use std::os::unix::fs::FileExt;

use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, ModelConfig, QuantType};
use slipstream_format::*;

fn config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Qwen3Moe,
        vocab_size: 16,
        hidden_size: 64,
        rms_norm_eps: 1e-6,
        layer_types: vec![LayerKind::FullAttention; 2],
        tie_word_embeddings: false,
        max_position_embeddings: 128,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 32,
        rotary_dim: 32,
        rope_theta: 1e6,
        attn_output_gate: false,
        linear_num_key_heads: 0,
        linear_key_head_dim: 0,
        linear_num_value_heads: 0,
        linear_value_head_dim: 0,
        linear_conv_kernel: 0,
        num_experts: 3,
        num_experts_per_tok: 2,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: 0,
        norm_topk_prob: true,
        mtp_num_layers: 0,
    }
}

/// What the test models' writers finish with: [`config`], no tokenizer.
fn manifest_info() -> ManifestInfo {
    ManifestInfo {
        config: config(),
        tokenizer: None,
        chat_template: None,
        eos_token_ids: vec![1],
        special_tokens: Default::default(),
        generation: None,
        source: SourceInfo::default(),
    }
}

fn part_bytes(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn write_model(dir: &std::path::Path) -> std::path::PathBuf {
    let target = dir.join("m.slip");
    let q4 = QuantType::Q4;
    let layout = ExpertPoolLayout {
        num_layers: 2,
        num_experts: 3,
        parts: vec![
            ("gate".into(), q4, [64, 64]),
            ("up".into(), q4, [64, 64]),
            ("down".into(), q4, [64, 64]),
        ],
        layer_qtypes: Vec::new(),
    };
    let mut w = SlipWriter::create(&target, layout, Default::default()).unwrap();
    w.add_dense(
        "embed",
        QuantType::F32,
        [16, 64],
        &part_bytes(1, 16 * 64 * 4),
    )
    .unwrap();
    w.add_dense("norm", QuantType::Bf16, [1, 64], &part_bytes(2, 128))
        .unwrap();
    let n = q4.nbytes(64, 64);
    for l in 0..2 {
        for e in 0..3 {
            let seed = (l * 3 + e) as u8;
            let (g, u, d) = (
                part_bytes(seed, n),
                part_bytes(seed + 50, n),
                part_bytes(seed + 100, n),
            );
            w.write_expert(l, e, &[&g, &u, &d]).unwrap();
        }
    }
    w.finish(manifest_info()).unwrap();
    target
}

#[test]
fn round_trip_is_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let m = SlipModel::open(&path).unwrap();
    assert_eq!(
        m.tensor("embed").unwrap().view().data,
        &part_bytes(1, 16 * 64 * 4)[..]
    );
    assert_eq!(
        m.tensor("norm").unwrap().view().data,
        &part_bytes(2, 128)[..]
    );
    assert_eq!(m.manifest.experts.record_stride % 4096, 0);
    let mut buf = vec![0u8; m.manifest.experts.record_bytes as usize];
    let n = QuantType::Q4.nbytes(64, 64);
    for l in 0..2 {
        for e in 0..3 {
            m.read_expert(l, e, &mut buf).unwrap();
            let views = m.expert_views(l, e, &buf).unwrap();
            let seed = (l * 3 + e) as u8;
            assert_eq!(views.gate.data, &part_bytes(seed, n)[..]);
            assert_eq!(views.up.data, &part_bytes(seed + 50, n)[..]);
            assert_eq!(views.down.data, &part_bytes(seed + 100, n)[..]);
        }
    }
    assert!(matches!(
        m.tensor("nope"),
        Err(FormatError::MissingTensor(_))
    ));
    // No temp directory is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(leftovers.len(), 1);
}

/// `path` open for reading and writing in place (to damage it).
fn open_rw(path: &std::path::Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap()
}

#[test]
fn truncated_expert_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let f = open_rw(&path.join(EXPERTS_FILE));
    let len = f.metadata().unwrap().len();
    f.set_len(len - 100).unwrap();
    let err = SlipModel::open(&path).err().expect("must fail");
    assert!(matches!(err, FormatError::Size { .. }), "{err}");
    assert!(err.to_string().contains("truncated"));
}

#[test]
fn flipped_byte_in_expert_record_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let m = SlipModel::open(&path).unwrap();
    let off = m.manifest.experts.record_offset(1, 2) + 17;
    let f = open_rw(&path.join(EXPERTS_FILE));
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], off).unwrap();
    let mut buf = vec![0u8; m.manifest.experts.record_bytes as usize];
    m.read_expert(1, 1, &mut buf).unwrap();
    let err = m.read_expert(1, 2, &mut buf).unwrap_err();
    assert!(
        matches!(
            err,
            FormatError::ExpertChecksum {
                layer: 1,
                expert: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn flipped_byte_in_dense_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let f = open_rw(&path.join(DENSE_FILE));
    f.write_all_at(&[0xff], 3).unwrap();
    let err = SlipModel::open(&path).err().expect("must fail");
    assert!(matches!(err, FormatError::DenseChecksum { .. }), "{err}");
}

#[test]
fn bad_manifests_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let mpath = path.join(MANIFEST_FILE);
    let good = std::fs::read_to_string(&mpath).unwrap();
    std::fs::write(&mpath, &good[..good.len() / 2]).unwrap();
    assert!(matches!(
        SlipModel::open(&path),
        Err(FormatError::BadManifest { .. })
    ));
    std::fs::write(&mpath, good.replace("\"version\": 2", "\"version\": 99")).unwrap();
    assert!(matches!(
        SlipModel::open(&path),
        Err(FormatError::Version { found: 99, .. })
    ));
    std::fs::remove_file(&mpath).unwrap();
    assert!(matches!(
        SlipModel::open(&path),
        Err(FormatError::Io { .. })
    ));
}

#[test]
fn unfinished_writer_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("x.slip");
    {
        let mut w = SlipWriter::create(
            &target,
            ExpertPoolLayout {
                num_layers: 1,
                num_experts: 1,
                parts: vec![
                    ("gate".into(), QuantType::F32, [1, 4]),
                    ("up".into(), QuantType::F32, [1, 4]),
                    ("down".into(), QuantType::F32, [4, 1]),
                ],
                layer_qtypes: Vec::new(),
            },
            Default::default(),
        )
        .unwrap();
        w.add_dense("a", QuantType::F32, [1, 1], &[0; 4]).unwrap();
        // Dropped without finish: as if the process died mid-write.
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// A change made to a manifest by hand.
type Edit = fn(&mut Manifest);

/// The error opening the model at `path` after `edit` of its manifest
/// `good` (with the hash and checksum recomputed when `reseal`, so only a
/// check of the content itself can refuse it); `what` names the edit.
fn open_error_after(
    path: &std::path::Path,
    good: &Manifest,
    edit: Edit,
    reseal: bool,
    what: &str,
) -> String {
    let mut m = good.clone();
    edit(&mut m);
    if reseal {
        m.model_hash = m.content_hash();
        m.manifest_checksum = m.self_checksum();
    }
    write_manifest(path, &m);
    SlipModel::open(path).err().expect(what).to_string()
}

fn read_manifest(path: &std::path::Path) -> Manifest {
    serde_json::from_slice(&std::fs::read(path.join(MANIFEST_FILE)).unwrap()).unwrap()
}

fn write_manifest(path: &std::path::Path, m: &Manifest) {
    std::fs::write(
        path.join(MANIFEST_FILE),
        serde_json::to_vec_pretty(m).unwrap(),
    )
    .unwrap();
}

/// Any edit of the manifest's values is caught by its checksum; a model
/// hash that is not the content's is refused even with a fixed checksum.
#[test]
fn edited_manifests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let good = read_manifest(&path);
    let edits: [(&str, Edit); 4] = [
        ("experts per token", |m| m.config.num_experts_per_tok = 1),
        ("rope theta", |m| m.config.rope_theta = 1e4),
        ("a layer type", |m| {
            m.config.layer_types.pop();
        }),
        ("the model hash", |m| {
            m.model_hash = "0123456789abcdef".into()
        }),
    ];
    for (what, edit) in edits {
        let e = open_error_after(&path, &good, edit, false, what);
        assert!(e.contains("checksum does not match"), "{what}: {e}");
    }
    // Someone who also fixes the checksum still cannot claim another hash.
    let mut m = good.clone();
    m.model_hash = "0123456789abcdef".into();
    m.manifest_checksum = m.self_checksum();
    write_manifest(&path, &m);
    let e = SlipModel::open(&path).err().unwrap().to_string();
    assert!(e.contains("not the hash of the model's content"), "{e}");
    write_manifest(&path, &good);
    SlipModel::open(&path).unwrap();
}

/// A manifest consistent with itself but not with its config (fewer
/// experts, other part shapes) is an open-time error, not a panic later.
#[test]
fn a_pool_that_disagrees_with_the_config_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let good = read_manifest(&path);
    let edits: [(&str, Edit); 3] = [
        ("experts", |m| m.config.num_experts = 4),
        ("layers", |m| {
            m.config.layer_types.push(LayerKind::FullAttention);
        }),
        ("part shape", |m| m.config.moe_intermediate_size = 128),
    ];
    for (what, edit) in edits {
        let e = open_error_after(&path, &good, edit, true, what);
        assert!(
            e.contains("expert pool has") || e.contains("expert part"),
            "{what}: {e}"
        );
    }
}

/// Extents whose sums overflow (found by `slipstream-fuzz`): an error, not
/// an arithmetic overflow panic (or, in release, a wrapped bounds check).
#[test]
fn overflowing_expert_extents_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let good = read_manifest(&path);
    let edits: [(&str, Edit, &str); 2] = [
        (
            "part offset",
            |m| m.experts.parts[0].offset = u64::MAX - 1,
            "layout is inconsistent",
        ),
        (
            "record stride",
            |m| {
                m.experts.record_stride = u64::MAX - (u64::MAX % 4096);
            },
            "larger than any file",
        ),
    ];
    for (what, edit, says) in edits {
        let mut m = good.clone();
        edit(&mut m);
        m.model_hash = m.content_hash();
        m.manifest_checksum = m.self_checksum();
        write_manifest(&path, &m);
        let e = SlipModel::open(&path).err().expect(what).to_string();
        assert!(e.contains(says), "{what}: {e}");
    }
}

/// Files that are not regular files, and names outside the directory.
#[test]
fn non_regular_files_and_foreign_paths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let good = read_manifest(&path);
    // The manifest as a symlink to /dev/zero, and as a FIFO.
    let mpath = path.join(MANIFEST_FILE);
    std::fs::remove_file(&mpath).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &mpath).unwrap();
    let e = SlipModel::open(&path).err().unwrap().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    std::fs::remove_file(&mpath).unwrap();
    let status = std::process::Command::new("mkfifo")
        .arg(&mpath)
        .status()
        .unwrap();
    assert!(status.success());
    let e = SlipModel::open(&path).err().unwrap().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    std::fs::remove_file(&mpath).unwrap();
    // A tokenizer path that leaves the directory.
    let mut m = good.clone();
    m.tokenizer = Some("../../etc/passwd".into());
    m.manifest_checksum = m.self_checksum();
    write_manifest(&path, &m);
    let e = SlipModel::open(&path).err().unwrap().to_string();
    assert!(
        e.contains("not a file name inside the model directory"),
        "{e}"
    );
    write_manifest(&path, &good);
    let m = SlipModel::open(&path).unwrap();
    assert!(m.read_file("../m.slip/manifest.json").is_err());
}

/// Expert types that differ between layers: per-layer parts, format
/// version 3, each layer's records of its own size read back bit-exact
/// with its types; the same types in every layer stay version 2; a
/// version that does not match the parts is refused.
#[test]
fn per_layer_expert_types_round_trip_as_version_3() {
    let dir = tempfile::tempdir().unwrap();
    let (q4, q8) = (QuantType::Q4, QuantType::Q8);
    let write = |name: &str, layer_qtypes: Vec<Vec<QuantType>>| {
        let target = dir.path().join(name);
        let layout = ExpertPoolLayout {
            num_layers: 2,
            num_experts: 3,
            parts: ["gate", "up", "down"]
                .iter()
                .map(|n| (n.to_string(), q4, [64, 64]))
                .collect(),
            layer_qtypes: layer_qtypes.clone(),
        };
        let mut w = SlipWriter::create(&target, layout, Default::default()).unwrap();
        w.add_dense("embed", QuantType::F32, [16, 64], &part_bytes(1, 4096))
            .unwrap();
        for l in 0..2 {
            let types = layer_qtypes.get(l).cloned().unwrap_or(vec![q4; 3]);
            for e in 0..3 {
                let parts: Vec<Vec<u8>> = (0..3)
                    .map(|k| part_bytes((l * 9 + e * 3 + k) as u8, types[k].nbytes(64, 64)))
                    .collect();
                let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
                w.write_expert(l, e, &refs).unwrap();
            }
        }
        w.finish(manifest_info()).unwrap();
        target
    };
    let mixed = write("mixed.slip", vec![vec![q4; 3], vec![q4, q4, q8]]);
    let m = SlipModel::open(&mixed).unwrap();
    assert_eq!(m.manifest.version, FORMAT_VERSION_LAYER_PARTS);
    let pool = &m.manifest.experts;
    assert!(pool.layer_record_bytes(1) > pool.layer_record_bytes(0));
    assert_eq!(pool.record_bytes, pool.layer_record_bytes(1));
    let mut buf = vec![0u8; m.expert_buf_bytes()];
    for l in 0..2 {
        for e in 0..3 {
            m.read_expert(l, e, &mut buf).unwrap();
            let w = m.expert_views(l, e, &buf).unwrap();
            let down = if l == 1 { q8 } else { q4 };
            assert_eq!((w.gate.qtype, w.down.qtype), (q4, down));
            assert_eq!(
                w.down.data,
                &part_bytes((l * 9 + e * 3 + 2) as u8, down.nbytes(64, 64))[..]
            );
        }
    }
    drop(m);
    let same = write("same.slip", vec![vec![q4; 3]; 2]);
    let m = SlipModel::open(&same).unwrap();
    assert_eq!(m.manifest.version, FORMAT_VERSION);
    assert!(m.manifest.experts.layer_parts.is_empty());
    // A version-2 manifest with per-layer parts (an older reader would
    // misread it) is refused.
    let mut edited = read_manifest(&mixed);
    edited.version = FORMAT_VERSION;
    edited.manifest_checksum = edited.self_checksum();
    write_manifest(&mixed, &edited);
    let e = SlipModel::open(&mixed).err().unwrap().to_string();
    assert!(e.contains("per-layer expert parts"), "{e}");
}
