//! With no memory flags `slipstream run` sizes the expert store from the
//! machine's memory and says so in one `[memory]` line; a smaller memory
//! (simulated with the hidden `--assume-memory`) gives fewer slots and the
//! same tokens.

use slipstream_testkit::bin;
use slipstream_testkit::cli::ok;

/// The `[memory]` line of a run's stderr.
fn plan_line(stderr: &str) -> &str {
    stderr
        .lines()
        .find(|l| l.starts_with("[memory] "))
        .unwrap_or_else(|| panic!("no [memory] line: {stderr}"))
}

/// The expert slots per layer a `[memory]` line chose.
fn chosen_slots(line: &str) -> usize {
    let after = line
        .split_once("chose ")
        .unwrap_or_else(|| panic!("no choice in: {line}"))
        .1;
    after
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no slot count in: {line}"))
}

/// Generated token ids of a greedy demo run with `flags`, and its stderr.
fn demo_ids(cache: &std::path::Path, flags: &[&str]) -> (String, String) {
    ok(bin!()
        .args(["run", "--max-new", "24", "--print-ids"])
        .args(flags)
        .env("SLIPSTREAM_CACHE", cache)
        .output()
        .unwrap())
}

#[test]
fn no_memory_flags_print_the_plan_the_machine_affords() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, stderr) = demo_ids(tmp.path(), &[]);
    let line = plan_line(&stderr);
    // The demo model (a few MB) fits any machine: every expert gets a slot.
    assert!(line.starts_with("[memory] detected "), "{line}");
    assert!(
        line.contains("available of") && line.contains("cgroup limit"),
        "{line}"
    );
    assert!(
        line.contains("chose 16 of 16 expert slots per layer (every expert fits)"),
        "{line}"
    );
    assert!(line.contains("direct I/O "), "{line}");
    assert!(line.contains("prompt chunk 4096 (default)"), "{line}");
    assert!(line.contains("predicted footprint"), "{line}");
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("[memory]")).count(),
        1
    );
    // An explicit flag wins and is named as the reason.
    let (_, stderr) = demo_ids(tmp.path(), &["--expert-cache-slots", "3"]);
    assert!(
        plan_line(&stderr).contains("chose 3 of 16 expert slots per layer (--expert-cache-slots)"),
        "{stderr}"
    );
}

#[test]
fn a_smaller_memory_gives_fewer_slots_and_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let (resident, _) = demo_ids(tmp.path(), &["--resident"]);
    // Half the experts' slots on top of what the run needs besides them,
    // with the planning margin added back.
    let file = slipstream_cli::demo::open_demo_model(&|_| {}).unwrap();
    let sizes = slipstream_engine::ModelSizes::of(&file);
    let context = 24 + 4096;
    let fixed = sizes.footprint(0, context, 256).total();
    let half = fixed + sizes.slot_bytes_all_layers() * (sizes.experts as u64 / 2);
    let assume = half / 9 * 10;
    let (ids, stderr) = demo_ids(tmp.path(), &["--assume-memory", &assume.to_string()]);
    let line = plan_line(&stderr);
    assert!(line.contains("(--assume-memory)"), "{line}");
    let slots = chosen_slots(line);
    assert!(slots >= 1 && slots < sizes.experts, "{line}");
    assert_eq!(ids, resident, "{line}");
    // Less memory still: fewer slots again, the same tokens.
    let (ids, stderr) = demo_ids(
        tmp.path(),
        &[
            "--assume-memory",
            &((fixed + 2 * sizes.slot_bytes_all_layers()) / 9 * 10).to_string(),
        ],
    );
    let fewer = chosen_slots(plan_line(&stderr));
    assert!(fewer >= 1 && fewer < slots, "{fewer} vs {slots}: {stderr}");
    assert_eq!(ids, resident);
    // Too little for the dense weights: a clear error naming the figures.
    let out = bin!()
        .args(["run", "--max-new", "4", "--assume-memory", "1M"])
        .env("SLIPSTREAM_CACHE", tmp.path())
        .output()
        .unwrap();
    let err = slipstream_testkit::cli::failed(out);
    assert!(
        err.contains("leaves no room for expert slots") && err.contains("--expert-cache-slots"),
        "{err}"
    );
}
