use super::*;

fn sample_meta() -> Vec<(String, Value)> {
    vec![
        (
            "general.architecture".into(),
            Value::String("qwen35moe".into()),
        ),
        ("u8".into(), Value::U8(7)),
        ("i8".into(), Value::I8(-7)),
        ("u16".into(), Value::U16(65000)),
        ("i16".into(), Value::I16(-3000)),
        ("u32".into(), Value::U32(4_000_000_000)),
        ("i32".into(), Value::I32(-5)),
        ("f32".into(), Value::F32(1.5e-6)),
        ("bool".into(), Value::Bool(true)),
        ("u64".into(), Value::U64(1 << 40)),
        ("i64".into(), Value::I64(-(1 << 40))),
        ("f64".into(), Value::F64(1e7)),
        (
            "tokens".into(),
            Value::strings(vec!["a".into(), "Ġb".into(), "<|im_end|>".into()]),
        ),
        (
            "empty".into(),
            Value::Array {
                ty: ValueType::I32,
                items: vec![],
            },
        ),
        (
            "nested".into(),
            Value::Array {
                ty: ValueType::Array,
                items: vec![Value::Array {
                    ty: ValueType::Bool,
                    items: vec![Value::Bool(false), Value::Bool(true)],
                }],
            },
        ),
    ]
}

fn sample_tensors() -> Vec<(TensorDecl, Vec<u8>)> {
    let f32s: Vec<u8> = (0..24u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let q40: Vec<u8> = (0..2 * 3 * 18).map(|i| i as u8).collect();
    let q4k: Vec<u8> = (0..144 * 2).map(|i| (i * 7) as u8).collect();
    vec![
        (TensorDecl::new("a.weight", &[4, 6], GgmlType::F32), f32s),
        (TensorDecl::new("b.weight", &[64, 3], GgmlType::Q4_0), q40),
        (
            TensorDecl::new("norm", &[3], GgmlType::F16),
            vec![1, 2, 3, 4, 5, 6],
        ),
        (TensorDecl::new("exps", &[256, 1, 2], GgmlType::Q4_K), q4k),
    ]
}

fn write_sample(path: &std::path::Path, meta: &[(String, Value)]) {
    let t = sample_tensors();
    let mut w = GgufWriter::create(
        path,
        meta,
        t.iter().map(|x| x.0.clone()).collect(),
        Default::default(),
    )
    .unwrap();
    for (d, bytes) in &t {
        // Stream in small pieces to exercise partial writes.
        if d.name == "a.weight" {
            for c in bytes.chunks(5) {
                w.write(c).unwrap();
            }
        } else {
            w.write_tensor(&d.name, bytes).unwrap();
        }
    }
    w.finish().unwrap();
}

#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let meta = sample_meta();
    write_sample(&path, &meta);
    assert!(is_gguf_file(&path));
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.metadata, meta);
    assert_eq!(f.alignment, DEFAULT_ALIGNMENT);
    assert_eq!(f.get("f64").and_then(|v| v.as_f64()), Some(1e7));
    let t = sample_tensors();
    assert_eq!(f.tensors.len(), t.len());
    for (info, (d, bytes)) in f.tensors.iter().zip(&t) {
        assert_eq!(info.name, d.name);
        assert_eq!(info.dims, d.dims);
        assert_eq!(info.ty, d.ty);
        assert_eq!(info.offset % f.alignment as u64, 0);
        assert_eq!(f.data(info), &bytes[..]);
    }
    assert_eq!(f.tensor("exps").unwrap().rows(), 2);
    // No temporary file is left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn custom_alignment_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut meta = sample_meta();
    meta.push((ALIGNMENT_KEY.into(), Value::U32(256)));
    write_sample(&path, &meta);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.alignment, 256);
    for t in &f.tensors {
        assert_eq!(t.offset % 256, 0, "{}", t.name);
    }
    assert_eq!(f.data(f.tensor("norm").unwrap()), &[1, 2, 3, 4, 5, 6]);
}

#[test]
fn incomplete_writer_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let t = sample_tensors();
    let mut w = GgufWriter::create(
        &path,
        &[],
        t.iter().map(|x| x.0.clone()).collect(),
        Default::default(),
    )
    .unwrap();
    w.write_tensor("a.weight", &t[0].1).unwrap();
    let e = w.write_tensor("norm", &[0; 6]).unwrap_err().to_string();
    assert!(e.contains("out of order"), "{e}");
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("b.weight"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    assert!(!path.exists());
}

