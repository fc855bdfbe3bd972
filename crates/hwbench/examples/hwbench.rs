//! The benchmark without the CLI:
//! `cargo run --release -p slipstream-hwbench --example hwbench -- [quick] [no-ssd] [sustain=SECS] [gb=N] [dir=PATH] [json=PATH] [skip-kernels]`
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{k}=")).map(str::to_string))
    };
    let dir = std::path::PathBuf::from(get("dir").unwrap_or_else(|| ".".into()));
    let mut cfg = if args.iter().any(|a| a == "quick") {
        slipstream_hwbench::Config::quick(dir)
    } else {
        slipstream_hwbench::Config::full(
            dir,
            get("gb").map_or(8.0, |v| v.parse().unwrap()),
            get("sustain").map_or(60.0, |v| v.parse().unwrap()),
        )
    };
    cfg.skip_ssd = args.iter().any(|a| a == "no-ssd");
    let r = slipstream_hwbench::run(&cfg, &mut |l| eprintln!("[hwbench] {l}")).unwrap();
    print!("{}", r.table());
    if let Some(p) = get("json") {
        std::fs::write(p, serde_json::to_string_pretty(&r).unwrap()).unwrap();
    }
}
