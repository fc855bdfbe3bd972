//! Kernel bandwidth bench: HBM copy/read bandwidth measured in the same run,
//! then each decode kernel's achieved GB/s against it (bytes = weights and
//! activations each moved once). Inputs rotate over buffers several times
//! the L2 so the figures are HBM, not cache. Prints a table; with `--json
//! FILE` also writes the figures.
//!
//! `cargo run --release -p slipstream-cuda --example cuda_bench [-- --json out.json]`

use std::time::Duration;

use cudarc::driver::CudaGraph;
use slipstream_core::QuantType;
use slipstream_cuda::{AttnIo, CudaTuning, DBuf, DevPtr, ExpertsIo, GdnStep, Gpu, Position, WDesc};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Launches of `f` per timed region (event overhead amortised; inputs
/// rotate with the iteration index).
const PER: usize = 10;

/// Median milliseconds per call of `f` (launching work for iteration i)
/// over `reps` timed regions of [`PER`] calls after warm-up, with events
/// around each region.
fn time_ms(g: &Gpu, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..3 {
        f(i);
    }
    g.sync().unwrap();
    let mut t = Vec::new();
    for i in 0..reps {
        let a = g.mark().unwrap();
        for j in 0..PER {
            f(3 + i * PER + j);
        }
        let b = g.mark().unwrap();
        b.synchronize().unwrap();
        t.push(a.elapsed_ms(&b).unwrap() as f64 / PER as f64);
    }
    median(t)
}

/// Milliseconds per layer of `layer(s)` (the routed experts of layer set
/// `s`): one layer per call, 40 queued in one timed region, and 40
/// captured in one CUDA graph and replayed.
fn time_layers(g: &Gpu, reps: usize, sets: usize, layer: impl Fn(usize)) -> (f64, f64, f64) {
    let one = time_ms(g, reps * 4, |i| layer(i % sets));
    let forty = time_ms(g, 3, |_| (0..40).for_each(&layer)) / 40.0;
    let graph = capture(g, || (0..40).for_each(&layer));
    let graphed = time_ms(g, reps, |_| graph.launch().unwrap()) / 40.0;
    (one, forty, graphed)
}

/// The launches of `launch` captured into one CUDA graph.
fn capture(g: &Gpu, launch: impl FnOnce()) -> CudaGraph {
    g.stream
        .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    launch();
    g.stream
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .unwrap()
}

/// Microseconds per call of `f` (launching work for call i) over `n`
/// calls queued back to back: the host's submission time and the GPU
/// timeline between events around them.
fn submit_us(g: &Gpu, n: usize, mut f: impl FnMut(usize)) -> (f64, f64) {
    g.sync().unwrap();
    let a = g.mark().unwrap();
    let t = std::time::Instant::now();
    for i in 0..n {
        f(i);
    }
    let host_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let b = g.mark().unwrap();
    b.synchronize().unwrap();
    let gpu_us = a.elapsed_ms(&b).unwrap() as f64 * 1e3 / n as f64;
    (host_us, gpu_us)
}

/// The bases tables of the `k` experts from `first` on (three parts each
/// in `descs`): the gate, up and down codes' addresses, `[k]` u64 each.
fn bases_table(descs: &[WDesc], first: usize, k: usize) -> Vec<u8> {
    (0..3)
        .flat_map(|part| (first..first + k).map(move |e| descs[e * 3 + part].codes))
        .flat_map(|a| a.raw().to_le_bytes())
        .collect()
}

fn fill_random(g: &Gpu, b: &DBuf, seed: u64) {
    // Random bytes (never zeros: they can run faster than real data).
    let mut x = seed | 1;
    let mut v = vec![0u8; b.bytes.min(64 << 20)];
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        c.copy_from_slice(&bytes[..c.len()]);
    }
    let mut off = 0;
    while off < b.bytes {
        let n = v.len().min(b.bytes - off);
        g.write(b, off, &v[..n]).unwrap();
        off += n;
    }
}

/// Random but finite affine weights: codes random, scales/biases small f16.
fn fill_affine(g: &Gpu, b: &DBuf, descs: &[WDesc], seed: u64) {
    fill_random(g, b, seed);
    let half = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for d in descs {
        let n = d.rows() * (d.cols() / d.group as usize);
        let v: Vec<u8> = (0..n).flat_map(|_| half).collect();
        g.write(b, (d.scales.raw() - b.ptr.raw()) as usize, &v)
            .unwrap();
        g.write(b, (d.biases.raw() - b.ptr.raw()) as usize, &v)
            .unwrap();
    }
}

