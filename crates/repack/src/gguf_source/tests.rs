use super::*;

#[test]
fn untile_inverts_the_converter_reorder() {
    // Converter: grouped [nk, r] -> tiled [r, nk]; tiled position
    // j * nk + k holds grouped head k * r + j.
    let (nk, r) = (2, 3);
    let tiled: Vec<usize> = (0..r)
        .flat_map(|j| (0..nk).map(move |k| k * r + j))
        .collect();
    let back: Vec<usize> = untile_heads(nk, r).iter().map(|&s| tiled[s]).collect();
    assert_eq!(back, (0..nk * r).collect::<Vec<_>>());
    let rows = head_rows(2 + nk * r * 2, 2, nk, r, 2);
    assert_eq!(&rows[..2], &[0, 1]);
    assert_eq!(rows.len(), 14);
}

#[test]
fn unsupported_architecture_and_corrupt_file_are_clear_errors() {
    use slipstream_gguf::GgufWriter;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama.gguf");
    let meta = vec![(
        "general.architecture".to_string(),
        Value::String("llama".into()),
    )];
    GgufWriter::create(&path, &meta, vec![], Default::default())
        .unwrap()
        .finish()
        .unwrap();
    let opts = |input: std::path::PathBuf| RepackOptions {
        input,
        output: dir.path().join("out.slip"),
        overwrite: Default::default(),
        quant: Default::default(),
        ggml_to_affine: false,
    };
    assert!(slipstream_gguf::is_gguf_file(&path));
    let e = repack_gguf(&opts(path.clone()), &|_| {})
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("llama") && e.contains("qwen35moe"), "{e}");
    // Truncated: the error names the file.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..30]).unwrap();
    let e = repack_gguf(&opts(path.clone()), &|_| {})
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("llama.gguf") && e.contains("truncated"), "{e}");
    assert!(!dir.path().join("out.slip").exists());
}

/// `ssm_out` columns: the f32 path (elements move) and the Q8_0 path with
/// a head of 16 columns (half a block: dequantized to f32) agree.
#[test]
fn out_proj_column_permutation_f32_and_dequantized_agree() {
    use slipstream_gguf::{GgufWriter, TensorDecl};
    let (h, nk, r, dv) = (3usize, 2usize, 2usize, 16usize);
    let cols = nk * r * dv;
    let q: Vec<i8> = (0..h * cols)
        .map(|i| (i as i32 % 200 - 100) as i8)
        .collect();
    let mut q8 = Vec::new();
    for row in q.chunks(cols) {
        for blk in row.chunks(32) {
            q8.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            q8.extend(blk.iter().map(|&x| x as u8));
        }
    }
    let f32s: Vec<u8> = q
        .iter()
        .flat_map(|&x| (x as f32 * 0.5).to_le_bytes())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    let dims = [cols as u64, h as u64];
    let mut w = GgufWriter::create(
        &path,
        &[],
        vec![
            TensorDecl::new("a", &dims, GgmlType::F32),
            TensorDecl::new("b", &dims, GgmlType::Q8_0),
        ],
        Default::default(),
    )
    .unwrap();
    w.write(&f32s).unwrap();
    w.write(&q8).unwrap();
    w.finish().unwrap();
    let f = GgufFile::open(&path).unwrap();
    let src = Src {
        f: &f,
        path: "t".into(),
        read: Default::default(),
    };
    let a = out_proj(&src, "a", "x", h, nk, r, dv).unwrap();
    let b = out_proj(&src, "b", "x", h, nk, r, dv).unwrap();
    assert_eq!((a.qtype, b.qtype), (QuantType::F32, QuantType::F32));
    assert_eq!(a.bytes, b.bytes);
    // Grouped head 1 (key head 0, second value head) sits at tiled position nk.
    let val =
        |bytes: &[u8], i: usize| f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(val(&a.bytes, dv), q[nk * dv] as f32 * 0.5);
    assert_ne!(a.bytes, f32s);
}

#[test]
fn broken_tokenizer_metadata_is_refused_before_any_tensor() {
    use slipstream_gguf::GgufWriter;
    let dir = tempfile::tempdir().unwrap();
    let strs = |v: &[&str]| Value::strings(v.iter().map(|s| s.to_string()).collect());
    let write = |name: &str, merges: &[&str]| {
        let path = dir.path().join(name);
        let meta = vec![
            (
                "tokenizer.ggml.model".to_string(),
                Value::String("gpt2".into()),
            ),
            ("tokenizer.ggml.tokens".to_string(), strs(&["a", "b", "ab"])),
            ("tokenizer.ggml.merges".to_string(), strs(merges)),
        ];
        GgufWriter::create(&path, &meta, vec![], Default::default())
            .unwrap()
            .finish()
            .unwrap();
        let f = GgufFile::open(&path).unwrap();
        let json = tokenizer(&f).tokenizer_json.expect("a tokenizer is built");
        check_tokenizer(&json, 8, name).map_err(|e| e.to_string())
    };
    write("good.gguf", &["a b"]).unwrap();
    for (name, merges) in [
        ("unknown.gguf", &["a zz"][..]),
        ("single.gguf", &["ab"][..]),
    ] {
        let e = write(name, merges).unwrap_err();
        assert!(
            e.contains(name) && e.contains("does not make a tokenizer"),
            "{e}"
        );
    }
    // More tokens than the embedding has rows.
    let path = dir.path().join("good.gguf");
    let f = GgufFile::open(&path).unwrap();
    let json = tokenizer(&f).tokenizer_json.unwrap();
    let e = check_tokenizer(&json, 2, "good.gguf")
        .unwrap_err()
        .to_string();
    assert!(e.contains("vocab_size"), "{e}");
}
