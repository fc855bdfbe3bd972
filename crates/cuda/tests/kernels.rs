//! Every CUDA kernel against the CPU scalar reference (crates/kernels,
//! crates/models ops) on random ragged shapes. Each test returns early
//! (prints "skipped") when no CUDA driver, NVRTC or device is present.

use rand::{Rng, SeedableRng};
use slipstream_core::{QuantType, ScaleType, TensorView};
use slipstream_cuda::{
    AttnIo, CudaTuning, DBuf, DevPtr, ExpertsIo, GdnConv, GdnStep, Gpu, Position, RouteBases, WDesc,
};
use slipstream_kernels::quantize::from_f32;
use slipstream_kernels::scalar;
use slipstream_models::ops;
use slipstream_testkit::{rel_err, same_bits};

mod common;
use common::Rng64;

fn gpu() -> Option<Gpu> {
    match slipstream_cuda::probe() {
        Ok(_) => Some(
            // The `SLIPSTREAM_CUDA_*` variables apply here as in the CLI.
            Gpu::new(0, &CudaTuning::from_vars(|name| std::env::var(name).ok()))
                .expect("CUDA is present but the device could not be opened"),
        ),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn rvec(rng: &mut Rng64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

/// The affine type of `bits`-bit codes in groups of `group` with `scale`
/// scales.
fn affine(bits: u8, group: u32, scale: ScaleType) -> QuantType {
    QuantType::Affine { bits, group, scale }
}

fn qtypes() -> Vec<QuantType> {
    let mut v = vec![QuantType::F32, QuantType::F16, QuantType::Bf16];
    for bits in [4u8, 8] {
        for scale in [ScaleType::F16, ScaleType::Bf16] {
            for group in [32u32, 64, 128] {
                v.push(affine(bits, group, scale));
            }
        }
    }
    // 4-bit groups that force the narrower load widths of the multi-row kernels.
    for group in [8u32, 16, 24] {
        v.push(affine(4, group, ScaleType::F16));
    }
    // The GGML block types of GGUF import.
    v.extend([
        QuantType::Q4_0,
        QuantType::Q8_0,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
    ]);
    v
}

fn rand_weight(rng: &mut Rng64, q: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let vals: Vec<f32> = (0..rows * cols)
        .map(|i| rng.random_range(-1.0f32..1.0) * (1.0 + (i / 32 % 5) as f32))
        .collect();
    from_f32(&vals, rows, cols, q)
}

fn cols_for(rng: &mut Rng64, q: QuantType) -> usize {
    match q {
        QuantType::Affine { group, .. } => {
            group as usize * rng.random_range(1..(4096 / group as usize).min(40))
        }
        _ if q.is_ggml() => {
            let (be, _) = q.ggml_block().unwrap();
            be * rng.random_range(1..(4096 / be).min(40))
        }
        _ => rng.random_range(1..700),
    }
}

#[test]
fn matvec_matches_scalar_on_every_type() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(1);
    for q in qtypes() {
        for _ in 0..6 {
            let rows = rng.random_range(1..300);
            let cols = cols_for(&mut rng, q);
            let n = rng.random_range(1..4);
            let bytes = rand_weight(&mut rng, q, rows, cols);
            let view = TensorView::new(q, rows, cols, &bytes).unwrap();
            let x = rvec(&mut rng, n * cols, 1.0);
            let w = g.upload_weight(&view).unwrap();
            checked_matvec(&g, &view, &w.desc, &x, n);
        }
    }
}

/// `g.matvec` of `w` (uploaded from `view`) over the `n` rows of `x`,
/// checked against the scalar matmul; returns the input on the device and
/// the output.
fn checked_matvec(g: &Gpu, view: &TensorView, w: &WDesc, x: &[f32], n: usize) -> (DBuf, Vec<f32>) {
    let (rows, cols) = (view.rows, view.cols);
    let mut want = vec![0.0f32; n * rows];
    scalar::matmul(view, x, n, &mut want);
    let dx = g.upload_f32(x).unwrap();
    let dy = g.upload_f32(&vec![f32::NAN; n * rows]).unwrap();
    g.matvec(w, dx.ptr, dy.ptr, n).unwrap();
    let got = g.read_f32(&dy, 0, n * rows).unwrap();
    let e = rel_err(&got, &want);
    let q = view.qtype.name();
    assert!(e < 2e-5, "{q} [{rows}, {cols}] n={n}: rel err {e}");
    (dx, got)
}

#[test]
fn wide_a4_matvec_matches_scalar() {
    let Some(mut g) = gpu() else { return };
    // With the tensor-core kernels where they apply (group 64; one token
    // and a pass), then with the a4v kernels everywhere.
    for tc in [true, false] {
        g.tensor_cores = tc;
        wide_a4_case(&g);
    }
}

fn wide_a4_case(g: &Gpu) {
    let mut rng = Rng64::seed_from_u64(9);
    // Columns 32 * S for S = 1..32 (powers of two) and 32, 64, 128 chunks
    // per row of 32 lanes; ragged row counts; 1 to 3 tokens.
    for (rows, cols) in [
        (300usize, 2048usize),
        (77, 512),
        (1000, 4096),
        (5, 256),
        (33, 1024),
        (70, 32),
        (129, 128),
    ] {
        for (group, scale) in [(64u32, ScaleType::F16), (32, ScaleType::Bf16)] {
            if cols % group as usize != 0 {
                continue;
            }
            let q = affine(4, group, scale);
            let n = rng.random_range(1..4);
            let bytes = rand_weight(&mut rng, q, rows, cols);
            let view = TensorView::new(q, rows, cols, &bytes).unwrap();
            let x = rvec(&mut rng, n * cols, 1.0);
            let w = g.upload_weight(&view).unwrap();
            assert!(
                w.desc.a4v_chunks().is_some(),
                "[{rows}, {cols}] g{group}: not a4v"
            );
            checked_matvec(g, &view, &w.desc, &x, n);
            // A prefill pass (more tokens than one block runs, ragged): each
            // token the bits of its own one-token launch.
            let n = 37;
            let x = rvec(&mut rng, n * cols, 1.0);
            let (dx, many) = checked_matvec(g, &view, &w.desc, &x, n);
            let dy1 = g.alloc(4 * rows).unwrap();
            for t in 0..n {
                g.matvec(&w.desc, dx.f32_at(t * cols), dy1.ptr, 1).unwrap();
                let one = g.read_f32(&dy1, 0, rows).unwrap();
                assert!(
                    same_bits(&one, &many[t * rows..][..rows]),
                    "[{rows}, {cols}] token {t} of {n} differs from its one-token launch"
                );
            }
        }
    }
}

/// A layer's projections in one launch (`matvec_many`: 2 to 4 matrices of
/// the same columns, ragged rows down to one block's worth and less; for a
/// pass, one split of x shared on tensor cores) give the bits of one
/// launch per matrix.
#[test]
fn many_matvecs_in_one_launch_match_single_launches() {
    let Some(mut g) = gpu() else { return };
    for tc in [true, false] {
        // Tensor-core kernel, then the a4v one.
        g.tensor_cores = tc;
        many_matvecs_case(&g, tc);
    }
}

fn many_matvecs_case(g: &Gpu, tc: bool) {
    let mut rng = Rng64::seed_from_u64(13);
    let q = affine(4, 64, ScaleType::Bf16);
    let q8 = affine(8, 64, ScaleType::Bf16);
    // The last two cases run on the generic kernel (8-bit and f16 rows:
    // a router with its shared-expert gate, and a ragged mix).
    for (cols, rows, kinds) in [
        (2048usize, vec![8192usize, 4096, 32, 32], vec![q; 4]),
        (2048, vec![4096, 512, 512], vec![q; 3]),
        (512, vec![3, 77], vec![q; 2]),
        (4096, vec![1000, 1, 300, 9], vec![q; 4]),
        (2048, vec![256, 1], vec![q8; 2]),
        (320, vec![9, 77, 1], vec![q8, QuantType::F16, q8]),
    ] {
        let bufs: Vec<Vec<u8>> = rows
            .iter()
            .zip(&kinds)
            .map(|(&r, &k)| rand_weight(&mut rng, k, r, cols))
            .collect();
        let ws: Vec<_> = rows
            .iter()
            .zip(&bufs)
            .zip(&kinds)
            .map(|((&r, b), &k)| {
                g.upload_weight(&TensorView::new(k, r, cols, b).unwrap())
                    .unwrap()
            })
            .collect();
        // One token (one launch), then a pass of 11 (one split of x for
        // all the matrices on tensor cores).
        for n in [1usize, 11] {
            let x = rvec(&mut rng, n * cols, 1.0);
            let dx = g.upload_f32(&x).unwrap();
            let ys: Vec<_> = rows
                .iter()
                .map(|&r| g.upload_f32(&vec![f32::NAN; n * r]).unwrap())
                .collect();
            let descs: Vec<_> = ws.iter().map(|w| &w.desc).collect();
            let yp: Vec<DevPtr> = ys.iter().map(|y| y.ptr).collect();
            g.matvec_many(&descs, dx.ptr, &yp, n).unwrap();
            for ((w, y), &r) in ws.iter().zip(&ys).zip(&rows) {
                let got = g.read_f32(y, 0, n * r).unwrap();
                g.matvec(&w.desc, dx.ptr, y.ptr, n).unwrap();
                let want = g.read_f32(y, 0, n * r).unwrap();
                assert!(
                    same_bits(&got, &want),
                    "matvec_many [{r}, {cols}] of {rows:?}, {n} tokens, differs from its own launch (tensor cores: {tc})"
                );
            }
        }
    }
}

/// An expert's gate, up and down on the host.
type ExpertViews<'a> = (TensorView<'a>, TensorView<'a>, TensorView<'a>);

/// CPU reference of one token's routed experts, added into its residual
/// `out` in rank order: each expert's silu(G x) * (U x), then D h, times
/// its weight in `wts`; then where given the shared expert's output times
/// the sigmoid of its gate logit.
fn add_experts_ref(
    out: &mut [f32],
    experts: &[ExpertViews],
    wts: &[f32],
    x: &[f32],
    shared: Option<(&[f32], f32)>,
) {
    for ((gv, uv, dv), w) in experts.iter().zip(wts) {
        let inter = gv.rows;
        let mut gg = vec![0.0; inter];
        let mut uu = vec![0.0; inter];
        scalar::matvec(gv, x, &mut gg);
        scalar::matvec(uv, x, &mut uu);
        let hh: Vec<f32> = gg.iter().zip(&uu).map(|(a, b)| ops::silu(*a) * b).collect();
        let mut d = vec![0.0; dv.rows];
        scalar::matvec(dv, &hh, &mut d);
        for (o, v) in out.iter_mut().zip(&d) {
            *o += v * w;
        }
    }
    if let Some((sh_out, sg)) = shared {
        for (o, v) in out.iter_mut().zip(sh_out) {
            *o += ops::sigmoid(sg) * v;
        }
    }
}

#[test]
fn routed_experts_in_one_launch_match_scalar() {
    let Some(mut g) = gpu() else { return };
    // Gpu::moe_experts below takes the fused kernel wherever it applies.
    g.fused = true;
    let mut rng = Rng64::seed_from_u64(2);
    for (q, h, inter, k, shared) in [
        (QuantType::Q4, 256usize, 128usize, 8usize, true),
        (QuantType::Q4, 640, 192, 3, false),
        // GGUF imports: K-quant experts with a shared expert, Q4_0 without.
        (QuantType::Q4K, 512, 256, 4, true),
        (QuantType::Q6K, 256, 512, 2, true),
        (QuantType::Q4_0, 96, 64, 3, false),
        (affine(4, 32, ScaleType::Bf16), 96, 64, 1, true),
        (QuantType::Q8, 128, 320, 5, true),
        // Shapes the wide (a4v) kernels take: the 35B layer (gate/up 2
        // chunks per lane, down 16 lanes per row), 4 chunks per lane with
        // more experts than one down batch, 32 lanes per row, 1 lane per row.
        (QuantType::Q4, 2048, 512, 8, true),
        (affine(4, 128, ScaleType::Bf16), 4096, 256, 9, true),
        (QuantType::Q4, 1024, 1024, 2, false),
        (affine(4, 32, ScaleType::F16), 256, 32, 3, true),
        // Tensor-core shapes (group 64): bf16 scales, 5 ranks, 3 groups
        // per down row.
        (affine(4, 64, ScaleType::Bf16), 768, 192, 5, true),
    ] {
        // k experts, records laid out as [gate | up | down] each in its own buffer.
        let mut parts = Vec::new();
        for _ in 0..k {
            parts.push((
                rand_weight(&mut rng, q, inter, h),
                rand_weight(&mut rng, q, inter, h),
                rand_weight(&mut rng, q, h, inter),
            ));
        }
        let x = rvec(&mut rng, h, 1.0);
        let x0 = rvec(&mut rng, h, 1.0);
        let wts = rvec(&mut rng, k, 1.0);
        let sh_out = rvec(&mut rng, h, 1.0);
        let sg = rvec(&mut rng, 1, 2.0);
        let views: Vec<ExpertViews> = parts
            .iter()
            .map(|(gb, ub, db)| {
                (
                    TensorView::new(q, inter, h, gb).unwrap(),
                    TensorView::new(q, inter, h, ub).unwrap(),
                    TensorView::new(q, h, inter, db).unwrap(),
                )
            })
            .collect();
        let mut want = x0.clone();
        let sh_ref = shared.then_some((&sh_out[..], sg[0]));
        add_experts_ref(&mut want, &views, &wts, &x, sh_ref);
        let bufs: Vec<_> = parts
            .iter()
            .map(|(a, b, c)| {
                (
                    g.upload(a).unwrap(),
                    g.upload(b).unwrap(),
                    g.upload(c).unwrap(),
                )
            })
            .collect();
        let mut table: Vec<DevPtr> = bufs.iter().map(|b| b.0.ptr).collect();
        table.extend(bufs.iter().map(|b| b.1.ptr));
        table.extend(bufs.iter().map(|b| b.2.ptr));
        let tb: Vec<u8> = table.iter().flat_map(|a| a.raw().to_le_bytes()).collect();
        let dt = g.upload(&tb).unwrap();
        let (gt, dtl) = common::expert_descs(q, h, inter);
        let dx = g.upload_f32(&x).unwrap();
        let dres = g.upload_f32(&x0).unwrap();
        let dh = g.upload_f32(&vec![f32::NAN; k * inter]).unwrap();
        let dw = g.upload_f32(&wts).unwrap();
        let dsh = g.upload_f32(&sh_out).unwrap();
        let dsg = g.upload_f32(&sg).unwrap();
        let xrow = g.alloc(4 * k).unwrap();
        let io = ExpertsIo {
            xrow: xrow.ptr,
            xn: dx.ptr,
            h: dh.ptr,
            wts: dw.ptr,
            k,
            shared: common::shared_expert_io(shared.then_some((&dsh, &dsg))),
            x: dres.ptr,
            tokens: 1,
        };
        g.moe_gate_up(
            [&gt, &gt],
            [dt.ptr, dt.ptr.add_bytes(8 * k)],
            xrow.ptr,
            dx.ptr,
            dh.ptr,
            k,
        )
        .unwrap();
        g.moe_down(&dtl, dt.ptr.add_bytes(16 * k), &io).unwrap();
        let got = g.read_f32(&dres, 0, h).unwrap();
        let e = rel_err(&got, &want);
        assert!(e < 5e-5, "{} h={h} i={inter} k={k}: rel err {e}", q.name());
        // `moe_experts` on a fresh residual: the layer's output.
        let one_launch = |g: &Gpu| {
            let dres2 = g.upload_f32(&x0).unwrap();
            let dh2 = g.upload_f32(&vec![f32::NAN; k * inter]).unwrap();
            g.moe_experts(
                [&gt, &gt, &dtl],
                [dt.ptr, dt.ptr.add_bytes(8 * k), dt.ptr.add_bytes(16 * k)],
                &ExpertsIo {
                    h: dh2.ptr,
                    x: dres2.ptr,
                    ..io
                },
            )
            .unwrap();
            g.read_f32(&dres2, 0, h).unwrap()
        };
        // The one-launch path (fused kernel where the shapes allow it) gives
        // the same bits as the two launches, launch after launch (its block
        // counters reset themselves).
        g.tensor_cores = false;
        for rep in 0..3 {
            assert!(
                same_bits(&one_launch(&g), &got),
                "{} h={h} i={inter} k={k}: one launch differs from two (rep {rep})",
                q.name()
            );
        }
        // The tensor-core kernels, where they take the shape: within the
        // same bound of the scalar reference, and the same bits every time.
        g.fused = false;
        g.tensor_cores = true;
        let tc = g.experts_on_tensor_cores([&gt, &gt, &dtl], k);
        if (q, h, inter, k) == (QuantType::Q4, 2048, 512, 8) {
            assert!(
                tc,
                "the 35B layer shape must run on the tensor-core kernels"
            );
        }
        let first = one_launch(&g);
        let e = rel_err(&first, &want);
        assert!(
            e < 5e-5,
            "{} h={h} i={inter} k={k} (tensor cores: {tc}): rel err {e}",
            q.name()
        );
        assert!(
            same_bits(&one_launch(&g), &first),
            "{} h={h} i={inter} k={k}: tensor-core experts not deterministic",
            q.name()
        );
        g.fused = true;
    }
}

/// A prefill pass's experts grouped by expert (`moe_experts_grouped`: each
/// expert's gate/up loaded once for all its pairs) give the bits of the
/// per-pair launches (`moe_experts`), with experts shared by several
/// tokens, experts used by none, and ragged token counts; on the a4v
/// kernels, then on the tensor-core ones where they take the shape.
#[test]
fn grouped_experts_match_per_pair_launches() {
    let Some(mut g) = gpu() else { return };
    g.fused = false;
    for tc in [false, true] {
        g.tensor_cores = tc;
        grouped_case(&g);
    }
}

fn grouped_case(g: &Gpu) {
    let mut rng = Rng64::seed_from_u64(12);
    for (q, h, inter, k, e, tokens, shared) in [
        (QuantType::Q4, 256, 128, 3, 12, 7, true),
        (QuantType::Q4, 2048, 512, 8, 20, 5, true),
        (QuantType::Q4, 1024, 1024, 2, 6, 9, false),
        // Many pairs per expert: several tiles of pairs per block.
        (QuantType::Q4, 512, 256, 3, 4, 37, true),
        (affine(4, 128, ScaleType::Bf16), 4096, 256, 9, 16, 3, true),
    ] {
        let ex = common::expert_records(g, &mut rng, q, (h, inter, k, e, tokens), rand_weight);
        let x = rvec(&mut rng, tokens * h, 1.0);
        let x0 = rvec(&mut rng, tokens * h, 1.0);
        let wts = rvec(&mut rng, tokens * k, 1.0);
        let sh_out = rvec(&mut rng, tokens * h, 1.0);
        let sg = rvec(&mut rng, tokens, 2.0);
        let sh = shared.then_some((&sh_out[..], &sg[..]));
        let (want, got, took) = common::per_pair_and_grouped(g, &ex, &x, &x0, &wts, sh);
        assert!(
            took,
            "{} h={h} i={inter}: the grouped kernel must take the shape",
            q.name()
        );
        assert!(
            same_bits(&got, &want),
            "{} h={h} i={inter} k={k} tokens={tokens}: grouped experts differ from per-pair launches",
            q.name()
        );
        // And against the scalar reference, token by token.
        let mut reference = x0.clone();
        for t in 0..tokens {
            let views: Vec<ExpertViews> = (0..k).map(|r| ex.pair_views(t * k + r)).collect();
            let sh_ref = shared.then_some((&sh_out[t * h..][..h], sg[t]));
            add_experts_ref(
                &mut reference[t * h..][..h],
                &views,
                &wts[t * k..][..k],
                &x[t * h..][..h],
                sh_ref,
            );
        }
        let er = rel_err(&got, &reference);
        assert!(er < 5e-5, "{} h={h} i={inter}: rel err {er}", q.name());
    }
}

#[test]
fn rms_norm_and_rope_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(3);
    // 2048 and 4096: the register form (dim % 4 == 0, up to 4096); the rest the loop.
    for dim in [1usize, 7, 64, 255, 2048, 4096, 4100, 5000] {
        let rows = rng.random_range(1..5);
        let x = rvec(&mut rng, rows * dim, 3.0);
        let w = rvec(&mut rng, dim, 1.0);
        let mut want = vec![0.0; rows * dim];
        for (o, xi) in want.chunks_mut(dim).zip(x.chunks(dim)) {
            ops::rms_norm(xi, &w, 1e-6, o);
        }
        let (dx, dw) = (g.upload_f32(&x).unwrap(), g.upload_f32(&w).unwrap());
        let out = g.upload_f32(&vec![f32::NAN; rows * dim]).unwrap();
        g.rms_norm(dx.ptr, dw.ptr, out.ptr, rows, dim, 1e-6)
            .unwrap();
        let norm = g.read_f32(&out, 0, rows * dim).unwrap();
        let e = rel_err(&norm, &want);
        assert!(e < 1e-5, "rms_norm dim {dim}: {e}");
        // The residual add fused into the norm: the same bits as the add
        // kernel followed by the norm, and the same sum left in x.
        let r = rvec(&mut rng, rows * dim, 3.0);
        let dr = g.upload_f32(&r).unwrap();
        let (dx2, out2) = (g.upload_f32(&x).unwrap(), g.upload_f32(&x).unwrap());
        g.add(dx.ptr, dr.ptr, rows * dim).unwrap();
        g.rms_norm(dx.ptr, dw.ptr, out.ptr, rows, dim, 1e-6)
            .unwrap();
        g.add_rms_norm(dx2.ptr, dr.ptr, dw.ptr, out2.ptr, rows, dim, 1e-6)
            .unwrap();
        let bits = |b: &DBuf| -> Vec<u32> {
            let v = g.read_f32(b, 0, rows * dim).unwrap();
            v.iter().map(|f| f.to_bits()).collect()
        };
        assert_eq!(
            bits(&out),
            bits(&out2),
            "add + rms_norm dim {dim}: norms differ"
        );
        assert_eq!(
            bits(&dx),
            bits(&dx2),
            "add + rms_norm dim {dim}: sums differ"
        );
    }
    for (hd, rot, pos) in [
        (64usize, 64usize, 0usize),
        (256, 64, 17),
        (128, 128, 4095),
        (32, 8, 100_000),
    ] {
        let heads = 3;
        let rope = slipstream_models::blocks::Rope::new(rot, 1e7);
        let mut v = rvec(&mut rng, heads * hd, 1.0);
        let dv = g.upload_f32(&v).unwrap();
        let fr = g.upload_f32(&rope.inv_freq).unwrap();
        for hrow in v.chunks_mut(hd) {
            rope.apply(hrow, pos);
        }
        g.rope(dv.ptr, fr.ptr, rot / 2, hd, heads, pos).unwrap();
        let e = rel_err(&g.read_f32(&dv, 0, heads * hd).unwrap(), &v);
        assert!(e < 2e-4, "rope hd {hd} rot {rot} pos {pos}: {e}");
    }
}

