//! `--direct-io auto`: O_DIRECT when every expert has a slot or when the
//! memory beside the predicted footprint cannot cache half of the expert
//! file; buffered otherwise; explicit choices always win.

mod common;

use common::repacked;
use slipstream_engine::{predict_footprint, resolve_direct_io};
use slipstream_format::SlipModel;
use slipstream_repack::QuantChoice;
use slipstream_store::DirectIo;

#[test]
fn auto_direct_io_follows_slots_and_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let path = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let file = SlipModel::open(&path).unwrap();
    let m = &file.manifest;
    let experts = m.config.num_experts;
    let pool = m.experts.record_stride * (m.config.num_layers() * experts) as u64;
    let (context, chunk) = (4096, 512);
    let resolve =
        |mode, slots, memory| resolve_direct_io(mode, &file, slots, context, chunk, memory).direct;

    // Explicit choices win whatever the memory.
    assert!(resolve(DirectIo::On, 1, Some(u64::MAX)));
    assert!(!resolve(DirectIo::Off, experts, Some(1)));

    // Every expert in a slot: a page-cache copy is duplication.
    assert!(resolve(DirectIo::Auto, experts, Some(u64::MAX)));
    assert!(resolve(DirectIo::Auto, experts + 5, None));

    // Unknown memory keeps buffered reads.
    assert!(!resolve(DirectIo::Auto, 2, None));

    // The threshold: room beside the footprint for half the expert file.
    let footprint = predict_footprint(&file, 2, context, chunk).total();
    assert!(!resolve(DirectIo::Auto, 2, Some(footprint + pool / 2)));
    assert!(resolve(DirectIo::Auto, 2, Some(footprint + pool / 2 - 1)));
    assert!(resolve(DirectIo::Auto, 2, Some(footprint / 2)));
    // More slots need more memory for the same decision.
    let bigger = predict_footprint(&file, 3, context, chunk).total();
    assert!(bigger > footprint);
    assert!(resolve(DirectIo::Auto, 3, Some(footprint + pool / 2)));

    // The reason names the decision's inputs.
    let why = resolve_direct_io(DirectIo::Auto, &file, 2, context, chunk, Some(1)).reason;
    assert!(
        why.starts_with("auto:") && why.contains("expert file"),
        "{why}"
    );
}
