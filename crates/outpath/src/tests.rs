use super::*;

fn all_ours(_: &Path) -> bool {
    true
}

/// A pid no process has: above the kernel's pid_max (at most 2^22).
const DEAD_PID: u32 = 9_999_999;

#[test]
fn leftover_names_parse() {
    let p = |s: &str| parse_leftover(OsStr::new(s), "m.slip");
    assert_eq!(
        p(".m.slip.tmp-42"),
        Some(Leftover {
            pid: Some(42),
            old: false
        })
    );
    assert_eq!(
        p(".m.slip.tmp-42.old"),
        Some(Leftover {
            pid: Some(42),
            old: true
        })
    );
    assert_eq!(
        p(".m.slip.tmp-42-7.old"),
        Some(Leftover {
            pid: Some(42),
            old: true
        })
    );
    assert_eq!(
        p(".m.slip.old"),
        Some(Leftover {
            pid: None,
            old: true
        })
    );
    for other in [
        "m.slip",
        ".m.slip",
        ".m.slip.tmp-",
        ".m.slip.tmp-4x",
        ".m.slip.tmp-4-",
        ".m.slip.tmp-4-x",
        ".m.slipx.tmp-4",
        ".other.tmp-4",
    ] {
        assert_eq!(p(other), None, "{other}");
    }
}

#[test]
fn dead_writers_temps_are_removed_live_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("m.slip");
    let dead = dir.path().join(format!(".m.slip.tmp-{DEAD_PID}"));
    let live = dir
        .path()
        .join(format!(".m.slip.tmp-{}", std::process::id()));
    let unrelated = dir.path().join(".n.slip.tmp-1");
    for d in [&dead, &live, &unrelated] {
        fs::create_dir(d).unwrap();
        fs::write(d.join("dense.bin"), b"x").unwrap();
    }
    let report = clean_stale_temps(&target, &all_ours).unwrap();
    assert_eq!(report.len(), 1, "{report:?}");
    assert!(!dead.exists());
    assert!(live.exists() && unrelated.exists());
}

#[test]
fn a_leftover_that_is_not_ours_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("m.slip");
    let dead = dir.path().join(format!(".m.slip.tmp-{DEAD_PID}"));
    fs::create_dir(&dead).unwrap();
    fs::write(dead.join("thesis.tex"), b"precious").unwrap();
    let report = clean_stale_temps(&target, &|p| !p.join("thesis.tex").exists()).unwrap();
    assert!(report[0].contains("left"), "{report:?}");
    assert_eq!(fs::read(dead.join("thesis.tex")).unwrap(), b"precious");
}

#[test]
fn an_interrupted_replace_puts_the_old_output_back() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("m.slip");
    let aside = dir.path().join(format!(".m.slip.tmp-{DEAD_PID}.old"));
    let half_new = dir.path().join(format!(".m.slip.tmp-{DEAD_PID}"));
    fs::create_dir(&aside).unwrap();
    fs::write(aside.join("manifest.json"), b"old").unwrap();
    fs::create_dir(&half_new).unwrap();
    clean_stale_temps(&target, &all_ours).unwrap();
    assert_eq!(fs::read(target.join("manifest.json")).unwrap(), b"old");
    assert!(!aside.exists() && !half_new.exists());
}

#[test]
fn an_old_output_beside_a_present_target_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("m.slip");
    fs::create_dir(&target).unwrap();
    fs::write(target.join("manifest.json"), b"new").unwrap();
    let legacy = dir.path().join(".m.slip.old");
    fs::create_dir(&legacy).unwrap();
    clean_stale_temps(&target, &all_ours).unwrap();
    assert!(!legacy.exists());
    assert_eq!(fs::read(target.join("manifest.json")).unwrap(), b"new");
}

#[test]
fn replace_swaps_directories_and_files() {
    let dir = tempfile::tempdir().unwrap();
    // Directory onto nothing, then onto the old directory.
    let target = dir.path().join("m.slip");
    for content in [b"one", b"two"] {
        let tmp = temp_path(&target).unwrap();
        fs::create_dir(&tmp).unwrap();
        fs::write(tmp.join("manifest.json"), content).unwrap();
        replace(&tmp, &target).unwrap();
        assert!(!tmp.exists());
        assert_eq!(fs::read(target.join("manifest.json")).unwrap(), content);
    }
    // File onto a file.
    let file = dir.path().join("m.gguf");
    fs::write(&file, b"old").unwrap();
    let tmp = temp_path(&file).unwrap();
    fs::write(&tmp, b"new").unwrap();
    replace(&tmp, &file).unwrap();
    assert_eq!(fs::read(&file).unwrap(), b"new");
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn outputs_overlapping_the_input_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("ckpt");
    fs::create_dir(&input).unwrap();
    let err = |out: PathBuf| check_disjoint(&input, &out).unwrap_err();
    assert!(err(input.clone()).contains(" is the input"));
    assert!(err(input.join("sub/m.slip")).contains("lies inside"));
    assert!(err(dir.path().to_path_buf()).contains("contains"));
    // Through `..` and a symlink.
    assert!(err(input.join("x/..")).contains(" is the input"));
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    assert!(err(link.join("m.slip")).contains("lies inside"));
    check_disjoint(&input, &dir.path().join("m.slip")).unwrap();
    // A file input and an output beside it.
    let gguf = dir.path().join("m.gguf");
    fs::write(&gguf, b"GGUF").unwrap();
    assert!(check_disjoint(&gguf, &gguf).is_err());
    check_disjoint(&gguf, &dir.path().join("m2.slip")).unwrap();
}