/// The CPU decode attention of `blocks.rs` for one query over the first
/// `keys` positions of the caches `k`, `v` (`[positions, nkv * hd]`) of
/// `dims` (nh, nkv, hd).
fn attention_ref(
    q: &[f32],
    (k, v): (&[f32], &[f32]),
    keys: usize,
    (nh, nkv, hd): (usize, usize, usize),
    gate: Option<&[f32]>,
) -> Vec<f32> {
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0; nh * hd];
    for h in 0..nh {
        let kvh = h / group;
        let qh = &q[h * hd..][..hd];
        let mut sc: Vec<f32> = (0..keys)
            .map(|j| ops::dot(qh, &k[(j * nkv + kvh) * hd..][..hd]) * scale)
            .collect();
        ops::softmax_inplace(&mut sc);
        let o = &mut out[h * hd..][..hd];
        for (j, &p) in sc.iter().enumerate() {
            ops::axpy(p, &v[(j * nkv + kvh) * hd..][..hd], o);
        }
        if let Some(gt) = gate {
            for (oi, &gv) in o.iter_mut().zip(&gt[h * hd..][..hd]) {
                *oi *= ops::sigmoid(gv);
            }
        }
    }
    out
}

/// The buffers of an attention launch over the caches `kc`, `vc` of
/// `dims` (nh, nkv, hd): queries at `q`, output at `out`, and the output
/// gate at `gate` where `gated`.
fn attn_io(
    (kc, vc): (&DBuf, &DBuf),
    dims: (usize, usize, usize),
    gated: bool,
    q: DevPtr,
    gate: DevPtr,
    out: DevPtr,
) -> AttnIo {
    AttnIo {
        q,
        kc: kc.ptr,
        vc: vc.ptr,
        dims,
        gate: if gated { gate } else { DevPtr::NULL },
        out,
    }
}

