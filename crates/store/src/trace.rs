//! Route traces: every expert request a run makes, in order, so that
//! `slipstream replay` can run the same sequence through any policy.
//!
//! Text format, one access (one layer of one batch) per line:
//! ```text
//! # slipstream route trace v1 layers=40 experts=256 top_k=8
//! P 0 2940 0:12 5:40 ...      prefill chunk: layer, tokens, expert:count ...
//! D 0 1 3:1 17:1 ...          decode step
//! ```

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

/// Whether an access belongs to prompt processing or generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Prefill,
    Decode,
}

impl Phase {
    fn tag(self) -> char {
        match self {
            Phase::Prefill => 'P',
            Phase::Decode => 'D',
        }
    }
}

/// One recorded access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRecord {
    pub phase: Phase,
    pub layer: usize,
    pub tokens: u32,
    /// Distinct experts, ascending.
    pub experts: Vec<u32>,
    /// Tokens per expert.
    pub counts: Vec<u32>,
}

/// Shape of the model a trace was recorded on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceHeader {
    pub layers: usize,
    pub experts: usize,
    pub top_k: usize,
}

/// Appends records to a trace file; the file appears complete at `finish`
/// (written to a temp file, then renamed).
pub struct TraceWriter {
    out: BufWriter<File>,
    tmp: PathBuf,
    path: PathBuf,
}

impl TraceWriter {
    pub fn create(path: &Path, header: TraceHeader) -> std::io::Result<Self> {
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let mut out = BufWriter::new(File::create(&tmp)?);
        writeln!(
            out,
            "# slipstream route trace v1 layers={} experts={} top_k={}",
            header.layers, header.experts, header.top_k
        )?;
        Ok(TraceWriter {
            out,
            tmp,
            path: path.to_path_buf(),
        })
    }

    pub fn record(
        &mut self,
        phase: Phase,
        layer: usize,
        tokens: u32,
        experts: &[u32],
        counts: &[u32],
    ) -> std::io::Result<()> {
        write!(self.out, "{} {layer} {tokens}", phase.tag())?;
        for (e, c) in experts.iter().zip(counts) {
            write!(self.out, " {e}:{c}")?;
        }
        writeln!(self.out)
    }

    /// Flushes, syncs and moves the trace into place.
    pub fn finish(mut self) -> std::io::Result<()> {
        self.out.flush()?;
        self.out.get_ref().sync_all()?;
        std::fs::rename(&self.tmp, &self.path)
    }
}

/// Most layers a trace header may give (a model config's bound).
pub const MAX_TRACE_LAYERS: usize = 1024;
/// Most experts (and top-k) a trace header may give (a model config's bound).
pub const MAX_TRACE_EXPERTS: usize = 1 << 16;

/// Reads a whole trace; errors name the line.
pub fn read_trace(path: &Path) -> Result<(TraceHeader, Vec<TraceRecord>), String> {
    let f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut lines = BufReader::new(f).lines();
    let bad = |n: usize, why: &str| format!("{}:{}: {why}", path.display(), n);
    let first = lines
        .next()
        .ok_or_else(|| bad(1, "empty file"))?
        .map_err(|e| bad(1, &e.to_string()))?;
    let rest = first
        .strip_prefix("# slipstream route trace v1")
        .ok_or_else(|| bad(1, "not a slipstream route trace (v1)"))?;
    let field = |key: &str| -> Result<usize, String> {
        rest.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(1, &format!("header lacks {key}")))
    };
    let header = TraceHeader {
        layers: field("layers")?,
        experts: field("experts")?,
        top_k: field("top_k")?,
    };
    // The bounds a model config has (`ModelConfig::validate`): replay
    // builds a cache per layer with a slot table per expert.
    for (key, value, most) in [
        ("layers", header.layers, MAX_TRACE_LAYERS),
        ("experts", header.experts, MAX_TRACE_EXPERTS),
        ("top_k", header.top_k, MAX_TRACE_EXPERTS),
    ] {
        if value > most {
            return Err(bad(1, &format!("{key}={value} is more than {most}")));
        }
    }
    let mut records = Vec::new();
    for (i, line) in lines.enumerate() {
        let n = i + 2;
        let line = line.map_err(|e| bad(n, &e.to_string()))?;
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let phase = match parts.next() {
            Some("P") => Phase::Prefill,
            Some("D") => Phase::Decode,
            _ => return Err(bad(n, "expected P or D")),
        };
        let layer: usize = parts
            .next()
            .and_then(|v| v.parse().ok())
            .filter(|&l| l < header.layers)
            .ok_or_else(|| bad(n, "bad layer"))?;
        let tokens: u32 = parts
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(n, "bad token count"))?;
        let mut experts = Vec::new();
        let mut counts = Vec::new();
        for p in parts {
            let (e, c) = p
                .split_once(':')
                .and_then(|(e, c)| Some((e.parse::<u32>().ok()?, c.parse::<u32>().ok()?)))
                .ok_or_else(|| bad(n, &format!("bad expert entry {p:?}")))?;
            if e as usize >= header.experts || experts.last().is_some_and(|&l| l >= e) {
                return Err(bad(n, "expert ids must be ascending and in range"));
            }
            experts.push(e);
            counts.push(c);
        }
        records.push(TraceRecord {
            phase,
            layer,
            tokens,
            experts,
            counts,
        });
    }
    Ok((header, records))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by `slipstream-fuzz`: `layers=2^64-1` made replay build caches
    /// without end.
    #[test]
    fn header_counts_past_a_models_bounds_are_refused() {
        let dir = tempfile_dir("trace-bounds");
        let path = dir.join("t.trace");
        for (header, says) in [
            ("layers=18446744073709551615 experts=16 top_k=4", "layers="),
            ("layers=1025 experts=16 top_k=4", "layers=1025"),
            ("layers=4 experts=1099511627776 top_k=4", "experts="),
            ("layers=4 experts=16 top_k=70000", "top_k="),
        ] {
            std::fs::write(
                &path,
                format!("# slipstream route trace v1 {header}\nD 0 1 3:1\n"),
            )
            .unwrap();
            let e = read_trace(&path).unwrap_err();
            assert!(e.contains(says) && e.contains(":1:"), "{header}: {e}");
        }
        std::fs::write(
            &path,
            "# slipstream route trace v1 layers=1024 experts=65536 top_k=8\nD 1023 1 65535:1\n",
        )
        .unwrap();
        assert_eq!(read_trace(&path).unwrap().1.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("trace-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.trace");
        let header = TraceHeader {
            layers: 2,
            experts: 8,
            top_k: 2,
        };
        let mut w = TraceWriter::create(&path, header).unwrap();
        w.record(Phase::Prefill, 0, 3, &[1, 4], &[2, 4]).unwrap();
        w.record(Phase::Decode, 1, 1, &[0, 7], &[1, 1]).unwrap();
        assert!(!path.exists(), "trace appears only when finished");
        w.finish().unwrap();
        let (h, recs) = read_trace(&path).unwrap();
        assert_eq!(h, header);
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0].experts, vec![1, 4]);
        assert_eq!(recs[1].phase, Phase::Decode);
        std::fs::write(
            &path,
            "# slipstream route trace v1 layers=1 experts=4 top_k=1\nD 0 1 9:1\n",
        )
        .unwrap();
        assert!(read_trace(&path).unwrap_err().contains(":2:"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
