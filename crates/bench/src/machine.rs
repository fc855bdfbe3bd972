//! What a result was measured on and at: commit, machine, load, time.

use serde::Serialize;

/// The machine a run happened on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cpu_model: String,
    /// Logical CPUs this process may use.
    pub cores: usize,
    pub ram_bytes: u64,
    pub kernel: String,
    pub hostname: String,
}

impl Machine {
    pub fn detect() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let ram_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines().find_map(|l| {
                    let rest = l.strip_prefix("MemTotal:")?;
                    let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
                    Some(kb * 1024)
                })
            })
            .unwrap_or(0);
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unknown".into())
        };
        Self {
            cpu_model,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ram_bytes,
            kernel: read("/proc/sys/kernel/osrelease"),
            hostname: read("/proc/sys/kernel/hostname"),
        }
    }

    /// One line: `Intel Xeon ..., 2 cores, 23.4 GiB, Linux 6.1.0`.
    pub fn summary(&self) -> String {
        format!(
            "{}, {} cores, {:.1} GiB RAM, Linux {}",
            self.cpu_model,
            self.cores,
            self.ram_bytes as f64 / (1u64 << 30) as f64,
            self.kernel
        )
    }
}

/// When, at which commit and on what machine results were measured: the
/// first fields of both result files' `meta`.
#[derive(Clone, Debug, Serialize)]
pub struct Stamp {
    pub date: String,
    pub commit: String,
    /// `git rev-parse HEAD`, `build time` or `--commit`.
    pub commit_source: String,
    pub machine: Machine,
}

impl Stamp {
    /// Now, on this machine, at `commit` when given, else at [`commit`]'s.
    pub fn now(commit: Option<&str>) -> Self {
        let (commit, commit_source) = match commit {
            Some(c) => (c.to_string(), "--commit"),
            None => self::commit(),
        };
        Self {
            date: utc_now().0,
            commit,
            commit_source: commit_source.to_string(),
            machine: Machine::detect(),
        }
    }

    /// `Measured DATE at commit COMMIT on MACHINE`, for the tables' notes.
    pub fn measured(&self) -> String {
        format!(
            "Measured {} at commit {} on {}",
            self.date,
            self.commit,
            self.machine.summary()
        )
    }
}

/// The machine's load over a run: the other work a figure shared the
/// machine with.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Load {
    pub load_before: Option<[f64; 3]>,
    pub load_after: Option<[f64; 3]>,
    /// Share of the machine's CPU time stolen by the hypervisor while the
    /// run lasted (`/proc/stat`): a virtual machine's neighbours slow it
    /// down without showing in the load average.
    pub steal_fraction: Option<f64>,
}

/// A [`Load`] being measured, from [`LoadWatch::start`] on.
pub struct LoadWatch {
    load_before: Option<[f64; 3]>,
    ticks_before: Option<(u64, u64)>,
}

impl LoadWatch {
    pub fn start() -> Self {
        Self {
            load_before: load_average(),
            ticks_before: cpu_ticks(),
        }
    }

    /// What is known before the run ends: the load before it.
    pub fn so_far(&self) -> Load {
        Load {
            load_before: self.load_before,
            ..Load::default()
        }
    }

    /// The load over the run, now that it has ended.
    pub fn finish(&self) -> Load {
        Load {
            load_before: self.load_before,
            load_after: load_average(),
            steal_fraction: steal_fraction(self.ticks_before, cpu_ticks()),
        }
    }
}

/// The 1-, 5- and 15-minute load averages.
pub fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = text.split_whitespace().map(|v| v.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

/// The machine-wide CPU time counters of `/proc/stat`'s `cpu` line, in
/// clock ticks: (all time, time stolen by the hypervisor).
pub fn cpu_ticks() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    parse_cpu_ticks(&text)
}

fn parse_cpu_ticks(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let vals: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]:
    // guest time is already counted in user and nice.
    let steal = *vals.get(7)?;
    let total = vals.iter().take(8).sum();
    Some((total, steal))
}

/// Share of the CPU time between two [`cpu_ticks`] readings that the
/// hypervisor gave to other guests (0 to 1); `None` when unknown.
pub fn steal_fraction(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((t0, s0), (t1, s1)) = (before?, after?);
    let total = t1.checked_sub(t0)?;
    (total > 0).then(|| s1.saturating_sub(s0) as f64 / total as f64)
}

/// The commit being measured: `git rev-parse` in the current directory
/// when that works, else the commit this binary was built from.
pub fn commit() -> (String, &'static str) {
    let git = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    match git {
        Some(c) => (c, "git rev-parse HEAD"),
        None => (env!("SLIPSTREAM_BUILD_COMMIT").to_string(), "build time"),
    }
}

/// UTC now as `2026-12-02T15:20:00Z` and as `20261202-152000` (for names).
pub fn utc_now() -> (String, String) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d, hh, mm, ss) = civil(secs);
    (
        format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z"),
        format!("{y:04}{m:02}{d:02}-{hh:02}{mm:02}{ss:02}"),
    )
}

/// Seconds since the epoch to (year, month, day, hour, minute, second), UTC
/// (Howard Hinnant's days-to-civil).
fn civil(secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        y,
        m,
        d,
        (rem / 3600) as u32,
        (rem % 3600 / 60) as u32,
        (rem % 60) as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil(0), (1970, 1, 1, 0, 0, 0));
        assert_eq!(civil(1_796_224_800), (2026, 12, 2, 15, 20, 0));
        assert_eq!(civil(951_782_400), (2000, 2, 29, 0, 0, 0));
    }

    #[test]
    fn machine_is_described() {
        let m = Machine::detect();
        assert!(m.cores >= 1);
        assert!(m.summary().contains("cores"));
        assert!(load_average().is_some());
        let stat = "cpu  100 5 20 800 10 0 5 60 0 0\ncpu0 50 2 10 400 5 0 2 30 0 0\n";
        assert_eq!(parse_cpu_ticks(stat), Some((1000, 60)));
        assert_eq!(parse_cpu_ticks("cpu  1 2\n"), None);
        assert_eq!(
            steal_fraction(Some((1000, 60)), Some((2000, 310))),
            Some(0.25)
        );
        assert_eq!(steal_fraction(Some((1000, 60)), Some((1000, 60))), None);
        assert_eq!(steal_fraction(None, Some((1000, 60))), None);
        assert!(!commit().0.is_empty());
    }
}
