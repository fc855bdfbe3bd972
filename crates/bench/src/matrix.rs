//! The benchmark matrix: what each run is, parsed from the command line's
//! comma-separated lists, and expanded into an ordered list of runs.

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// Expert slots per layer of a slipstream row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Slots {
    /// `--expert-cache-slots N`.
    Count(usize),
    /// As many slots as the model has experts per layer (streaming store,
    /// filled on first use).
    All,
    /// `--resident`: every expert read into memory before the first token.
    Resident,
    /// No slot flag: the run's memory plan picks slots and direct I/O from
    /// the memory it finds (cgroup cap included), as a user's plain run does.
    Auto,
}

/// File cache state put in place before each run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// The model files evicted from the page cache.
    Cold,
    /// The model files read once, so they are in the page cache as far as
    /// memory allows.
    Warm,
}

impl CacheMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "cold" => Ok(Self::Cold),
            "warm" => Ok(Self::Warm),
            other => bail!("bad --cache {other:?}: expected cold or warm"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Cold => "cold",
            Self::Warm => "warm",
        }
    }
}

/// How llama.cpp holds the GGUF weights in a peer row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerMode {
    /// mmap on and weight repacking off: the weights stay file-backed and
    /// stream through the page cache (the only llama.cpp setting a memory cap
    /// can bite on without an OOM kill).
    Mmap,
    /// mmap on with llama.cpp's default CPU repack, which copies the weights
    /// it repacks into anonymous memory.
    MmapRepack,
    /// `--mmap 0` with repacking off: every weight read into anonymous
    /// memory at load, in its stored layout.
    NoMmap,
    /// `--mmap 0` with llama.cpp's default CPU repack.
    NoMmapRepack,
}

impl PeerMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "mmap" => Ok(Self::Mmap),
            "mmap-repack" => Ok(Self::MmapRepack),
            "no-mmap" => Ok(Self::NoMmap),
            "no-mmap-repack" => Ok(Self::NoMmapRepack),
            other => bail!(
                "bad peer mode {other:?}: expected mmap, mmap-repack, no-mmap or no-mmap-repack"
            ),
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Mmap => "mmap, --repack 0",
            Self::MmapRepack => "mmap, default repack",
            Self::NoMmap => "--mmap 0, --repack 0",
            Self::NoMmapRepack => "--mmap 0, default repack",
        }
    }
}

/// A peer runtime: its kind and the directory holding its binaries.
#[derive(Clone, Debug, Serialize)]
pub struct Peer {
    pub name: String,
    pub dir: std::path::PathBuf,
}

/// Parses `--peer NAME=DIR`; only `llama.cpp` is known.
pub fn parse_peer(s: &str) -> Result<Peer> {
    let (name, dir) = s
        .split_once('=')
        .with_context(|| format!("bad --peer {s:?}: expected llama.cpp=DIR"))?;
    if name != "llama.cpp" {
        bail!("unknown peer {name:?} in --peer {s:?}: only llama.cpp is supported");
    }
    if dir.is_empty() {
        bail!("--peer {s:?} names no directory");
    }
    Ok(Peer {
        name: name.to_string(),
        dir: dir.into(),
    })
}

/// One runtime setting (a row of the results table before prompt length
/// and memory cap are chosen).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "runtime", rename_all = "kebab-case")]
pub enum Setting {
    Slipstream {
        slots: Slots,
        policy: String,
        /// `--direct-io`: `auto` (the default), `on` or `off`.
        direct_io: String,
        /// `--activations`: `f32` (exact, the default) or `int16`.
        activations: String,
    },
    #[serde(rename = "llama.cpp")]
    LlamaCpp { mode: PeerMode },
}

impl Setting {
    pub fn runtime(&self) -> &'static str {
        match self {
            Self::Slipstream { .. } => "slipstream",
            Self::LlamaCpp { .. } => "llama.cpp",
        }
    }

    /// Human label, e.g. `slipstream, 64 slots, aging` or `llama.cpp, --mmap 0`.
    pub fn label(&self) -> String {
        match self {
            Self::Slipstream {
                slots,
                policy,
                direct_io,
                activations,
            } => {
                let s = match slots {
                    Slots::Count(n) => format!("{n} slots"),
                    Slots::All => "all slots".to_string(),
                    Slots::Resident => "resident".to_string(),
                    Slots::Auto => "auto slots".to_string(),
                };
                let dio = match direct_io.as_str() {
                    "on" => ", direct I/O",
                    "off" => ", buffered I/O",
                    _ => "",
                };
                let act = if activations == "f32" {
                    String::new()
                } else {
                    format!(", {activations} activations")
                };
                format!("slipstream, {s}, {policy}{dio}{act}")
            }
            Self::LlamaCpp { mode } => format!("llama.cpp, {}", mode.label()),
        }
    }
}