#[test]
fn decode_attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(4);
    for (nh, nkv, hd, keys, gated) in [
        (16usize, 2usize, 256usize, 1usize, true),
        (16, 2, 256, 129, true),
        (32, 4, 128, 300, false),
        (8, 8, 64, 1000, false),
        (6, 2, 96, 128, true),
        (4, 1, 32, 2049, true),
    ] {
        let q = rvec(&mut rng, nh * hd, 1.0);
        let k = rvec(&mut rng, keys * nkv * hd, 1.0);
        let v = rvec(&mut rng, keys * nkv * hd, 1.0);
        let gate = rvec(&mut rng, nh * hd, 2.0);
        let dims = (nh, nkv, hd);
        let want = attention_ref(&q, (&k, &v), keys, dims, gated.then_some(&gate[..]));
        let (dq, dk, dv, dg) = (
            g.upload_f32(&q).unwrap(),
            g.upload_f32(&k).unwrap(),
            g.upload_f32(&v).unwrap(),
            g.upload_f32(&gate).unwrap(),
        );
        // The device-position form (graph replay) runs over a grid sized
        // for a larger cache and must give the same bits.
        let cap = (keys + 200).next_power_of_two();
        let scratch = g.alloc(4 * Gpu::attn_scratch_f32(nh, hd, cap)).unwrap();
        let out = g.upload_f32(&vec![f32::NAN; nh * hd]).unwrap();
        let caches = (&dk, &dv);
        let run = |at: Position| {
            g.attention(
                &attn_io(caches, dims, gated, dq.ptr, dg.ptr, out.ptr),
                at,
                &scratch,
            )
            .unwrap();
            g.read_f32(&out, 0, nh * hd).unwrap()
        };
        let got = run(Position::Host(keys - 1));
        let e = rel_err(&got, &want);
        assert!(
            e < 1e-4,
            "attention nh {nh} nkv {nkv} hd {hd} keys {keys}: {e}"
        );
        let dpos = g.upload_f32(&[f32::from_bits(keys as u32 - 1)]).unwrap();
        let got_dev = run(Position::Device { ptr: dpos.ptr, cap });
        assert!(
            same_bits(&got, &got_dev),
            "attention with the position in device memory differs (keys {keys}, cap {cap})"
        );
        // A causal batch of the last `n` positions in one launch pair: each
        // query the bits of its own one-query launch.
        let n = keys.min(5);
        let qs = rvec(&mut rng, n * nh * hd, 1.0);
        let gs = rvec(&mut rng, n * nh * hd, 2.0);
        let (dqs, dgs) = (g.upload_f32(&qs).unwrap(), g.upload_f32(&gs).unwrap());
        let outs = g.upload_f32(&vec![f32::NAN; n * nh * hd]).unwrap();
        let big = g
            .alloc(4 * n * Gpu::attn_scratch_f32(nh, hd, keys))
            .unwrap();
        let p0 = keys - n;
        g.attention_causal(
            &attn_io(caches, dims, gated, dqs.ptr, dgs.ptr, outs.ptr),
            Position::Host(p0),
            n,
            &big,
        )
        .unwrap();
        let batch = g.read_f32(&outs, 0, n * nh * hd).unwrap();
        let row = nh * hd * 4;
        for t in 0..n {
            let (q_t, gate_t) = (dqs.ptr.add_bytes(t * row), dgs.ptr.add_bytes(t * row));
            g.attention(
                &attn_io(caches, dims, gated, q_t, gate_t, out.ptr),
                Position::Host(p0 + t),
                &scratch,
            )
            .unwrap();
            let one = g.read_f32(&out, 0, nh * hd).unwrap();
            let mine = &batch[t * nh * hd..][..nh * hd];
            assert!(
                same_bits(&one, mine),
                "causal batch query {t} of {n} differs from its own launch (keys {keys})"
            );
            let want_t = attention_ref(
                &qs[t * nh * hd..][..nh * hd],
                (&k, &v),
                p0 + t + 1,
                dims,
                gated.then_some(&gs[t * nh * hd..][..nh * hd]),
            );
            assert!(rel_err(mine, &want_t) < 1e-4, "causal batch query {t}");
        }
    }
}

