//! What the machine offers a run, read from `/proc/meminfo` and the cgroup
//! files: the one place the `slipstream` command learns its memory. The
//! figures go down to the engine's planning
//! (`slipstream_engine::plan_memory`) and the memory guard explicitly; no
//! library crate reads these files.

use std::path::Path;

use slipstream_engine::MachineMemory;

/// This machine's memory: `MemTotal` and `MemAvailable` of `/proc/meminfo`
/// and the cgroup limit over this process ([`cgroup_limit_bytes`]). Fields
/// that cannot be read (not Linux) are `None`.
pub fn detect() -> MachineMemory {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    MachineMemory {
        total: meminfo_bytes(&meminfo, "MemTotal:"),
        available: meminfo_bytes(&meminfo, "MemAvailable:"),
        cgroup_limit: cgroup_limit_bytes(),
        assumed: false,
    }
}

/// The value of `field` (e.g. `MemTotal:`) in the text of `/proc/meminfo`,
/// in bytes (the file counts kB).
pub fn meminfo_bytes(meminfo: &str, field: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb.saturating_mul(1024))
}

/// The cgroup memory limit of this process, `None` when unlimited or unknown:
/// the smallest limit of its own memory cgroup (named in `/proc/self/cgroup`)
/// and every ancestor up to the mount's root, cgroup v2 (`memory.max`) or
/// v1 (`memory.limit_in_bytes`).
pub fn cgroup_limit_bytes() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    cgroup_limit_in(Path::new("/sys/fs/cgroup"), &own)
}

/// [`cgroup_limit_bytes`] against a cgroup mount at `root` and the text of
/// `/proc/self/cgroup` (`own`).
pub fn cgroup_limit_in(root: &Path, own: &str) -> Option<u64> {
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

#[cfg(test)]
mod tests {
    use super::{cgroup_limit_in, meminfo_bytes};
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

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_bytes(text, "MemTotal:"), Some(24_576_000 * 1024));
        assert_eq!(
            meminfo_bytes(text, "MemAvailable:"),
            Some(20_000_000 * 1024)
        );
        assert_eq!(meminfo_bytes("MemTotal: lots kB\n", "MemTotal:"), None);
        assert_eq!(meminfo_bytes("", "MemAvailable:"), None);
    }
}
