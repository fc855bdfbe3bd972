//! Writes a synthetic preset (the library behind `slipstream synth`):
//! cargo run --release -p slipstream-synth --example write -- PRESET OUTPUT [SEED] [LAYERS]

use slipstream_synth::{options, Preset, Skew, SynthEvent};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let preset: Preset = a[1].parse().unwrap();
    let out = std::path::PathBuf::from(&a[2]);
    let seed = a.get(3).map_or(0, |s| s.parse().unwrap());
    let layers = a.get(4).map(|s| s.parse().unwrap());
    let opts = options(preset, layers, seed, Skew::DEFAULT, &out);
    let done = std::sync::atomic::AtomicU64::new(0);
    let rep = slipstream_synth::synthesize(&opts, &|ev| {
        if let SynthEvent::Bytes(n) = ev {
            let before = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            if (before + n) >> 30 != before >> 30 {
                eprintln!("{} GiB", (before + n) >> 30);
            }
        }
    })
    .unwrap();
    println!(
        "wrote {}: {} bytes ({:.2} GB; dense {} experts {}) in {:.1} s = {:.0} MB/s, hash {}",
        out.display(),
        rep.bytes_out,
        rep.bytes_out as f64 / 1e9,
        rep.dense_bytes,
        rep.expert_bytes,
        rep.seconds,
        rep.mb_per_s,
        rep.model_hash
    );
}