#[test]
fn prompt_attention_on_tensor_cores_matches_cpu_and_one_query_launches() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(41);
    // (nh, nkv, hd, first position, queries, gated): ragged tiles, groups
    // of 1 to 16, key splits crossed (1024 keys each).
    for (nh, nkv, hd, p0, n, gated) in [
        (16usize, 2usize, 256usize, 0usize, 37usize, true),
        (16, 2, 256, 1000, 50, true),
        (32, 4, 128, 300, 5, false),
        (8, 8, 64, 2040, 20, false),
        (6, 2, 96, 5, 3, true),
        (4, 1, 32, 0, 70, true),
        (16, 1, 64, 100, 9, false),
    ] {
        if !g.prompt_attention_on_tensor_cores(hd) {
            assert!(
                !(g.tc_capable && g.prompt_attn_tc),
                "head dim {hd} should run on tensor cores on this GPU"
            );
            eprintln!(
                "skipped: prompt attention of head dim {hd} does not run on tensor cores here"
            );
            continue;
        }
        let keys = p0 + n;
        let k = rvec(&mut rng, keys * nkv * hd, 1.0);
        let v = rvec(&mut rng, keys * nkv * hd, 1.0);
        // Larger queries than the decode test's: sharper softmaxes.
        let q = rvec(&mut rng, n * nh * hd, 3.0);
        let gate = rvec(&mut rng, n * nh * hd, 2.0);
        let (dq, dk, dv, dg) = (
            g.upload_f32(&q).unwrap(),
            g.upload_f32(&k).unwrap(),
            g.upload_f32(&v).unwrap(),
            g.upload_f32(&gate).unwrap(),
        );
        let scratch = g
            .alloc(4 * n * Gpu::prompt_attn_scratch_f32(nh, hd, keys))
            .unwrap();
        let out = g.upload_f32(&vec![f32::NAN; n * nh * hd]).unwrap();
        let row = nh * hd;
        let dims = (nh, nkv, hd);
        let run = |t0: usize, m: usize| {
            let off = t0 * row * 4;
            let [q, gate, out] = [&dq, &dg, &out].map(|b| b.ptr.add_bytes(off));
            g.attention_prompt(
                &attn_io((&dk, &dv), dims, gated, q, gate, out),
                p0 + t0,
                m,
                &scratch,
            )
            .unwrap();
        };
        run(0, n);
        let whole = g.read_f32(&out, 0, n * row).unwrap();
        for t in 0..n {
            let want = attention_ref(
                &q[t * row..][..row],
                (&k, &v),
                p0 + t + 1,
                dims,
                gated.then_some(&gate[t * row..][..row]),
            );
            let e = rel_err(&whole[t * row..][..row], &want);
            assert!(
                e < 1e-4,
                "prompt attention nh {nh} nkv {nkv} hd {hd} query {t} at {}: {e}",
                p0 + t
            );
        }
        // One query per launch, then the pass cut in two at a random
        // point: the same bits as the whole pass.
        let cut = rng.random_range(1..=n);
        for pieces in [
            (0..n).map(|t| (t, 1)).collect::<Vec<_>>(),
            vec![(0, cut), (cut, n - cut)],
        ] {
            g.write_f32(&out, &vec![f32::NAN; n * row]).unwrap();
            for (t0, m) in pieces {
                if m > 0 {
                    run(t0, m);
                }
            }
            let parts = g.read_f32(&out, 0, n * row).unwrap();
            for t in 0..n {
                assert!(
                    same_bits(&parts[t * row..][..row], &whole[t * row..][..row]),
                    "prompt attention query {t} of {n} (nh {nh} hd {hd}, cut {cut}) differs from the whole pass"
                );
            }
        }
    }
}

