//! The memory guard: before each prefill chunk the engine reads the process
//! footprint and refuses the chunk when the footprint plus the predicted
//! growth would exceed the limit, so a prompt the machine cannot hold is a
//! clear error instead of an OOM kill.
//!
//! The prediction ([`GrowthPrediction`]) counts:
//! - `state`: KV rows of every full-attention layer for all prompt tokens
//!   still to prefill in this call (so an over-long prompt is refused before
//!   its first chunk, not half way), plus the linear layers' fixed state when
//!   the state is still fresh (its pages are untouched until the first token);
//! - `activations`: buffers of one chunk (projections, routed-expert outputs
//!   per rank, logits rows), and the logits rows kept for every remaining
//!   token when all logits were asked for;
//! - `unfilled_slots`: expert slot memory not yet holding an expert, as the
//!   store reports it *now*. This is counted once: as slots fill, the
//!   footprint grows and this term shrinks by the same amount. (The reference
//!   extrapolated the first chunk's slot filling as a per-chunk rate and
//!   refused long prompts at large slot counts; footnote 11 of the seed.)
//! - `dense_untouched`: the part of the mapped dense weights not yet in this
//!   process's resident set (`Rss` of the mapping in `/proc/self/smaps`;
//!   opening a model verifies every dense tensor through the mapping, so this
//!   is usually near zero; counting the whole file again refused 80 slots of
//!   the 35B model under an 8 GiB cap that fit).
//!
//! The footprint is `VmRSS` from `/proc/self/status`; the default limit is
//! 90 % of the smaller of `MemTotal` and the cgroup limit (v2 `memory.max`,
//! v1 `memory.limit_in_bytes`). Where those files do not exist (not Linux)
//! the guard is off unless a limit is given and the footprint reads as 0.

/// Predicted growth of the footprint before a prefill chunk, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GrowthPrediction {
    pub state: u64,
    pub activations: u64,
    pub unfilled_slots: u64,
    pub dense_untouched: u64,
}

impl GrowthPrediction {
    pub fn total(&self) -> u64 {
        self.state + self.activations + self.unfilled_slots + self.dense_untouched
    }
}

fn status_kb(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Bytes of the mapping that contains address `addr` that are in this
/// process's resident set (its `Rss` in `/proc/self/smaps`), `None` when
/// unknown.
pub fn mapping_rss_bytes(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = (a..b).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(rest) = line.strip_prefix("Rss:") {
                let kb = rest.split_whitespace().next()?.parse::<u64>().ok()?;
                return Some(kb * 1024);
            }
        }
    }
    None
}

/// Resident set size of this process now (`VmRSS`), `None` when unknown.
pub fn current_rss_bytes() -> Option<u64> {
    status_kb("VmRSS:")
}

/// Physical memory (`MemTotal` of `/proc/meminfo`).
pub fn physical_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The cgroup memory limit of this process, `None` when unlimited or unknown:
/// the smallest limit of its own memory cgroup (named in `/proc/self/cgroup`)
/// and every ancestor up to the mount's root, cgroup v2 (`memory.max`) or
/// v1 (`memory.limit_in_bytes`).
pub fn cgroup_limit_bytes() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    cgroup_limit_in(std::path::Path::new("/sys/fs/cgroup"), &own)
}