/// One run of the matrix.
#[derive(Clone, Debug, Serialize)]
pub struct RunSpec {
    pub setting: Setting,
    pub prompt_len: usize,
    pub gen: usize,
    /// Memory cap in bytes (a cgroup), if any.
    pub memory_cap: Option<u64>,
}

impl RunSpec {
    /// Setting label plus the cap, e.g. `slipstream, 16 slots, aging, cap 8.0 GiB`.
    pub fn label(&self) -> String {
        match self.memory_cap {
            Some(c) => format!("{}, cap {}", self.setting.label(), fmt_gib(c)),
            None => self.setting.label(),
        }
    }
}

/// `8.0 GiB`.
pub fn fmt_gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Parses a comma-separated list with `item`, naming the flag in errors.
pub fn parse_list<T>(flag: &str, s: &str, item: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            bail!("{flag} {s:?} has an empty entry");
        }
        out.push(item(part).with_context(|| format!("in {flag} {s:?}"))?);
    }
    if out.is_empty() {
        bail!("{flag} is empty");
    }
    Ok(out)
}

/// `--slots 16,64,all,resident,auto`, or `none` (no slipstream rows: peers only).
pub fn parse_slots(s: &str) -> Result<Vec<Slots>> {
    if s.trim() == "none" {
        return Ok(Vec::new());
    }
    parse_list("--slots", s, |p| match p {
        "all" => Ok(Slots::All),
        "resident" => Ok(Slots::Resident),
        "auto" => Ok(Slots::Auto),
        n => match n.parse::<usize>() {
            Ok(0) => bail!("slot count 0: a layer needs at least one slot"),
            Ok(v) => Ok(Slots::Count(v)),
            Err(_) => bail!("bad slot count {n:?}: expected a positive number, all or resident"),
        },
    })
}

/// `--direct-io auto,on,off`.
pub fn parse_direct_io(s: &str) -> Result<Vec<String>> {
    parse_list("--direct-io", s, |p| match p {
        "auto" | "on" | "off" => Ok(p.to_string()),
        other => bail!("bad value {other:?}: expected auto, on or off"),
    })
}

/// `--policy aging,lru`.
pub fn parse_policies(s: &str) -> Result<Vec<String>> {
    parse_list("--policy", s, |p| match p {
        "aging" | "lfu" | "lru" => Ok(p.to_string()),
        other => bail!("unknown policy {other:?}: expected aging, lfu or lru"),
    })
}

/// `--activations f32,int16,int8`.
pub fn parse_activations(s: &str) -> Result<Vec<String>> {
    parse_list("--activations", s, |p| match p {
        "f32" | "int16" | "int8" => Ok(p.to_string()),
        other => bail!("unknown activations {other:?}: expected f32, int16 or int8"),
    })
}

/// `--prompt-lens 1024,3072`: positive token counts.
pub fn parse_lens(s: &str) -> Result<Vec<usize>> {
    parse_list("--prompt-lens", s, |p| match p.parse::<usize>() {
        Ok(0) => bail!("prompt length 0"),
        Ok(v) => Ok(v),
        Err(_) => bail!("bad prompt length {p:?}: expected a token count"),
    })
}

/// `8G`, `512M`, `1.5G`: binary units (K = 1024), as `slipstream run
/// --memory-limit` reads them.
pub fn parse_size(s: &str) -> Result<u64> {
    let bytes = slipstream_core::size::parse_size(s).map_err(anyhow::Error::msg)?;
    if bytes == 0 {
        bail!("size {s:?} is zero");
    }
    Ok(bytes)
}

/// Which runs go under `--memory-cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapRuns {
    /// Every setting uncapped and again capped.
    Both,
    /// Every setting capped only.
    Capped,
}

impl CapRuns {
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "both" => Ok(Self::Both),
            "capped" => Ok(Self::Capped),
            other => bail!("bad --cap-runs {other:?}: expected both or capped"),
        }
    }
}