#[test]
fn gated_delta_rule_matches_cpu() {
    let Some(mut g) = gpu() else { return };
    // Both register-resident forms (the default column-per-warp one and
    // `gdn_step_r`), each against the CPU and against itself one token at a time.
    for rows in [false, true] {
        g.gdn_rows = rows;
        gated_delta_rule_cases(&g);
    }
}

fn gated_delta_rule_cases(g: &Gpu) {
    let mut rng = Rng64::seed_from_u64(5);
    for (nk, dk, nv, dv, kern, n) in [
        (16usize, 128usize, 32usize, 128usize, 4usize, 1usize),
        (2, 64, 4, 32, 4, 3),
        (1, 16, 3, 24, 2, 5),
        (4, 128, 8, 256, 4, 2),
        (2, 128, 4, 128, 4, 7),
        (1, 96, 2, 100, 3, 4),
    ] {
        let c = 2 * nk * dk + nv * dv;
        let x = rvec(&mut rng, n * c, 1.0);
        let cw = rvec(&mut rng, c * kern, 0.5);
        let st0 = rvec(&mut rng, (kern - 1) * c, 1.0);
        let z = rvec(&mut rng, n * nv * dv, 1.0);
        let b = rvec(&mut rng, n * nv, 2.0);
        let a = rvec(&mut rng, n * nv, 2.0);
        let a_log = rvec(&mut rng, nv, 1.0);
        let dt_bias = rvec(&mut rng, nv, 1.0);
        let nw = rvec(&mut rng, dv, 1.0);
        let s0 = rvec(&mut rng, nv * dk * dv, 0.3);
        let eps = 1e-6f32;
        // CPU: conv + silu, then per head the delta rule as GatedDeltaNet::forward.
        let mut window = st0.clone();
        window.extend_from_slice(&x);
        let mut conv_out = vec![0.0f32; n * c];
        for t in 0..n {
            for ch in 0..c {
                let mut acc = 0.0f32;
                for j in 0..kern {
                    acc += cw[ch * kern + j] * window[(t + j) * c + ch];
                }
                conv_out[t * c + ch] = ops::silu(acc);
            }
        }
        let want_state = window[n * c..].to_vec();
        let mut s = s0.clone();
        let mut want = vec![0.0f32; n * nv * dv];
        let ratio = nv / nk;
        for j in 0..nv {
            let kh = j / ratio;
            let sj = &mut s[j * dk * dv..][..dk * dv];
            let (mut delta, mut o) = (vec![0.0; dv], vec![0.0; dv]);
            for t in 0..n {
                let row = &conv_out[t * c..][..c];
                let mut q = row[kh * dk..][..dk].to_vec();
                let mut key = row[nk * dk + kh * dk..][..dk].to_vec();
                let v = &row[2 * nk * dk + j * dv..][..dv];
                ops::l2_normalize(&mut q, 1e-6);
                ops::l2_normalize(&mut key, 1e-6);
                let qs = 1.0 / (dk as f32).sqrt();
                q.iter_mut().for_each(|x| *x *= qs);
                let beta = ops::sigmoid(b[t * nv + j]);
                let gg = -a_log[j].exp() * ops::softplus(a[t * nv + j] + dt_bias[j]);
                ops::delta_rule_step(
                    slipstream_kernels::Isa::detect(),
                    sj,
                    &key,
                    &q,
                    v,
                    gg.exp(),
                    beta,
                    &mut delta,
                    &mut o,
                );
                let inv = ops::inv_rms(&o, eps);
                for d in 0..dv {
                    want[t * nv * dv + j * dv + d] =
                        (o[d] * inv) * nw[d] * ops::silu(z[t * nv * dv + j * dv + d]);
                }
            }
        }
        let up = |v: &[f32]| g.upload_f32(v).unwrap();
        let (dx, dcw, dst, dz, db, da) = (up(&x), up(&cw), up(&st0), up(&z), up(&b), up(&a));
        let (dal, ddt, dnw, ds) = (up(&a_log), up(&dt_bias), up(&nw), up(&s0));
        let dco = up(&vec![f32::NAN; n * c]);
        let core = up(&vec![f32::NAN; n * nv * dv]);
        g.gdn_conv(
            dx.ptr,
            n,
            &GdnConv {
                weights: dcw.ptr,
                channels: c,
                kernel: kern,
                state: dst.ptr,
            },
            dco.ptr,
        )
        .unwrap();
        let step = GdnStep {
            conv_out: dco.ptr,
            z: dz.ptr,
            b: db.ptr,
            a: da.ptr,
            a_log: dal.ptr,
            dt_bias: ddt.ptr,
            norm: dnw.ptr,
            state: ds.ptr,
            dims: (nk, dk, nv, dv),
            eps,
            core: core.ptr,
        };
        g.gdn_step(&step, n).unwrap();
        let e1 = rel_err(&g.read_f32(&dco, 0, n * c).unwrap(), &conv_out);
        let e2 = rel_err(&g.read_f32(&dst, 0, (kern - 1) * c).unwrap(), &want_state);
        let e3 = rel_err(&g.read_f32(&core, 0, n * nv * dv).unwrap(), &want);
        let e4 = rel_err(&g.read_f32(&ds, 0, nv * dk * dv).unwrap(), &s);
        assert!(
            e1 < 1e-5 && e2 == 0.0,
            "conv {nk}x{dk}/{nv}x{dv}: {e1} {e2}"
        );
        assert!(
            e3 < 1e-4 && e4 < 1e-4,
            "delta rule {nk}x{dk}/{nv}x{dv} n={n}: out {e3} state {e4}"
        );
        // A prefill pass runs the n steps in one launch: the bits of n
        // one-token launches (decode) from the same state.
        let many = g.read_f32(&core, 0, n * nv * dv).unwrap();
        let many_state = g.read_f32(&ds, 0, nv * dk * dv).unwrap();
        let ds1 = up(&s0);
        let core1 = up(&vec![f32::NAN; n * nv * dv]);
        for t in 0..n {
            g.gdn_step(
                &GdnStep {
                    conv_out: dco.f32_at(t * c),
                    z: dz.f32_at(t * nv * dv),
                    b: db.f32_at(t * nv),
                    a: da.f32_at(t * nv),
                    state: ds1.ptr,
                    core: core1.f32_at(t * nv * dv),
                    ..step
                },
                1,
            )
            .unwrap();
        }
        let one = g.read_f32(&core1, 0, n * nv * dv).unwrap();
        let one_state = g.read_f32(&ds1, 0, nv * dk * dv).unwrap();
        assert!(
            same_bits(&many, &one) && same_bits(&many_state, &one_state),
            "delta rule {nk}x{dk}/{nv}x{dv}: {n} steps in one launch differ from one-token launches"
        );
    }
}

