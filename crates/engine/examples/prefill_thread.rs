//! Prefill time on the process's main thread against a spawned thread (as
//! the server's engine thread runs it), to see what the allocator's
//! per-thread arenas cost a prefill's activation buffers.
//!
//! `cargo run --release -p slipstream-engine --example prefill_thread --
//! MODEL.slip IDS_FILE [main|thread] [rounds]` (IDS_FILE: comma-separated
//! token ids; resident experts; prints ms per prompt token for each round).

use std::path::PathBuf;
use std::time::Instant;

use slipstream_engine::{Engine, EngineConfig, StoreChoice};
use slipstream_models::Logits;

fn prefill_rounds(model: PathBuf, ids: Vec<u32>, rounds: usize) -> Vec<f64> {
    let config = EngineConfig {
        store: StoreChoice::Resident,
        ..Default::default()
    };
    let mut engine = Engine::open(&model, config).expect("opening the model");
    (0..rounds)
        .map(|_| {
            let mut state = engine.new_state();
            let t = Instant::now();
            engine
                .prefill(&mut state, &ids, Logits::Last)
                .expect("prefill");
            t.elapsed().as_secs_f64() * 1e3 / ids.len() as f64
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: prefill_thread MODEL.slip IDS_FILE [main|thread] [rounds]");
        std::process::exit(2);
    }
    let model = PathBuf::from(&args[1]);
    let ids: Vec<u32> = std::fs::read_to_string(&args[2])
        .expect("reading the ids")
        .trim()
        .split(',')
        .map(|v| v.trim().parse().expect("a token id"))
        .collect();
    let on_thread = args.get(3).map(String::as_str) == Some("thread");
    let rounds: usize = args.get(4).and_then(|r| r.parse().ok()).unwrap_or(3);
    let n = ids.len();
    let ms = if on_thread {
        std::thread::spawn(move || prefill_rounds(model, ids, rounds))
            .join()
            .expect("the prefill thread")
    } else {
        prefill_rounds(model, ids, rounds)
    };
    let place = if on_thread {
        "spawned thread"
    } else {
        "main thread"
    };
    for (i, m) in ms.iter().enumerate() {
        println!("{place}, {n} tokens, round {i}: {m:.2} ms/token");
    }
}
