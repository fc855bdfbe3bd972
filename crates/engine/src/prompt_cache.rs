//! A prompt cache on disk: snapshots taken at prefill chunk boundaries,
//! addressed by a hash of the model and the token prefix, bounded in bytes,
//! least recently used evicted.
//!
//! Each entry is one snapshot file (format in [`crate::snapshot`]) named
//! `{xxh3-128 of model hash and tokens, hex}-{token count}.snap`. There is no
//! index to keep consistent: the directory listing is the index, a file's
//! modification time is its last use (set on every hit), and its size counts
//! against the bound. A lookup tries the cached prefix lengths of the prompt
//! from the longest down, and accepts an entry only when the token list
//! stored inside it equals the prompt's prefix (a hash collision never
//! restores a wrong state) and it passes every check of
//! [`crate::snapshot::read_snapshot`]. An entry that fails is removed and the
//! next shorter one tried. Linear-attention state cannot be sliced by token,
//! so only prefixes at which a snapshot was taken can be resumed.
//! Temporary files of interrupted writes are never read and are removed when
//! older than ten minutes.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use slipstream_models::ModelState;
use xxhash_rust::xxh3::Xxh3;

use crate::snapshot::{
    encoded_len, read_snapshot, write_snapshot, Snapshot, SnapshotError, SnapshotExpect,
};

/// One cached prefix.
#[derive(Debug, Clone)]
pub struct CacheEntry {
    pub path: PathBuf,
    pub key: String,
    pub tokens: usize,
    pub bytes: u64,
    pub used: SystemTime,
}

/// An on-disk prompt cache for one model.
pub struct PromptCache {
    dir: PathBuf,
    max_bytes: u64,
    expect: SnapshotExpect,
}

/// The address of a token prefix of the model with `model_hash`.
pub fn prefix_key(model_hash: &str, tokens: &[u32]) -> String {
    let mut h = Xxh3::new();
    h.update(&(model_hash.len() as u64).to_le_bytes());
    h.update(model_hash.as_bytes());
    for c in tokens.chunks(4096) {
        let bytes: Vec<u8> = c.iter().flat_map(|t| t.to_le_bytes()).collect();
        h.update(&bytes);
    }
    format!("{:032x}", h.digest128())
}

impl PromptCache {
    /// Opens (creating) `dir` as the prompt cache of the model `expect`
    /// describes, holding at most `max_bytes` of snapshots.
    pub fn open(dir: &Path, max_bytes: u64, expect: SnapshotExpect) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let cache = PromptCache {
            dir: dir.to_path_buf(),
            max_bytes,
            expect,
        };
        cache.remove_stale_temps();
        Ok(cache)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    fn remove_stale_temps(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let now = SystemTime::now();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !(name.starts_with('.') && name.contains(".tmp.")) {
                continue;
            }
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|m| now.duration_since(m).ok())
                .is_some_and(|age| age > Duration::from_secs(600));
            if old {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// Every entry (any model), oldest use first.
    pub fn entries(&self) -> Vec<CacheEntry> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(stem) = name.strip_suffix(".snap") else {
                continue;
            };
            let Some((key, n)) = stem.split_once('-') else {
                continue;
            };
            let (Ok(tokens), true) = (n.parse::<usize>(), key.len() == 32) else {
                continue;
            };
            let Ok(meta) = e.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            out.push(CacheEntry {
                path: e.path(),
                key: key.to_string(),
                tokens,
                bytes: meta.len(),
                used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            });
        }
        out.sort_by(|a, b| a.used.cmp(&b.used).then(a.path.cmp(&b.path)));
        out
    }

    /// Bytes held by entries.
    pub fn total_bytes(&self) -> u64 {
        self.entries().iter().map(|e| e.bytes).sum()
    }

    fn path_for(&self, tokens: &[u32]) -> PathBuf {
        self.dir.join(format!(
            "{}-{}.snap",
            prefix_key(&self.expect.model_hash, tokens),
            tokens.len()
        ))
    }

    /// The longest cached prefix of `prompt` (at most all of it), checked in
    /// full; marks it used. Bad entries are removed with a warning.
    pub fn lookup(&self, prompt: &[u32]) -> Option<Snapshot> {
        let mut candidates: Vec<CacheEntry> = self
            .entries()
            .into_iter()
            .filter(|e| e.tokens > 0 && e.tokens <= prompt.len())
            .collect();
        candidates.sort_by_key(|e| std::cmp::Reverse(e.tokens));
        let mut last_len = usize::MAX;
        let mut key = String::new();
        for e in candidates {
            if e.tokens != last_len {
                key = prefix_key(&self.expect.model_hash, &prompt[..e.tokens]);
                last_len = e.tokens;
            }
            if e.key != key {
                continue;
            }
            match read_snapshot(&e.path, &self.expect) {
                Ok(s) if s.state.tokens == prompt[..e.tokens] => {
                    touch(&e.path);
                    return Some(s);
                }
                Ok(_) => {
                    tracing::warn!(
                        "prompt cache: {} has a colliding hash but other tokens; skipped",
                        e.path.display()
                    );
                }
                Err(err) => {
                    tracing::warn!(
                        "prompt cache: removing unusable entry {}: {err}",
                        e.path.display()
                    );
                    let _ = std::fs::remove_file(&e.path);
                }
            }
        }
        None
    }

    /// Stores `state` (and the experts resident with it) under its tokens,
    /// then evicts least recently used entries until the cache fits. Returns
    /// the bytes written (0 when the entry existed, was only marked used, or
    /// is larger than the whole cache).
    pub fn insert(&self, state: &ModelState, resident: &[Vec<u32>]) -> Result<u64, SnapshotError> {
        if state.tokens.is_empty() || state.last_logits.is_empty() {
            return Ok(0);
        }
        let path = self.path_for(&state.tokens);
        if path.exists() {
            touch(&path);
            return Ok(0);
        }
        if encoded_len(&self.expect.model_hash, state, resident) > self.max_bytes {
            return Ok(0);
        }
        let n = write_snapshot(&path, &self.expect.model_hash, state, resident)?;
        touch(&path);
        self.evict(Some(&path));
        Ok(n)
    }

    /// Removes least recently used entries until the total fits, never `keep`.
    pub fn evict(&self, keep: Option<&Path>) {
        let entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
        for e in entries {
            if total <= self.max_bytes {
                break;
            }
            if Some(e.path.as_path()) == keep {
                continue;
            }
            if std::fs::remove_file(&e.path).is_ok() {
                total -= e.bytes;
            }
        }
    }
}

fn touch(path: &Path) {
    if let Ok(f) = std::fs::OpenOptions::new().append(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}