#[test]
fn router_topk_and_argmax_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(6);
    for (e, k, renorm) in [
        (256usize, 8usize, true),
        (128, 8, false),
        (60, 4, true),
        (1000, 10, true),
        (1024, 16, false),
        (8, 8, false),
    ] {
        let tokens = 3;
        let mut logits = rvec(&mut rng, tokens * e, 4.0);
        // A tie: the lower id must win.
        logits[5] = logits[3];
        let dl = g.upload_f32(&logits).unwrap();
        let ids = g.alloc(tokens * k * 4).unwrap();
        let wts = g.alloc(tokens * k * 4).unwrap();
        g.router_topk(dl.ptr, e, k, renorm, ids.ptr, wts.ptr, tokens, None, None)
            .unwrap();
        let gi = g.read_i32(&ids, tokens * k).unwrap();
        let gw = g.read_f32(&wts, 0, tokens * k).unwrap();
        for t in 0..tokens {
            let mut p = logits[t * e..][..e].to_vec();
            ops::softmax_inplace(&mut p);
            let mut idx: Vec<usize> = (0..e).collect();
            idx.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
            idx.truncate(k);
            let mut w: Vec<f32> = idx.iter().map(|&i| p[i]).collect();
            if renorm {
                let s: f32 = w.iter().sum();
                w.iter_mut().for_each(|x| *x /= s);
            }
            let got: Vec<usize> = gi[t * k..][..k].iter().map(|&v| v as usize).collect();
            assert_eq!(got, idx, "router e={e} k={k} token {t}");
            let er = rel_err(&gw[t * k..][..k], &w);
            assert!(er < 1e-5, "router weights e={e}: {er}");
        }
        // The router over `n` tokens with an optional publication into
        // mapped memory and an optional bases table.
        let route = |n: usize, publish, bases| {
            g.router_topk(dl.ptr, e, k, renorm, ids.ptr, wts.ptr, n, publish, bases)
        };
        // Published into mapped host memory: token 0's ids and weights (the
        // same bits as in device memory), then the sequence number, on
        // every launch.
        let m = g.alloc_mapped(2 * k + 1).unwrap();
        for seq in [7u32, 8] {
            route(tokens, Some((&m, seq)), None).unwrap();
            m.wait_for(2 * k, seq, &g.stream).unwrap();
            for r in 0..k {
                assert_eq!(m.read(r), gi[r] as u32, "published id e={e} rank {r}");
                assert_eq!(m.read(k + r), gw[r].to_bits(), "published weight e={e}");
            }
        }
        assert!(route(1, Some((&m, 9)), None).is_ok());
        g.sync().unwrap();
        // Device routing: every token's bases table from an expert ->
        // address table (addresses spaced apart so a wrong id, part or
        // token shows): gate `[tokens, k]`, then up, then down.
        let addr: Vec<u64> = (0..e as u64).map(|i| 0x1000_0000 + i * 0x10_0000).collect();
        let addr_bytes: Vec<u8> = addr.iter().flat_map(|a| a.to_le_bytes()).collect();
        let daddr = g.upload(&addr_bytes).unwrap();
        let dbases = g.alloc(3 * tokens * k * 8).unwrap();
        let rb = RouteBases {
            addr: daddr.ptr,
            offsets: [0, 0x100, 0x2000],
            out: dbases.ptr,
        };
        route(tokens, None, Some(&rb)).unwrap();
        let words = g.read_i32(&dbases, 6 * tokens * k).unwrap();
        let got: Vec<u64> = words
            .chunks_exact(2)
            .map(|w| w[0] as u32 as u64 | (w[1] as u32 as u64) << 32)
            .collect();
        let tk = tokens * k;
        for p in 0..tk {
            let a = addr[gi[p] as usize];
            assert_eq!(
                [got[p], got[tk + p], got[2 * tk + p]],
                [a, a + 0x100, a + 0x2000],
                "device-routed bases e={e} pair {p}"
            );
        }
        let small = g.alloc_mapped(2 * k).unwrap();
        assert!(
            route(1, Some((&small, 1)), None).is_err(),
            "a publish buffer without room for the sequence word is refused"
        );
    }
    for n in [1usize, 5, 1024, 1025, 248_320] {
        let mut x = rvec(&mut rng, n, 1.0);
        let m = rng.random_range(0..n);
        x[m] = 2.0;
        if m + 1 < n {
            x[n - 1] = 2.0; // tie with a higher index
        }
        let dx = g.upload_f32(&x).unwrap();
        let out = g.alloc(4).unwrap();
        g.argmax(dx.ptr, n, out.ptr).unwrap();
        assert_eq!(g.read_i32(&out, 1).unwrap()[0] as usize, m, "argmax n={n}");
    }
    // The engine's greedy rule ([`argmax_ref`]; -0.0 equals 0.0).
    let nan = f32::NAN;
    let ninf = f32::NEG_INFINITY;
    let mut cases: Vec<Vec<f32>> = vec![
        vec![nan; 3000],
        vec![ninf; 2049],
        vec![nan, ninf, nan, ninf],
        vec![-0.0, 0.0, -0.0],
        vec![nan, -5.0, nan, -5.0, -7.0],
    ];
    for n in [7usize, 1500, 248_320] {
        let mut x = rvec(&mut rng, n, 1.0);
        for _ in 0..n / 3 {
            let i = rng.random_range(0..n);
            x[i] = [nan, ninf, f32::INFINITY, 0.0, -0.0][rng.random_range(0..5)];
        }
        cases.push(x);
    }
    for x in &cases {
        let dx = g.upload_f32(x).unwrap();
        let out = g.alloc(4).unwrap();
        g.argmax(dx.ptr, x.len(), out.ptr).unwrap();
        let got = g.read_i32(&out, 1).unwrap()[0] as usize;
        assert_eq!(
            got,
            argmax_ref(x),
            "argmax of {} values with NaN / inf / zeros",
            x.len()
        );
    }
}

