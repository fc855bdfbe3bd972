//! Calibration of the router skew: writes a small-layer synthetic model,
//! runs a random prompt greedily and replays the routes through LRU/Belady.
//!
//! cargo run --release -p slipstream-synth --example calibrate -- \
//!     PRESET LAYERS POPULARITY PERSISTENCE [DIR] [PROMPT] [MAX_NEW] [SLOTS] [SEED]

use std::path::PathBuf;
use std::time::Instant;

use slipstream_synth::{measure, options, preset_config, Preset, Skew};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let preset: Preset = arg(1, "qwen3.6-35b-a3b").parse().unwrap();
    let layers: usize = arg(2, "4").parse().unwrap();
    let skew = Skew {
        popularity: arg(3, "2").parse().unwrap(),
        persistence: arg(4, "2").parse().unwrap(),
    };
    let dir = PathBuf::from(arg(5, "/work/synth"));
    let prompt_len: usize = arg(6, "300").parse().unwrap();
    let max_new: usize = arg(7, "256").parse().unwrap();
    let slots: usize = arg(8, "64").parse().unwrap();
    let seed: u64 = arg(9, "0").parse().unwrap();
    let path = dir.join(format!("cal-{}-{layers}.slip", preset.name()));
    let t = Instant::now();
    let opts = options(preset, Some(layers), seed, skew, &path);
    let rep = slipstream_synth::synthesize(&opts, &|_| {}).unwrap();
    let gen_s = t.elapsed().as_secs_f64();
    let prompt = measure::random_prompt(opts.config.vocab_size, prompt_len, 7);
    let t = Instant::now();
    let run = measure::run_routes(&path, &prompt, max_new).unwrap();
    let st = measure::replay(&run, slots);
    let full = opts.config.layer_types.len();
    let scale = preset_config(preset, None).num_layers() as f64 / full as f64;
    let distinct: std::collections::HashSet<u32> = run.tokens.iter().copied().collect();
    println!(
        "{} layers={layers} pop={} pers={} slots={slots}: LRU {:.2}/tok ({:.1} at full depth), Belady {:.2}/tok ({:.1}), requests {:.1}/tok; finite={} max|logit|={:.1} distinct generated tokens {} | gen {:.1}s ({:.0} MB/s) run {:.1}s",
        preset.name(),
        skew.popularity,
        skew.persistence,
        st.lru_misses_per_token,
        st.lru_misses_per_token * scale,
        st.belady_misses_per_token,
        st.belady_misses_per_token * scale,
        st.requests_per_token,
        run.all_finite,
        run.max_abs_logit,
        distinct.len(),
        gen_s,
        rep.mb_per_s,
        t.elapsed().as_secs_f64()
    );
}
