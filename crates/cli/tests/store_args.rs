//! `run` and `serve` share one group of expert store, memory and backend
//! flags (`slipstream_cli::store_args::StoreArgs`): the same names and help,
//! and the same flags give the same engine configuration.

use std::process::Command;

use clap::Parser;
use slipstream_cli::serve_cmd::{server_settings, ServeArgs};
use slipstream_cli::store_args::StoreArgs;
use slipstream_server::BackendSpec;

#[derive(Parser)]
struct Store {
    #[command(flatten)]
    store: StoreArgs,
}

#[derive(Parser)]
struct Serve {
    #[command(flatten)]
    serve: ServeArgs,
}

const SHARED: [&str; 15] = [
    "--expert-cache-slots",
    "--memory-budget",
    "--prefill-chunk",
    "--memory-limit",
    "--expert-cache-policy",
    "--io-threads",
    "--direct-io",
    "--readahead",
    "--no-background-fill",
    "--resident",
    "--route-trace",
    "--backend",
    "--vram-slots",
    "--vram-budget",
    "--ram-cache-slots",
];

fn help(command: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_slipstream"))
        .args([command, "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// The help text of `flag`: its line and the indented lines under it.
fn flag_help(help: &str, flag: &str) -> Option<String> {
    let mut lines = help.lines().skip_while(|l| {
        !l.trim_start()
            .split([' ', ',', '['])
            .any(|word| word == flag || word.starts_with(&format!("{flag}=")))
    });
    let first = lines.next()?;
    let rest: Vec<&str> = lines
        .take_while(|l| !l.trim_start().starts_with('-') && !l.trim().is_empty())
        .collect();
    Some(format!("{first}\n{}", rest.join("\n")))
}

#[test]
fn serve_lists_the_store_flags_of_run_with_the_same_help() {
    let (run, serve) = (help("run"), help("serve"));
    for flag in SHARED {
        let r = flag_help(&run, flag).unwrap_or_else(|| panic!("run lacks {flag}"));
        let s = flag_help(&serve, flag).unwrap_or_else(|| panic!("serve lacks {flag}"));
        assert_eq!(r, s, "{flag}");
    }
}

#[test]
fn serve_plans_the_store_as_run_does_for_the_same_flags() {
    let file = slipstream_cli::demo::open_demo_model(&|_| {}).unwrap();
    let model = file.dir.clone();
    let flags = [
        "--memory-budget",
        "2G",
        "--prefill-chunk",
        "64",
        "--memory-limit",
        "20G",
        "--readahead",
        "random",
        "--no-background-fill",
        "--expert-cache-policy",
        "lru",
        "--io-threads",
        "3",
        "--direct-io",
        "off",
        "--backend",
        "cpu",
    ];
    let store = Store::try_parse_from(std::iter::once("run").chain(flags))
        .unwrap()
        .store;
    let plan = store.plan(&file, 1000).unwrap();
    assert_eq!(plan.engine.prefill_chunk, 64);
    assert_eq!(plan.engine.memory_limit, Some(20 << 30));
    let slipstream_engine::StoreChoice::Streaming(sc) = &plan.engine.store else {
        panic!("streaming expected: {:?}", plan.engine.store);
    };
    assert_eq!(sc.readahead, slipstream_store::Readahead::Random);
    assert!(!sc.background_fill);
    assert_eq!(sc.io_threads, 3);
    assert!(!sc.direct_io);
    assert!(matches!(
        plan.engine.backend,
        slipstream_engine::BackendChoice::Cpu
    ));

    let serve = Serve::try_parse_from(
        ["serve", "--max-context", "1000", "--model"]
            .into_iter()
            .chain([model.to_str().unwrap()])
            .chain(flags),
    )
    .unwrap()
    .serve;
    let (_, spec) = server_settings(&serve, model.clone()).unwrap();
    let BackendSpec::Model { engine, .. } = spec else {
        panic!("a model backend expected");
    };
    assert_eq!(format!("{engine:?}"), format!("{:?}", plan.engine));

    // A budget too small for the dense weights is refused, not ignored.
    let tiny = Serve::try_parse_from(
        ["serve", "--memory-budget", "1K", "--model"]
            .into_iter()
            .chain([model.to_str().unwrap()]),
    )
    .unwrap()
    .serve;
    assert!(server_settings(&tiny, model.clone()).is_err());
}