struct Row {
    name: String,
    ms: f64,
    bytes: f64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1).cloned());
    // `--experts-only`: the HBM probes and the routed-experts rows (for a
    // profiler run).
    let experts_only = args.iter().any(|a| a == "--experts-only");
    if let Err(e) = slipstream_cuda::probe() {
        eprintln!("no CUDA: {e}");
        std::process::exit(2);
    }
    // The `SLIPSTREAM_CUDA_*` variables apply here as in the CLI.
    let tuning = CudaTuning::from_vars(|name| std::env::var(name).ok());
    let mut g = Gpu::new(0, &tuning).expect("opening the GPU");
    // The "fused" rows measure the one-launch kernel (off in the model by default).
    g.fused = true;
    println!("device: {} ({} SMs)", g.name, g.sms);
    let reps = 20;
    let mut rows: Vec<Row> = Vec::new();

    // 1. HBM ceilings.
    let big = 2usize << 30;
    let src = g.alloc(big).unwrap();
    let dst = g.alloc(big).unwrap();
    fill_random(&g, &src, 7);
    let sink = g.alloc(16).unwrap();
    let copy_ms = time_ms(&g, reps, |_| g.bw_copy(src.ptr, dst.ptr, big).unwrap());
    let read_ms = time_ms(&g, reps, |_| g.bw_read(src.ptr, big, sink.ptr).unwrap());
    let copy_gbs = 2.0 * big as f64 / copy_ms / 1e6;
    let read_gbs = big as f64 / read_ms / 1e6;
    println!("HBM: copy {copy_gbs:.0} GB/s (read+write), read {read_gbs:.0} GB/s");
    drop(dst);
    // The ceiling at the experts' sizes: the plain read kernel over the
    // bytes of a layer's down projections, gate/up and both (rotating over
    // the 2 GiB buffer, so HBM), one launch at a time and 40 in a graph.
    for mb in [4.72f64, 9.44, 14.16] {
        let bytes = ((mb * 1e6) as usize).div_ceil(16) * 16;
        let slots = big / bytes;
        let at = |i: usize| src.ptr.add_bytes((i % slots) * bytes);
        let ms = time_ms(&g, reps * 4, |i| g.bw_read(at(i), bytes, sink.ptr).unwrap());
        let (_, forty, graphed) = time_layers(&g, reps, slots, |i| {
            g.bw_read(at(i), bytes, sink.ptr).unwrap()
        });
        let pct = |ms: f64| 100.0 * bytes as f64 / ms / 1e6 / read_gbs;
        println!(
            "probe: read kernel over {mb:.2} MB: {:.2} us ({:.0} %) one launch, {:.2} us ({:.0} %) 40 queued, {:.2} us ({:.0} %) 40 in a graph",
            ms * 1e3,
            pct(ms),
            forty * 1e3,
            pct(forty),
            graphed * 1e3,
            pct(graphed)
        );
    }

    // 2. A layer's batched routed experts (35B shapes: H 2048, I 512, top 8,
    // q4 g64), rotating over 48 layers' worth of distinct experts (> L2).
    let (h, inter, k, sets) = (2048usize, 512usize, 8usize, 48usize);
    let q = QuantType::Q4;
    let gt = WDesc::new(q, inter, h, DevPtr::NULL).unwrap();
    let dt = WDesc::new(q, h, inter, DevPtr::NULL).unwrap();
    let part = q.nbytes(inter, h);
    let rec = 3 * part.div_ceil(256) * 256;
    let pool = g.alloc(sets * k * rec).unwrap();
    let mut descs = Vec::new();
    for i in 0..sets * k {
        let base = pool.ptr.add_bytes(i * rec);
        let p2 = part.div_ceil(256) * 256;
        descs.push(WDesc::new(q, inter, h, base).unwrap());
        descs.push(WDesc::new(q, inter, h, base.add_bytes(p2)).unwrap());
        descs.push(WDesc::new(q, h, inter, base.add_bytes(2 * p2)).unwrap());
    }
    fill_affine(&g, &pool, &descs, 11);
    let tb: Vec<u8> = (0..sets)
        .flat_map(|s| bases_table(&descs, s * k, k))
        .collect();
    let tdev = g.upload(&tb).unwrap();
    let x = g.upload_f32(&vec![0.5f32; h]).unwrap();
    let xrow = g.alloc(4 * k).unwrap();
    let hbuf = g.alloc(4 * k * inter).unwrap();
    let wts = g.upload_f32(&vec![0.125f32; k]).unwrap();
    let res = g.alloc(4 * h).unwrap();
    let tab = |s: usize, p: usize| tdev.ptr.add_bytes((s * 3 + p) * k * 8);
    // One token's routed experts (no shared expert).
    let io = ExpertsIo {
        xrow: xrow.ptr,
        xn: x.ptr,
        h: hbuf.ptr,
        wts: wts.ptr,
        k,
        shared: (DevPtr::NULL, DevPtr::NULL),
        x: res.ptr,
        tokens: 1,
    };
    // Layer set `s`'s routed experts as two launches (the GPU passed in:
    // its settings change between the rows below).
    let gate_up = |g: &Gpu, s: usize| {
        g.moe_gate_up(
            [&gt, &gt],
            [tab(s, 0), tab(s, 1)],
            xrow.ptr,
            x.ptr,
            hbuf.ptr,
            k,
        )
        .unwrap()
    };
    let down = |g: &Gpu, s: usize| g.moe_down(&dt, tab(s, 2), &io).unwrap();
    let layer = |g: &Gpu, s: usize| {
        gate_up(g, s);
        down(g, s);
    };
    let ms_gu = time_ms(&g, reps * 4, |i| gate_up(&g, i % sets));
    let ms_dn = time_ms(&g, reps * 4, |i| down(&g, i % sets));
    let ms_layer = time_ms(&g, reps * 4, |i| layer(&g, i % sets));
    // Many layers back to back in one timed region (launch gaps amortised).
    let ms_40 = time_ms(&g, 3, |_| (0..40).for_each(|s| layer(&g, s))) / 40.0;
    // A layer's routed experts through `moe_experts`: first on the
    // tensor-core kernels (opt-in: `SLIPSTREAM_CUDA_TC=1`; fused kernel
    // off), then as one launch of the fused kernel.
    let experts = |g: &Gpu, s: usize| {
        g.moe_experts([&gt, &gt, &dt], [tab(s, 0), tab(s, 1), tab(s, 2)], &io)
            .unwrap()
    };
    g.fused = false;
    g.tensor_cores = true;
    let tc_ok = g.experts_on_tensor_cores([&gt, &gt, &dt], k);
    let (ms_tc, ms_tc40, ms_tc_graph40) = time_layers(&g, reps, sets, |s| experts(&g, s));
    g.fused = true;
    g.tensor_cores = tuning.gpu_tensor_cores;
    let g = g;
    println!(
        "experts on tensor cores: {tc_ok}; dense rows on tensor cores: {}",
        g.tensor_cores
    );
    let (ms_fused, ms_fused40, ms_graph40) = time_layers(&g, reps, sets, |s| experts(&g, s));
    // Launch cost: host submission vs GPU timeline, and graph replay.
    {
        let (host_us, gpu_us) = submit_us(&g, 2000, |_| g.nop().unwrap());
        println!("probe: empty kernel: host submit {host_us:.2} us/launch, GPU timeline {gpu_us:.2} us/launch");
        let (host_us, gpu_us) = submit_us(&g, 400, |i| layer(&g, i % sets));
        println!("probe: layer pair: host submit {host_us:.2} us/layer, GPU timeline {gpu_us:.2} us/layer");
        for (nl, what) in [(1usize, "1 layer"), (40, "40 layers")] {
            let graph = capture(&g, || (0..nl).for_each(|s| layer(&g, s)));
            let ms = time_ms(&g, reps, |_| graph.launch().unwrap());
            println!(
                "probe: graph of {what} (2 launches each), replayed: {:.2} us/layer",
                ms * 1e3 / nl as f64
            );
            let ms = time_ms(&g, reps, |_| {
                for _ in 0..4 {
                    graph.launch().unwrap()
                }
            });
            println!(
                "probe: graph of {what}, 4 replays queued: {:.2} us/layer",
                ms * 1e3 / (4 * nl) as f64
            );
        }
        let ms = time_ms(&g, reps, |_| g.nop().unwrap());
        println!(
            "probe: empty kernel, event-timed like the rows: {:.2} us",
            ms * 1e3
        );
        for (n, regs, occ) in g.kernel_report() {
            println!("probe: {n}: {regs} registers, {occ} blocks of 256 per SM");
        }
    }
    // Larger batch: all 256 experts of a layer at once (prefill-like).
    let kk = 64usize;
    let (ms_kk_pair, ms_kk_fused) = {
        let td2 = g.upload(&bases_table(&descs, 0, kk)).unwrap();
        let bases = [
            td2.ptr,
            td2.ptr.add_bytes(8 * kk),
            td2.ptr.add_bytes(16 * kk),
        ];
        let xr2 = g.alloc(4 * kk).unwrap();
        let h2 = g.alloc(4 * kk * inter).unwrap();
        let w2 = g.upload_f32(&vec![0.01f32; kk]).unwrap();
        let io2 = ExpertsIo {
            xrow: xr2.ptr,
            h: h2.ptr,
            wts: w2.ptr,
            k: kk,
            ..io
        };
        let ms = time_ms(&g, reps, |_| {
            g.moe_gate_up([&gt, &gt], [bases[0], bases[1]], xr2.ptr, x.ptr, h2.ptr, kk)
                .unwrap();
            g.moe_down(&dt, bases[2], &io2).unwrap();
        });
        let msf = time_ms(&g, reps, |_| {
            g.moe_experts([&gt, &gt, &dt], bases, &io2).unwrap()
        });
        (ms, msf)
    };
    drop(pool);
    let tc_name = if tc_ok {
        "tensor cores"
    } else {
        "default path"
    };
    // The routed experts' rows: bytes of the weights each read once.
    let layer_bytes = 3 * k * part;
    for (name, ms, bytes) in [
        (
            format!("experts gate+up ({k} x 2 x [{inter},{h}] q4)"),
            ms_gu,
            2 * k * part,
        ),
        (
            format!("experts down ({k} x [{h},{inter}] q4)"),
            ms_dn,
            k * part,
        ),
        (
            "layer's routed experts (2 launches)".into(),
            ms_layer,
            layer_bytes,
        ),
        (
            "layer's routed experts, 40 layers queued".into(),
            ms_40,
            layer_bytes,
        ),
        (
            format!("layer's routed experts, {tc_name} (2 launches)"),
            ms_tc,
            layer_bytes,
        ),
        (format!("{tc_name}, 40 layers queued"), ms_tc40, layer_bytes),
        (
            format!("{tc_name}, 40 layers in one CUDA graph"),
            ms_tc_graph40,
            layer_bytes,
        ),
        (
            "layer's routed experts, fused (1 launch)".into(),
            ms_fused,
            layer_bytes,
        ),
        ("fused, 40 layers queued".into(), ms_fused40, layer_bytes),
        (
            "fused, 40 layers in one CUDA graph".into(),
            ms_graph40,
            layer_bytes,
        ),
        (
            format!("{kk} experts, fused (1 launch)"),
            ms_kk_fused,
            3 * kk * part,
        ),
        (
            format!("{kk} experts in one launch pair"),
            ms_kk_pair,
            3 * kk * part,
        ),
    ] {
        rows.push(Row {
            name,
            ms,
            bytes: bytes as f64,
        });
    }

    if !experts_only {
        // 3. Dense matvecs (rotating over 8 copies).
        for (name, q, r, c) in [
            (
                "dense q4 [8192, 2048] (attn q)",
                QuantType::Q4,
                8192usize,
                2048usize,
            ),
            (
                "dense q4 [12288, 2048] (gdn qkv)",
                QuantType::Q4,
                12288,
                2048,
            ),
            ("dense bf16 [4096, 2048]", QuantType::Bf16, 4096, 2048),
            ("dense f16 [4096, 2048]", QuantType::F16, 4096, 2048),
            ("dense f32 [2048, 2048]", QuantType::F32, 2048, 2048),
            ("lm head q4 [248320, 2048]", QuantType::Q4, 248320, 2048),
        ] {
            let nb = q.nbytes(r, c);
            let copies = if nb > 64 << 20 { 1 } else { 8 };
            let buf = g.alloc(copies * nb.div_ceil(256) * 256).unwrap();
            let ds: Vec<WDesc> = (0..copies)
                .map(|i| {
                    WDesc::new(q, r, c, buf.ptr.add_bytes(i * nb.div_ceil(256) * 256)).unwrap()
                })
                .collect();
            if matches!(q, QuantType::Affine { .. }) {
                fill_affine(&g, &buf, &ds, 3);
            } else {
                // Small finite values: 0x3c00 = 1.0 in f16, 0x3f80 = 1.0 in bf16.
                fill_random(&g, &buf, 5);
            }
            let xb = g.upload_f32(&vec![0.01f32; c]).unwrap();
            let yb = g.alloc(4 * r).unwrap();
            let ms = time_ms(&g, reps, |i| {
                g.matvec(&ds[i % copies], xb.ptr, yb.ptr, 1).unwrap()
            });
            rows.push(Row {
                name: name.into(),
                ms,
                bytes: nb as f64,
            });
        }

        // 4. Decode attention over a 4096-token cache (35B: 16 heads, 2 KV heads, 256).
        {
            let (nh, nkv, hd, keys) = (16usize, 2usize, 256usize, 4096usize);
            let kc = g.upload_f32(&vec![0.01f32; keys * nkv * hd]).unwrap();
            let vc = g.upload_f32(&vec![0.02f32; keys * nkv * hd]).unwrap();
            let qb = g.upload_f32(&vec![0.03f32; nh * hd]).unwrap();
            let sc = g.alloc(4 * Gpu::attn_scratch_f32(nh, hd, keys)).unwrap();
            let out = g.alloc(4 * nh * hd).unwrap();
            let ms = time_ms(&g, reps, |_| {
                g.attention(
                    &AttnIo {
                        q: qb.ptr,
                        kc: kc.ptr,
                        vc: vc.ptr,
                        dims: (nh, nkv, hd),
                        gate: qb.ptr,
                        out: out.ptr,
                    },
                    Position::Host(keys - 1),
                    &sc,
                )
                .unwrap()
            });
            rows.push(Row {
                name: format!("attention {keys} keys (K+V f32)"),
                ms,
                bytes: (2 * keys * nkv * hd * 4) as f64,
            });
        }
        // 5. Gated DeltaNet step (35B: 16x128 / 32x128): state read + written.
        {
            let (nk, dk, nv, dv) = (16usize, 128usize, 32usize, 128usize);
            let c = 2 * nk * dk + nv * dv;
            let co = g.upload_f32(&vec![0.1f32; c]).unwrap();
            let z = g.upload_f32(&vec![0.1f32; nv * dv]).unwrap();
            let ab = g.upload_f32(&vec![0.1f32; nv]).unwrap();
            let nw = g.upload_f32(&vec![1.0f32; dv]).unwrap();
            let states: Vec<DBuf> = (0..16)
                .map(|_| g.upload_f32(&vec![0.01f32; nv * dk * dv]).unwrap())
                .collect();
            let core = g.alloc(4 * nv * dv).unwrap();
            let ms = time_ms(&g, reps * 4, |i| {
                g.gdn_step(
                    &GdnStep {
                        conv_out: co.ptr,
                        z: z.ptr,
                        b: ab.ptr,
                        a: ab.ptr,
                        a_log: ab.ptr,
                        dt_bias: ab.ptr,
                        norm: nw.ptr,
                        state: states[i % 16].ptr,
                        dims: (nk, dk, nv, dv),
                        eps: 1e-6,
                        core: core.ptr,
                    },
                    1,
                )
                .unwrap()
            });
            rows.push(Row {
                name: "gated delta rule step (state r+w)".into(),
                ms,
                bytes: (2 * nv * dk * dv * 4) as f64,
            });
        }
    }
    println!(
        "\n{:<48} {:>10} {:>10} {:>9} {:>8}",
        "kernel", "us", "MB", "GB/s", "% read"
    );
    for r in &rows {
        let gbs = r.bytes / r.ms / 1e6;
        println!(
            "{:<48} {:>10.1} {:>10.2} {:>9.0} {:>7.0}%",
            r.name,
            r.ms * 1e3,
            r.bytes / 1e6,
            gbs,
            100.0 * gbs / read_gbs
        );
    }
    if let Some(path) = json {
        let mut s = format!(
            "{{\n  \"device\": \"{}\",\n  \"hbm_copy_gbs\": {copy_gbs:.1},\n  \"hbm_read_gbs\": {read_gbs:.1},\n  \"kernels\": [\n",
            g.name
        );
        for (i, r) in rows.iter().enumerate() {
            s.push_str(&format!(
                "    {{\"name\": \"{}\", \"us\": {:.2}, \"bytes\": {}, \"gbs\": {:.1}}}{}\n",
                r.name,
                r.ms * 1e3,
                r.bytes,
                r.bytes / r.ms / 1e6,
                if i + 1 < rows.len() { "," } else { "" }
            ));
        }
        s.push_str("  ]\n}\n");
        std::fs::write(&path, s).expect("writing the json");
    }
    // Clock-hold probe: a spinning kernel on the copy stream for 200 ms
    // while nothing else runs (the script samples clocks meanwhile).
    g.spin_on(&g.copy_stream, 200_000_000).unwrap();
    g.copy_stream.synchronize().unwrap();
    std::thread::sleep(Duration::from_millis(10));
}