#[test]
fn embedding_rows_match_dequantize() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(7);
    for q in qtypes() {
        let rows = rng.random_range(2..50);
        let cols = cols_for(&mut rng, q);
        let bytes = rand_weight(&mut rng, q, rows, cols);
        let view = TensorView::new(q, rows, cols, &bytes).unwrap();
        let ids: Vec<u32> = (0..3).map(|_| rng.random_range(0..rows as u32)).collect();
        let mut want = vec![0.0f32; 3 * cols];
        for (t, &i) in ids.iter().enumerate() {
            scalar::dequantize_row(&view, i as usize, &mut want[t * cols..][..cols]);
        }
        let w = g.upload_weight(&view).unwrap();
        let idf: Vec<f32> = ids.iter().map(|&i| f32::from_bits(i)).collect();
        let di = g.upload_f32(&idf).unwrap();
        let out = g.upload_f32(&vec![f32::NAN; 3 * cols]).unwrap();
        g.embed_rows(&w.desc, di.ptr, out.ptr, 3).unwrap();
        let got = g.read_f32(&out, 0, 3 * cols).unwrap();
        assert_eq!(rel_err(&got, &want), 0.0, "embed {}", q.name());
    }
}

/// The routed down projections of a prefill pass (`moe_down` over several
/// tokens: each block stages its token's h once for several row blocks)
/// give every token the bits of its own one-token launch, shared expert
/// or not, ragged row counts included.
#[test]
fn down_pass_matches_one_token_launches() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(21);
    for (q, h, inter, k, e, tokens, shared) in [
        (QuantType::Q4, 2048, 512, 8, 12, 37, true),
        (QuantType::Q4, 200, 256, 3, 5, 4, false),
        (affine(4, 32, ScaleType::Bf16), 1000, 128, 5, 7, 9, true),
    ] {
        let dt = WDesc::new(q, h, inter, DevPtr::NULL).unwrap();
        assert_eq!(
            dt.a4v_chunks(),
            Some(1),
            "[{h}, {inter}]: not the wide down kernel"
        );
        let experts: Vec<_> = (0..e)
            .map(|_| g.upload(&rand_weight(&mut rng, q, h, inter)).unwrap())
            .collect();
        // Each token's k distinct experts.
        let mut bases = Vec::new();
        for _ in 0..tokens {
            let mut ids: Vec<usize> = (0..e).collect();
            for i in 0..k {
                let j = rng.random_range(i..e);
                ids.swap(i, j);
            }
            bases.extend(ids[..k].iter().map(|&id| experts[id].ptr));
        }
        let tb: Vec<u8> = bases.iter().flat_map(|a| a.raw().to_le_bytes()).collect();
        let dbase = g.upload(&tb).unwrap();
        let hv = g
            .upload_f32(&rvec(&mut rng, tokens * k * inter, 1.0))
            .unwrap();
        let wts = g.upload_f32(&rvec(&mut rng, tokens * k, 1.0)).unwrap();
        let sh = g.upload_f32(&rvec(&mut rng, tokens * h, 1.0)).unwrap();
        let sgt = g.upload_f32(&rvec(&mut rng, tokens, 2.0)).unwrap();
        let x0 = rvec(&mut rng, tokens * h, 1.0);
        let xm = g.upload_f32(&x0).unwrap();
        let io = ExpertsIo {
            xrow: DevPtr::NULL,
            xn: DevPtr::NULL,
            h: hv.ptr,
            wts: wts.ptr,
            k,
            shared: common::shared_expert_io(shared.then_some((&sh, &sgt))),
            x: xm.ptr,
            tokens,
        };
        g.moe_down(&dt, dbase.ptr, &io).unwrap();
        let many = g.read_f32(&xm, 0, tokens * h).unwrap();
        let x1 = g.upload_f32(&x0).unwrap();
        for t in 0..tokens {
            g.moe_down(
                &dt,
                dbase.ptr.add_bytes(8 * t * k),
                &ExpertsIo {
                    h: hv.f32_at(t * k * inter),
                    wts: wts.f32_at(t * k),
                    k,
                    shared: (
                        if shared {
                            sh.f32_at(t * h)
                        } else {
                            DevPtr::NULL
                        },
                        if shared { sgt.f32_at(t) } else { DevPtr::NULL },
                    ),
                    x: x1.f32_at(t * h),
                    tokens: 1,
                    ..io
                },
            )
            .unwrap();
        }
        let one = g.read_f32(&x1, 0, tokens * h).unwrap();
        let bad = many
            .iter()
            .zip(&one)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            bad.is_none(),
            "[{h}, {inter}] k={k}, {tokens} tokens: value {bad:?} differs from the one-token launch"
        );
    }
}

