//! Decode/prefill timing with the phase split, straight on the model and a
//! store (no engine): `cargo run --release -p slipstream-hwbench --example
//! decode_phases -- MODEL.slip [slots|resident] [decode_tokens] [prompt_tokens] [prefill_chunk]`.
use std::sync::Arc;
use std::time::Instant;

use slipstream_models::transformer::PhaseTimes;
use slipstream_models::Logits;
use slipstream_store::ExpertStore;

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let model = Arc::new(slipstream_format::SlipModel::open(std::path::Path::new(&a[0])).unwrap());
    let which = a.get(1).cloned().unwrap_or_else(|| "256".into());
    let decode: usize = a.get(2).map_or(16, |v| v.parse().unwrap());
    let prompt: usize = a.get(3).map_or(8, |v| v.parse().unwrap());
    let chunk: usize = a.get(4).map_or(4096, |v| v.parse().unwrap());
    let tf = slipstream_models::load(&model.manifest.config, model.as_ref()).unwrap();
    let mut store: Box<dyn ExpertStore> = if which == "resident" {
        Box::new(slipstream_store::ResidentStore::open(model.clone()).unwrap())
    } else {
        let cfg = slipstream_store::StreamConfig {
            slots: which.parse().unwrap(),
            ..Default::default()
        };
        Box::new(slipstream_store::StreamingStore::open(model.clone(), cfg).unwrap())
    };
    let vocab = tf.config.vocab_size as u32;
    let toks: Vec<u32> = (0..prompt as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut state = tf.new_state();
    let mut ph = PhaseTimes::default();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for piece in toks.chunks(chunk) {
        logits = tf
            .forward_timed(
                &mut state,
                piece,
                store.as_mut(),
                Logits::Last,
                None,
                Some(&mut ph),
            )
            .unwrap();
    }
    let pf = t0.elapsed().as_secs_f64();
    println!(
        "prefill {prompt} tokens: {:.2} s, {:.2} tok/s | {}",
        pf,
        prompt as f64 / pf,
        ph.report(0)
    );
    let c0 = store.counters();
    let before = ph;
    let t0 = Instant::now();
    let mut next = argmax(&logits);
    for _ in 0..decode {
        logits = tf
            .forward_timed(
                &mut state,
                &[next],
                store.as_mut(),
                Logits::Last,
                None,
                Some(&mut ph),
            )
            .unwrap();
        next = argmax(&logits);
    }
    let dt = t0.elapsed().as_secs_f64();
    let mut d = ph.since(&before);
    d.store_read_wait_ns = Some(store.counters().read_wait_ns - c0.read_wait_ns);
    println!(
        "decode {decode} tokens: {:.3} tok/s | {}",
        decode as f64 / dt,
        d.report(0)
    );
    println!(
        "load avg {}",
        std::fs::read_to_string("/proc/loadavg").unwrap().trim()
    );
}

fn argmax(v: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b as u32
}
