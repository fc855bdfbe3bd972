//! `--output` never destroys what the user did not ask to replace: a
//! directory of other files, a regular file, the checkpoint being read.
//! A verified model is replaced atomically; a damaged one only with force.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::*;
use safetensors::Dtype;
use slipstream_format::{Overwrite, SlipModel};
use slipstream_repack::*;

fn checkpoint(dir: &Path) {
    let t = Tiny::qwen3();
    let src = hf_tensors(&t, false, "model.", false, true);
    save(dir, &floats_to_raw(&src, Dtype::F32), 1);
    write_json(&dir.join("config.json"), &t.qwen3_config());
}

fn repack_to(input: &Path, output: &Path, overwrite: Overwrite) -> Result<RepackReport> {
    repack(
        &RepackOptions {
            input: input.to_path_buf(),
            output: output.to_path_buf(),
            overwrite,
            quant: QuantChoice::F32,
            ggml_to_affine: false,
        },
        &|_| {},
    )
}

/// Every file under `dir` with its bytes, to show nothing changed.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn setup() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("ckpt");
    checkpoint(&input);
    (d, input)
}

#[test]
fn a_directory_of_other_files_is_refused_and_untouched() {
    let (d, input) = setup();
    let docs = d.path().join("mydocs");
    fs::create_dir_all(docs.join("sub")).unwrap();
    fs::write(docs.join("thesis.tex"), b"years of work").unwrap();
    fs::write(docs.join("sub/notes.txt"), b"more").unwrap();
    let before = snapshot(d.path());
    for overwrite in [Overwrite::VerifiedOnly, Overwrite::Force] {
        let e = repack_to(&input, &docs, overwrite).unwrap_err().to_string();
        assert!(e.contains("not a slipstream model"), "{e}");
        assert!(e.contains("nothing was written or removed"), "{e}");
    }
    assert_eq!(snapshot(d.path()), before, "nothing may change");
}

#[test]
fn a_regular_file_is_refused_and_untouched() {
    let (d, input) = setup();
    let file = d.path().join("notes.txt");
    fs::write(&file, b"keep me").unwrap();
    let before = snapshot(d.path());
    for overwrite in [Overwrite::VerifiedOnly, Overwrite::Force] {
        let e = repack_to(&input, &file, overwrite).unwrap_err().to_string();
        assert!(e.contains("is a file"), "{e}");
    }
    assert_eq!(snapshot(d.path()), before);
}

#[test]
fn an_output_equal_to_inside_or_above_the_input_is_refused() {
    let (d, input) = setup();
    let before = snapshot(d.path());
    for (out, how) in [
        (input.clone(), " is the input"),
        (input.join("m.slip"), "lies inside"),
        (d.path().to_path_buf(), "contains"),
    ] {
        let e = repack_to(&input, &out, Overwrite::Force)
            .unwrap_err()
            .to_string();
        assert!(e.contains(how), "{out:?}: {e}");
    }
    assert_eq!(snapshot(d.path()), before);
}

#[test]
fn a_model_is_replaced_and_a_damaged_one_needs_force() {
    let (d, input) = setup();
    let out = d.path().join("m.slip");
    repack_to(&input, &out, Overwrite::VerifiedOnly).unwrap();
    // Replacing a verified model needs nothing more.
    repack_to(&input, &out, Overwrite::VerifiedOnly).unwrap();
    SlipModel::open(&out).unwrap();
    // A model whose manifest is gone.
    fs::remove_file(out.join("manifest.json")).unwrap();
    let before = snapshot(d.path());
    let e = repack_to(&input, &out, Overwrite::VerifiedOnly)
        .unwrap_err()
        .to_string();
    assert!(e.contains("damaged") && e.contains("--force"), "{e}");
    assert_eq!(snapshot(d.path()), before);
    repack_to(&input, &out, Overwrite::Force).unwrap();
    SlipModel::open(&out).unwrap();
    // Only the model is left: no temp or old directory beside it.
    let names: Vec<_> = fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn an_empty_directory_is_filled() {
    let (d, input) = setup();
    let out = d.path().join("empty");
    fs::create_dir(&out).unwrap();
    repack_to(&input, &out, Overwrite::VerifiedOnly).unwrap();
    SlipModel::open(&out).unwrap();
}

#[test]
fn temp_directories_of_killed_writers_are_cleaned_up() {
    let (d, input) = setup();
    let out = d.path().join("m.slip");
    // What a repack killed with -9 leaves: a half-written temp directory
    // under the name of a process that no longer exists.
    let stale = d.path().join(".m.slip.tmp-9999999");
    fs::create_dir(&stale).unwrap();
    fs::write(stale.join("experts.bin"), vec![0u8; 4096]).unwrap();
    // And one of a process that is alive (this one's parent): kept.
    let live = d.path().join(format!(
        ".m.slip.tmp-{}",
        std::os::unix::process::parent_id()
    ));
    fs::create_dir(&live).unwrap();
    repack_to(&input, &out, Overwrite::VerifiedOnly).unwrap();
    assert!(!stale.exists());
    assert!(live.exists());
}