/// [`cgroup_limit_bytes`] against a cgroup mount at `root` and the text of
/// `/proc/self/cgroup` (`own`).
pub fn cgroup_limit_in(root: &std::path::Path, own: &str) -> Option<u64> {
    let parse = |s: &str| -> Option<u64> {
        let t = s.trim();
        if t == "max" {
            return None;
        }
        let v = t.parse::<u64>().ok()?;
        // cgroup v1 reports "unlimited" as a huge page-rounded number.
        (v < (1u64 << 60)).then_some(v)
    };
    // Lines are `id:controllers:path`; v1 names `memory` among the
    // controllers, v2 has id 0 and no controllers.
    let mut v1 = None;
    let mut v2 = None;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if ctrl.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        } else if id == "0" && ctrl.is_empty() {
            v2 = Some(path.to_string());
        }
    }
    // The limits of `dir` under `base` and of each ancestor up to `base`.
    let smallest = |base: std::path::PathBuf, dir: &str, file: &str| -> Option<u64> {
        let mut best: Option<u64> = None;
        let mut rel = std::path::PathBuf::from(dir.trim_start_matches('/'));
        loop {
            if let Some(v) = std::fs::read_to_string(base.join(&rel).join(file))
                .ok()
                .and_then(|t| parse(&t))
            {
                best = Some(best.map_or(v, |b| b.min(v)));
            }
            if !rel.pop() {
                return best;
            }
        }
    };
    let mem_v1 = root.join("memory");
    if mem_v1.join("memory.limit_in_bytes").exists() {
        return smallest(
            mem_v1,
            v1.as_deref().unwrap_or("/"),
            "memory.limit_in_bytes",
        );
    }
    if root.join("cgroup.controllers").exists() {
        return smallest(
            root.to_path_buf(),
            v2.as_deref().unwrap_or("/"),
            "memory.max",
        );
    }
    None
}

/// 90 % of the smaller of physical memory and the cgroup limit.
pub fn default_memory_limit() -> Option<u64> {
    crate::available_memory().map(|m| m / 10 * 9)
}

pub(crate) fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// The guard's refusal message.
pub(crate) fn refusal(
    chunk_tokens: usize,
    done: usize,
    total: usize,
    footprint: u64,
    growth: &GrowthPrediction,
    limit: u64,
) -> String {
    format!(
        "memory guard: refusing prefill chunk of {chunk_tokens} tokens (prompt tokens {}..{} of {total}): \
         footprint {:.3} GB + predicted growth {:.3} GB (KV/state {:.3}, activations {:.3}, unfilled expert slots {:.3}, untouched dense weights {:.3}) \
         exceeds the memory limit of {:.3} GB; raise --memory-limit, use fewer expert slots or a smaller --prefill-chunk, or shorten the prompt",
        done,
        done + chunk_tokens,
        gb(footprint),
        gb(growth.total()),
        gb(growth.state),
        gb(growth.activations),
        gb(growth.unfilled_slots),
        gb(growth.dense_untouched),
        gb(limit)
    )
}

#[cfg(test)]
mod tests {
    use super::cgroup_limit_in;
    use std::path::Path;

    fn write(root: &Path, dir: &str, file: &str, value: &str) {
        let d = root.join(dir);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(file), value).unwrap();
    }

    #[test]
    fn v1_limit_is_the_smallest_of_own_cgroup_and_ancestors() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let unlimited = "9223372036854771712\n";
        write(root, "memory", "memory.limit_in_bytes", unlimited);
        write(root, "memory/a", "memory.limit_in_bytes", "8000000000\n");
        write(root, "memory/a/b", "memory.limit_in_bytes", unlimited);
        let own = "9:name=systemd:/\n4:memory:/a/b\n3:cpuset:/\n";
        assert_eq!(cgroup_limit_in(root, own), Some(8_000_000_000));
        // A tighter own limit wins; the root's own file is no answer.
        write(root, "memory/a/b", "memory.limit_in_bytes", "3000000000\n");
        assert_eq!(cgroup_limit_in(root, own), Some(3_000_000_000));
        // Combined controllers, and a process in the root: unlimited.
        assert_eq!(
            cgroup_limit_in(root, "5:cpu,memory:/a\n"),
            Some(8_000_000_000)
        );
        assert_eq!(cgroup_limit_in(root, "4:memory:/\n"), None);
    }

    #[test]
    fn v2_limit_walks_up_from_own_cgroup() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        write(root, "", "cgroup.controllers", "cpu memory\n");
        write(root, "user.slice", "memory.max", "6000000000\n");
        write(root, "user.slice/job", "memory.max", "max\n");
        assert_eq!(
            cgroup_limit_in(root, "0::/user.slice/job\n"),
            Some(6_000_000_000)
        );
        assert_eq!(cgroup_limit_in(root, "0::/\n"), None);
        // No cgroup mount at all.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(cgroup_limit_in(empty.path(), "0::/x\n"), None);
    }
}