fn corrupt(mutate: impl Fn(&mut Vec<u8>)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_sample(&path, &sample_meta());
    let mut bytes = std::fs::read(&path).unwrap();
    mutate(&mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    match GgufFile::open(&path) {
        Ok(_) => panic!("corrupted file opened"),
        Err(e) => {
            let s = e.to_string();
            assert!(s.contains("m.gguf"), "error does not name the file: {s}");
            s
        }
    }
}

/// Byte offset of the tensor info of `name` in a sample file (the u64 length
/// that precedes the name).
fn info_pos(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
}

#[test]
fn bad_magic() {
    let e = corrupt(|b| b[0] = b'X');
    assert!(e.contains("not a GGUF file"), "{e}");
    let e = corrupt(|b| b.truncate(2));
    assert!(e.contains("not a GGUF file"), "{e}");
}

#[test]
fn bad_version() {
    let e = corrupt(|b| b[4..8].copy_from_slice(&7u32.to_le_bytes()));
    assert!(e.contains("version 7"), "{e}");
}

#[test]
fn truncated_header_and_metadata() {
    let e = corrupt(|b| b.truncate(10));
    assert!(e.contains("truncated") && e.contains("header"), "{e}");
    let e = corrupt(|b| b.truncate(60));
    assert!(e.contains("truncated") && e.contains("metadata"), "{e}");
    // A huge string length.
    let e = corrupt(|b| {
        let p = info_pos(b, "general.architecture") + 8 + "general.architecture".len() + 4;
        b[p..p + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    });
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn truncated_tensor_data() {
    let e = corrupt(|b| {
        let n = b.len();
        b.truncate(n - 10);
    });
    assert!(e.contains("exps") && e.contains("beyond the end"), "{e}");
}

#[test]
fn tensor_offset_beyond_end() {
    let e = corrupt(|b| {
        let p = info_pos(b, "norm") + 8 + 4 + 4 + 8 + 4;
        b[p..p + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    });
    assert!(e.contains("norm") && e.contains("beyond the end"), "{e}");
}

#[test]
fn unknown_tensor_type() {
    let e = corrupt(|b| {
        let p = info_pos(b, "norm") + 8 + 4 + 4 + 8;
        b[p..p + 4].copy_from_slice(&99u32.to_le_bytes());
    });
    assert!(
        e.contains("norm") && e.contains("unknown ggml type id 99"),
        "{e}"
    );
}

#[test]
fn unknown_value_type_and_bad_alignment() {
    let e = corrupt(|b| {
        let p = info_pos(b, "general.architecture") + 8 + "general.architecture".len();
        b[p..p + 4].copy_from_slice(&42u32.to_le_bytes());
    });
    assert!(e.contains("unknown value type 42"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut meta = sample_meta();
    meta.push((ALIGNMENT_KEY.into(), Value::U32(48)));
    let e = GgufWriter::create(&path, &meta, vec![], Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("power of two"), "{e}");
}

#[test]
fn misaligned_row_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let e = GgufWriter::create(
        &path,
        &[],
        vec![TensorDecl::new("x", &[40, 2], GgmlType::Q4_0)],
        Default::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("not a multiple"), "{e}");
}

#[test]
fn type_table() {
    for id in 0..64 {
        if let Some(t) = GgmlType::from_id(id) {
            assert_eq!(t.id(), id);
        }
    }
    assert_eq!(GgmlType::Q6_K.row_bytes(512), Some(420));
    assert_eq!(GgmlType::BF16.row_bytes(3), Some(6));
    assert_eq!(GgmlType::Q8_0.row_bytes(33), None);
}

/// The writer replaces a valid GGUF, a damaged one only with force, and
/// never a file that is not GGUF or a directory; dead writers' temps go.
#[test]
fn output_replaces_only_gguf_files() {
    let dir = tempfile::tempdir().unwrap();
    let meta = sample_meta();
    let path = dir.path().join("m.gguf");
    let create = |overwrite| GgufWriter::create(&path, &meta, vec![], overwrite);

    std::fs::write(&path, b"my notes, not a model").unwrap();
    for overwrite in [Overwrite::VerifiedOnly, Overwrite::Force] {
        let e = create(overwrite).err().unwrap().to_string();
        assert!(e.contains("not a GGUF file"), "{e}");
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"my notes, not a model");

    std::fs::remove_file(&path).unwrap();
    write_sample(&path, &meta);
    write_sample(&path, &meta); // a valid GGUF is replaced

    let good = std::fs::read(&path).unwrap();
    std::fs::write(&path, &good[..40]).unwrap();
    let e = create(Overwrite::VerifiedOnly).err().unwrap().to_string();
    assert!(e.contains("damaged") && e.contains("--force"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap().len(), 40);
    let stale = dir.path().join(".m.gguf.tmp-9999999");
    std::fs::write(&stale, b"GGUF half").unwrap();
    create(Overwrite::Force).unwrap().finish().unwrap();
    assert!(GgufFile::open(&path).is_ok());
    assert!(!stale.exists());

    let sub = dir.path().join("d.gguf");
    std::fs::create_dir(&sub).unwrap();
    let e = GgufWriter::create(&sub, &meta, vec![], Overwrite::Force)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a regular file"), "{e}");
}