/// The engine's greedy rule: the first index of the largest non-NaN value,
/// the last index when every value is NaN.
fn argmax_ref(x: &[f32]) -> usize {
    let mut best: Option<usize> = None;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| v > x[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(x.len() - 1)
}

#[test]
fn seeded_draw_matches_the_integer_reference() {
    use slipstream_kernels::sample::{draw, DrawParams};
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(11);
    let sizes = [1usize, 7, 300, 4099, 248_320];
    let scratch = g.sample_scratch(248_320).unwrap();
    let dx = g.alloc(248_320 * 4).unwrap();
    let out = g.alloc(4).unwrap();
    let mut cases = 0;
    for &n in &sizes {
        // Shapes of logits: spread, nearly flat (top-p keeps most of the
        // vocabulary), peaked, coarse (many exact ties), with NaN / inf.
        for shape in 0..6 {
            let mut x: Vec<f32> = match shape {
                0 => rvec(&mut rng, n, 8.0),
                1 => rvec(&mut rng, n, 0.02),
                2 => {
                    let mut v = rvec(&mut rng, n, 1.0);
                    let at = rng.random_range(0..n);
                    v[at] = 30.0;
                    v
                }
                3 => rvec(&mut rng, n, 3.0)
                    .into_iter()
                    .map(|v| (v * 2.0).round() / 2.0)
                    .collect(),
                4 => {
                    let mut v = rvec(&mut rng, n, 4.0);
                    for _ in 0..n.div_ceil(5) {
                        let at = rng.random_range(0..n);
                        v[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]
                            [rng.random_range(0..5)];
                    }
                    v
                }
                _ => vec![[f32::NAN, f32::NEG_INFINITY][rng.random_range(0..2)]; n],
            };
            if shape == 5 && n > 1 && rng.random_bool(0.5) {
                x[n / 2] = -3.0; // a single finite logit
            }
            g.write_f32(&dx, &x).unwrap();
            for _ in 0..6 {
                let p = DrawParams {
                    temperature: [0.3f32, 0.7, 1.0, 2.5][rng.random_range(0..4)],
                    top_k: [0u32, 0, 1, 2, 20, 40, n as u32 - 1, n as u32, n as u32 + 5]
                        [rng.random_range(0..9)],
                    top_p: [1.0f32, 1.0, 0.95, 0.5, 0.0][rng.random_range(0..5)],
                    min_p: [0.0f32, 0.0, 0.05, 1.5][rng.random_range(0..4)],
                };
                let u = match rng.random_range(0..4) {
                    0 => 0.0,
                    1 => 1.0 - f64::EPSILON / 2.0,
                    _ => rng.random_range(0.0..1.0),
                };
                let want = draw(&x, &p, u).unwrap_or(argmax_ref(&x) as u32);
                g.argmax(dx.ptr, n, out.ptr).unwrap();
                g.sample(dx.ptr, n, &p, u, &scratch, out.ptr).unwrap();
                let got = g.read_i32(&out, 1).unwrap()[0];
                assert_eq!(got, want as i32, "n={n} shape={shape} {p:?} u={u}");
                cases += 1;
            }
        }
    }
    // Many draws from one row follow the reference one for one.
    let x = rvec(&mut rng, 4099, 2.0);
    g.write_f32(&dx, &x).unwrap();
    let p = DrawParams {
        temperature: 0.7,
        top_k: 0,
        top_p: 0.95,
        min_p: 0.0,
    };
    for i in 0..200 {
        let u = i as f64 / 200.0;
        g.argmax(dx.ptr, x.len(), out.ptr).unwrap();
        g.sample(dx.ptr, x.len(), &p, u, &scratch, out.ptr).unwrap();
        assert_eq!(
            g.read_i32(&out, 1).unwrap()[0] as u32,
            draw(&x, &p, u).unwrap()
        );
    }
    assert!(g
        .sample(dx.ptr, 248_321, &p, 0.5, &scratch, out.ptr)
        .is_err());
    eprintln!("seeded draw: {cases} cases + 200 draws equal to the reference");
}
