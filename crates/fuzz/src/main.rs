//! `slipstream-fuzz`: mutation fuzzing of every reader of untrusted bytes
//! (GGUF, safetensors headers, config.json, the manifest, KV snapshots,
//! prompt-cache entries, route traces, the APIs' request bodies), on stable
//! Rust and for a bounded time, so CI runs it every time.
//!
//! ```text
//! cargo run -p slipstream-fuzz --profile test -- --seconds 15 [--target NAME] [--seed N] [--out DIR]
//! ```
//!
//! Each target starts from committed fixtures (or files written from them)
//! and feeds mutants (see [`mutate`]) to the reader for `--seconds`. A
//! panic is a finding: the input is written to `--out` (default
//! `target/fuzz-findings`), its path printed, and the run exits 1 after the
//! other targets. Replay one with `--replay FILE --target NAME`; commit it
//! as `crates/fuzz/regressions/TARGET-WHAT.bin` and every run replays it first.

mod mutate;
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mutate::{mutate, Rng};

struct Args {
    seconds: f64,
    target: Option<String>,
    seed: u64,
    out: PathBuf,
    replay: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        seconds: 15.0,
        target: None,
        seed: 1,
        out: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fuzz-findings"),
        replay: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--seconds" => {
                a.seconds = value()?
                    .parse()
                    .map_err(|e| format!("--seconds: {e}"))?;
                if !(a.seconds.is_finite() && a.seconds > 0.0) {
                    return Err("--seconds must be a positive number".into());
                }
            }
            "--target" => a.target = Some(value()?),
            "--seed" => a.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--out" => a.out = PathBuf::from(value()?),
            "--replay" => a.replay = Some(PathBuf::from(value()?)),
            "-h" | "--help" => {
                return Err(
                    "usage: slipstream-fuzz [--seconds N (per target, default 15)] [--target NAME] [--seed N] [--out DIR] [--replay FILE --target NAME]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

/// The committed inputs of past findings for `target`
/// (`crates/fuzz/regressions/TARGET-*.bin`), replayed on every run.
fn regressions(target: &str) -> Result<Vec<Vec<u8>>, String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("regressions");
    let prefix = format!("{target}-");
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".bin"))
        })
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
        .collect()
}

/// The message of the last panic on this thread, from the hook.
type LastPanic = Arc<Mutex<Option<String>>>;

fn quiet_panics() -> LastPanic {
    let last: LastPanic = Arc::default();
    let hook_last = last.clone();
    std::panic::set_hook(Box::new(move |info| {
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        *hook_last.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{msg}{at}"));
    }));
    last
}

/// The input being run: target, bytes, since when.
type Current = Arc<Mutex<Option<(&'static str, Vec<u8>, Instant)>>>;

/// Most time one input may take before it counts as a hang.
const HANG: Duration = Duration::from_secs(10);

/// Watches the input being run: one that takes longer than [`HANG`] is a
/// finding (a reader that loops or grows without bound); its input is
/// written out and the process ends, as nothing can stop that thread.
fn watchdog(out: PathBuf) -> Current {
    let current: Current = Arc::default();
    let watched = current.clone();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(500));
        let slot = watched.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((name, input, since)) = slot.as_ref() {
            if since.elapsed() > HANG {
                let _ = std::fs::create_dir_all(&out);
                let path = out.join(format!("{name}-hang.bin"));
                let saved = std::fs::write(&path, input).is_ok();
                println!(
                    "FOUND {name}: one input ran for more than {} s{}",
                    HANG.as_secs(),
                    if saved {
                        format!(
                            "\n  input: {} (replay: --target {name} --replay {})",
                            path.display(),
                            path.display()
                        )
                    } else {
                        String::new()
                    }
                );
                std::process::exit(1);
            }
        }
    });
    current
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let work = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: scratch directory: {e}");
            return ExitCode::from(2);
        }
    };
    let mut all = match targets::all(work.path()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: preparing the targets: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(name) = &args.target {
        all.retain(|t| t.name == name);
        if all.is_empty() {
            eprintln!("error: no target {name:?}");
            return ExitCode::from(2);
        }
    }
    let last_panic = quiet_panics();
    if let Some(path) = &args.replay {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("error: {}: {e}", path.display());
                return ExitCode::from(2);
            }
        };
        let mut failed = false;
        for t in &mut all {
            let r = catch_unwind(AssertUnwindSafe(|| (t.run)(&bytes)));
            if r.is_err() {
                let msg = last_panic.lock().unwrap().take().unwrap_or_default();
                println!("{}: panics: {msg}", t.name);
                failed = true;
            } else {
                println!("{}: no panic", t.name);
            }
        }
        return if failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
    }

    let budget = Duration::from_secs_f64(args.seconds);
    let current = watchdog(args.out.clone());
    let mut findings = 0usize;
    for t in all.iter_mut() {
        // Seeded by name: `--target NAME` replays a target's run alone.
        let name_hash = t.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let mut rng = Rng::new(args.seed ^ name_hash);
        // Named first: an abort (an allocation the OS refuses) ends the
        // process, and the same --seed replays it.
        println!("{}: fuzzing for {:.0} s", t.name, args.seconds);
        let t0 = Instant::now();
        let (mut runs, mut found) = (0u64, 0usize);
        // The seeds and every committed regression first: they must pass.
        let mut queue: Vec<Vec<u8>> = t.seeds.clone();
        match regressions(t.name) {
            Ok(found) => queue.extend(found),
            Err(e) => {
                eprintln!("error: {}: {e}", t.name);
                return ExitCode::from(2);
            }
        }
        while t0.elapsed() < budget {
            let input = queue.pop().unwrap_or_else(|| {
                let i = rng.below(t.seeds.len());
                let mut m = t.seeds[i].clone();
                let other = &t.seeds[rng.below(t.seeds.len())];
                mutate(&mut rng, &mut m, other, t.text, t.focus);
                m
            });
            runs += 1;
            *current.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((t.name, input.clone(), Instant::now()));
            let result = catch_unwind(AssertUnwindSafe(|| (t.run)(&input)));
            *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    eprintln!("error: {}: the harness failed: {e}", t.name);
                    return ExitCode::from(2);
                }
                Err(_) => {
                    let msg = last_panic
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take()
                        .unwrap_or_default();
                    found += 1;
                    let _ = std::fs::create_dir_all(&args.out);
                    let path = args.out.join(format!("{}-{runs}.bin", t.name));
                    match std::fs::write(&path, &input) {
                        Ok(()) => println!(
                            "FOUND {}: panic: {msg}\n  input: {} (replay: --target {} --replay {})",
                            t.name,
                            path.display(),
                            t.name,
                            path.display()
                        ),
                        Err(e) => println!("FOUND {}: panic: {msg} (input not saved: {e})", t.name),
                    }
                    if found >= 5 {
                        break;
                    }
                }
            }
        }
        println!(
            "{:<18} {runs:>8} inputs in {:.1} s, {found} panics",
            t.name,
            t0.elapsed().as_secs_f64()
        );
        findings += found;
    }
    if findings > 0 {
        println!("{findings} findings");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
