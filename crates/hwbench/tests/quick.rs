//! `hwbench --quick` smoke test: every section runs and reports sane numbers.

#[test]
fn quick_run_reports_every_section() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = slipstream_hwbench::Config::quick(dir.path().to_path_buf());
    cfg.sustain_secs = 0.2;
    let mut lines = Vec::new();
    let r = slipstream_hwbench::run(&cfg, &mut |l| lines.push(l.to_string())).unwrap();
    let ssd = r.ssd.as_ref().unwrap();
    for pat in [
        "seq_4m",
        "expert_3reads",
        "expert_1read",
        "random_4k",
        "cached_ram",
    ] {
        for &t in &cfg.io_threads {
            let p = ssd
                .tests
                .iter()
                .find(|p| p.pattern == pat && p.threads == t)
                .unwrap_or_else(|| panic!("missing {pat} x{t}"));
            assert!(p.bytes > 0 && p.gb_s > 0.0, "{pat} x{t}: {p:?}");
        }
    }
    assert!(r.best_reader_threads.is_some());
    assert!(!r.memory.is_empty() && r.memory_best_gb_s > 0.0);
    assert!(r.kernels.iter().all(|k| k.gb_s > 0.0 && k.gflop_s > 0.0));
    assert!(r.kernels.iter().any(|k| k.name == "q4_matmul_prefill"));
    assert_eq!(r.sustain.as_ref().unwrap().windows_gb_s.len(), 4);
    let table = r.table();
    assert!(table.contains("expert_1read") && table.contains("memory read bandwidth"));
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"best_reader_threads\""));
    // The scratch file is gone.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