/// Everything the matrix is built from.
#[derive(Clone, Debug)]
pub struct MatrixSpec {
    pub slots: Vec<Slots>,
    pub policies: Vec<String>,
    pub direct_io: Vec<String>,
    /// Activation modes of the slipstream rows (`f32`, `int16`).
    pub activations: Vec<String>,
    pub prompt_lens: Vec<usize>,
    pub gen: usize,
    /// Peer modes, empty when no peer runs.
    pub peer_modes: Vec<PeerMode>,
    pub memory_cap: Option<u64>,
    pub cap_runs: CapRuns,
    /// Slot settings run under the cap (None: all of `slots`); lets a matrix
    /// skip e.g. `all` under a cap smaller than the expert pool.
    pub cap_slots: Option<Vec<Slots>>,
}

/// Expands the matrix: by prompt length, then uncapped before capped, then
/// slipstream settings (slots, policy, direct I/O) before peer modes.
pub fn expand(m: &MatrixSpec) -> Vec<RunSpec> {
    let mut out = Vec::new();
    let caps: Vec<Option<u64>> = match (m.memory_cap, m.cap_runs) {
        (None, _) => vec![None],
        (Some(c), CapRuns::Both) => vec![None, Some(c)],
        (Some(c), CapRuns::Capped) => vec![Some(c)],
    };
    for &prompt_len in &m.prompt_lens {
        for &cap in &caps {
            for &slots in &m.slots {
                if cap.is_some() {
                    if let Some(allowed) = &m.cap_slots {
                        if !allowed.contains(&slots) {
                            continue;
                        }
                    }
                }
                for policy in &m.policies {
                    for direct_io in &m.direct_io {
                        for activations in &m.activations {
                            out.push(RunSpec {
                                setting: Setting::Slipstream {
                                    slots,
                                    policy: policy.clone(),
                                    direct_io: direct_io.clone(),
                                    activations: activations.clone(),
                                },
                                prompt_len,
                                gen: m.gen,
                                memory_cap: cap,
                            });
                        }
                    }
                }
            }
            for &mode in &m.peer_modes {
                out.push(RunSpec {
                    setting: Setting::LlamaCpp { mode },
                    prompt_len,
                    gen: m.gen,
                    memory_cap: cap,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_parse_and_reject() {
        assert!(parse_slots("none").unwrap().is_empty());
        assert_eq!(
            parse_slots("16, 64,all,resident,auto").unwrap(),
            vec![
                Slots::Count(16),
                Slots::Count(64),
                Slots::All,
                Slots::Resident,
                Slots::Auto
            ]
        );
        for bad in ["", "16,,64", "sixteen", "0", "-3", "16;64"] {
            let e = format!("{:#}", parse_slots(bad).unwrap_err());
            assert!(e.contains("--slots"), "{bad:?}: {e}");
        }
        assert_eq!(
            parse_activations("f32,int16,int8").unwrap(),
            vec!["f32", "int16", "int8"]
        );
        for bad in ["", "int4", "f32,"] {
            let e = format!("{:#}", parse_activations(bad).unwrap_err());
            assert!(e.contains("--activations"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8G").unwrap(), 8 << 30);
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert!(parse_size("8X").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("G").is_err());
    }

    #[test]
    fn matrix_order_and_caps() {
        let m = MatrixSpec {
            slots: vec![Slots::Count(16), Slots::All],
            policies: vec!["aging".into()],
            direct_io: vec!["auto".into()],
            activations: vec!["f32".into(), "int16".into()],
            prompt_lens: vec![8, 16],
            gen: 4,
            peer_modes: vec![PeerMode::Mmap],
            memory_cap: Some(1 << 30),
            cap_runs: CapRuns::Both,
            cap_slots: Some(vec![Slots::Count(16)]),
        };
        let runs = expand(&m);
        let labels: Vec<String> = runs
            .iter()
            .filter(|r| r.prompt_len == 8)
            .map(|r| r.label())
            .collect();
        assert_eq!(
            labels,
            vec![
                "slipstream, 16 slots, aging",
                "slipstream, 16 slots, aging, int16 activations",
                "slipstream, all slots, aging",
                "slipstream, all slots, aging, int16 activations",
                "llama.cpp, mmap, --repack 0",
                "slipstream, 16 slots, aging, cap 1.0 GiB",
                "slipstream, 16 slots, aging, int16 activations, cap 1.0 GiB",
                "llama.cpp, mmap, --repack 0, cap 1.0 GiB",
            ]
        );
        assert_eq!(runs.len(), 16);
    }

    #[test]
    fn peers() {
        let p = parse_peer("llama.cpp=/opt/ll").unwrap();
        assert_eq!(p.dir, std::path::PathBuf::from("/opt/ll"));
        assert!(parse_peer("vllm=/x").is_err());
        assert!(parse_peer("llama.cpp").is_err());
        assert!(parse_peer("llama.cpp=").is_err());
    }
}
