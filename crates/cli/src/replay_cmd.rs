//! `slipstream replay`: runs a recorded route trace through every requested
//! expert-cache policy and slot count, and prints misses per token.

use std::path::Path;

use anyhow::{anyhow, Result};
use rayon::prelude::*;
use slipstream_store::replay::{expand_policies, replay, PhaseFilter, ReplayResult};
use slipstream_store::trace::read_trace;

/// Reads `trace`, replays it (all records, prefill included, as the runtime
/// does) under each of `policies` (names of
/// `slipstream_store::policies::POLICY_NAMES`, or `all`) at each of `slots`
/// slots per layer, in parallel, and prints a table: one row per policy, one
/// column per slot count, cells = misses per decode token (per token overall
/// when the trace has no decode records).
pub fn replay_command(trace: &Path, slots: &[usize], policies: &[String]) -> Result<()> {
    let (header, records) = read_trace(trace).map_err(|e| anyhow!(e))?;
    let all = ["all".to_string()];
    let policies = expand_policies(if policies.is_empty() { &all } else { policies })
        .map_err(|e| anyhow!(e))?;
    if slots.is_empty() {
        return Err(anyhow!("no slot counts given"));
    }
    let jobs: Vec<(usize, usize)> = (0..policies.len())
        .flat_map(|p| (0..slots.len()).map(move |s| (p, s)))
        .collect();
    let results: Vec<ReplayResult> = jobs
        .par_iter()
        .map(|&(p, s)| replay(&header, &records, slots[s], policies[p], PhaseFilter::All))
        .collect::<Result<_, String>>()
        .map_err(|e| anyhow!(e))?;
    let first = &results[0];
    println!(
        "trace: {} ({} layers, {} experts, top-{}; {} decode tokens, {} prefill tokens)",
        trace.display(),
        header.layers,
        header.experts,
        header.top_k,
        first.decode_tokens,
        first.prefill_tokens
    );
    let decode = first.decode_tokens > 0;
    println!(
        "misses per {} (of {} requests)",
        if decode { "decode token" } else { "token" },
        header.top_k * header.layers
    );
    print!("{}", table(&policies, slots, &results, decode));
    Ok(())
}

/// The table body: `results` in (policy, slots) row-major order.
fn table(policies: &[&str], slots: &[usize], results: &[ReplayResult], decode: bool) -> String {
    let name_w = policies.iter().map(|p| p.len()).max().unwrap_or(6).max(6);
    let col_w = slots
        .iter()
        .map(|s| s.to_string().len() + 2)
        .max()
        .unwrap_or(0)
        .max(8);
    let mut out = format!("{:<name_w$}", "policy");
    for s in slots {
        out += &format!("{s:>col_w$}");
    }
    out.push('\n');
    for (p, row) in policies.iter().zip(results.chunks(slots.len())) {
        out += &format!("{p:<name_w$}");
        for r in row {
            let v = if decode {
                r.misses_per_decode_token
            } else {
                r.misses_per_token
            };
            match v {
                Some(v) => out += &format!("{v:>col_w$.1}"),
                None => out += &format!("{:>col_w$}", "-"),
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_a_small_trace() {
        use slipstream_store::trace::{Phase, TraceHeader, TraceWriter};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let header = TraceHeader {
            layers: 2,
            experts: 8,
            top_k: 2,
        };
        let mut w = TraceWriter::create(&path, header).unwrap();
        for l in 0..2 {
            w.record(Phase::Prefill, l, 4, &[0, 1, 2], &[3, 3, 2])
                .unwrap();
        }
        for t in 0..20u32 {
            for l in 0..2 {
                w.record(Phase::Decode, l, 1, &[t % 3, 3 + t % 5], &[1, 1])
                    .unwrap();
            }
        }
        w.finish().unwrap();
        replay_command(&path, &[1, 2, 8], &["all".into()]).unwrap();
        assert!(replay_command(&path, &[1], &["nope".into()]).is_err());
        let (h, recs) = read_trace(&path).unwrap();
        let rs: Vec<ReplayResult> = ["lru", "belady"]
            .iter()
            .map(|p| replay(&h, &recs, 8, p, PhaseFilter::All).unwrap())
            .collect();
        let t = table(&["lru", "belady"], &[8], &rs, true);
        // 8 slots hold all 8 experts: no decode misses beyond cold ones
        // (experts 3..7 first appear in decode: 5 per layer).
        assert!(t.contains("0.5"), "{t}");
    }
}
