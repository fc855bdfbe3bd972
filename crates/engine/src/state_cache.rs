//! A RAM cache of conversation states with many checkpoints, so an agent's
//! next turn prefills only its new tokens.
//!
//! Hybrid models cannot rewind: the Gated DeltaNet conv and recurrent states
//! hold the whole past in a fixed size, so a state can only resume from a
//! position where a copy of them was taken. Attention KV can: it is cut to
//! any length. An [`Entry`] is one conversation: its full state (tokens,
//! KV, the linear states at its end) plus [`Checkpoint`]s, each the linear
//! states and next-token logits at one position. Checkpoints are taken at
//! every multiple of the interval inside a prefill, at the end of every
//! prompt, and the entry's own end is the end of its last reply. The KV is
//! stored once per entry and shared by its checkpoints.
//!
//! A lookup takes the token-level longest common prefix of the prompt with
//! every entry and resumes at the entry's furthest checkpoint inside it:
//! - the prompt extends the whole entry: the state is moved out (no copy);
//! - the prompt diverges inside the entry's last reply (chat templates that
//!   re-render earlier replies without their `<think>` text do this every
//!   turn): the entry is a dead branch, cut in place to the checkpoint;
//! - earlier (a side request sharing the system prompt, an agent that
//!   rewrites the middle of its prompt): the KV prefix is copied, the entry
//!   stays for the conversation it belongs to.
//!
//! The cache is bounded in bytes. Eviction takes the entry with the least
//! `tokens / (1 + age)` (age in requests since its last use): prefill time
//! saved, discounted by staleness, so a side request's small entry goes
//! before the main conversation's large one.

use std::collections::HashSet;
use std::sync::Arc;

use slipstream_models::state::{AttnState, LayerState, LinearState};
use slipstream_models::ModelState;

/// The linear-attention states and next-token logits at one position.
#[derive(Debug)]
pub struct Checkpoint {
    /// Tokens consumed when it was taken.
    pub position: usize,
    /// Per layer: the conv and recurrent state of linear-attention layers,
    /// `None` for attention layers (their KV is cut from the entry's).
    linear: Vec<Option<LinearState>>,
    /// `[vocab]` logits after token `position - 1`.
    last_logits: Vec<f32>,
}

impl Checkpoint {
    /// Takes a checkpoint of `state` at its current position. `None` when
    /// the state has no logits for its last token (nothing could resume).
    pub fn of(state: &ModelState) -> Option<Self> {
        if state.last_logits.is_empty() {
            return None;
        }
        Some(Checkpoint {
            position: state.tokens.len(),
            linear: state
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Linear(s) => Some(s.clone()),
                    LayerState::Attn(_) => None,
                })
                .collect(),
            last_logits: state.last_logits.clone(),
        })
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let linear: usize = self
            .linear
            .iter()
            .flatten()
            .map(|s| (s.conv.len() + s.recurrent.len()) * 4)
            .sum();
        linear + self.last_logits.len() * 4
    }
}

/// Bytes of one checkpoint of a state shaped like `state` (linear states and
/// a row of `vocab` logits).
pub fn checkpoint_bytes(state: &ModelState, vocab: usize) -> usize {
    let linear: usize = state
        .layers
        .iter()
        .map(|l| match l {
            LayerState::Linear(s) => (s.conv.len() + s.recurrent.len()) * 4,
            LayerState::Attn(_) => 0,
        })
        .sum();
    linear + vocab * 4
}

/// Tokens between checkpoints inside a prefill for a model whose
/// checkpoint costs `checkpoint_bytes` and whose KV grows by
/// `kv_bytes_per_token`: the checkpoints of a long prompt take at most as
/// much memory as its KV, and never come closer than 256 tokens (where a
/// checkpoint costs more than the prefill it saves) or further than 8192.
pub fn default_checkpoint_interval(checkpoint_bytes: usize, kv_bytes_per_token: usize) -> usize {
    let raw = checkpoint_bytes / kv_bytes_per_token.max(1);
    raw.next_multiple_of(256).clamp(256, 8192)
}

/// One conversation.
#[derive(Debug)]
struct Entry {
    /// Full state at the end of the last reply (`last_logits` may be empty
    /// when the reply was cancelled).
    state: ModelState,
    /// Ascending positions, all `<= state.tokens.len()`.
    checkpoints: Vec<Arc<Checkpoint>>,
    /// Where the last prompt of this conversation ended.
    prompt_end: usize,
    /// Experts the expert cache held when the entry was stored.
    resident: Vec<Vec<u32>>,
    last_use: u64,
}

/// What [`StateCache::restore`] found for a prompt.
#[derive(Debug)]
pub struct Restored {
    /// The state to continue from; its tokens are a prefix of the prompt
    /// (empty when nothing matched).
    pub state: ModelState,
    /// Checkpoints valid for this state's tokens (positions `<=` its length),
    /// to be kept with the conversation.
    pub checkpoints: Vec<Arc<Checkpoint>>,
    /// Experts resident when the source entry was stored (for warming the
    /// expert cache), when a state was restored.
    pub resident: Option<Vec<Vec<u32>>>,
}

/// What the cache holds, for logs and `/health`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCacheStats {
    pub entries: usize,
    pub checkpoints: usize,
    pub bytes: usize,
    pub max_bytes: usize,
}

/// The RAM tier of conversation states; see the module doc.
#[derive(Debug)]
pub struct StateCache {
    entries: Vec<Entry>,
    max_bytes: usize,
    /// Prefill checkpoint spacing in tokens.
    interval: usize,
    /// Requests seen, the clock of `last_use`.
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How an entry would serve a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    /// The prompt extends the whole entry.
    Whole,
    /// At checkpoint `idx`.
    Checkpoint(usize),
    /// At `position`, cutting the KV, with no linear state to restore and
    /// no logits (a model without linear-attention layers).
    KvOnly(usize),
}

impl StateCache {
    /// A cache of at most `max_bytes`, taking a checkpoint every
    /// `interval` tokens inside prefills.
    pub fn new(max_bytes: usize, interval: usize) -> Self {
        StateCache {
            entries: Vec::new(),
            max_bytes,
            interval: interval.max(1),
            clock: 0,
        }
    }

    /// Prefill checkpoint spacing in tokens.
    pub fn interval(&self) -> usize {
        self.interval
    }

    /// Entries, checkpoints and bytes held (shared checkpoints once).
    pub fn stats(&self) -> StateCacheStats {
        let mut seen = HashSet::new();
        let mut bytes = 0;
        let mut checkpoints = 0;
        for e in &self.entries {
            bytes += e.state.bytes();
            for c in &e.checkpoints {
                if seen.insert(Arc::as_ptr(c)) {
                    bytes += c.bytes();
                    checkpoints += 1;
                }
            }
        }
        StateCacheStats {
            entries: self.entries.len(),
            checkpoints,
            bytes,
            max_bytes: self.max_bytes,
        }
    }

    /// Where `entry` can resume `prompt`, and how many tokens that reuses.
    fn best_resume(entry: &Entry, prompt: &[u32]) -> Option<(usize, Resume)> {
        let tokens = &entry.state.tokens;
        let common = common_prefix(tokens, prompt);
        let has_linear = entry
            .state
            .layers
            .iter()
            .any(|l| matches!(l, LayerState::Linear(_)));
        let whole_ok = common == tokens.len()
            && !tokens.is_empty()
            && (common < prompt.len() || !entry.state.last_logits.is_empty());
        if whole_ok {
            return Some((common, Resume::Whole));
        }
        let checkpoint = entry
            .checkpoints
            .iter()
            .rposition(|c| c.position <= common && c.position > 0)
            .map(|i| (entry.checkpoints[i].position, Resume::Checkpoint(i)));
        // Without linear state any cut of the KV resumes, one token short of
        // the prompt so its logits are computed.
        let kv_cut = (!has_linear)
            .then(|| common.min(prompt.len().saturating_sub(1)))
            .filter(|&p| p > 0)
            .map(|p| (p, Resume::KvOnly(p)));
        match (checkpoint, kv_cut) {
            (Some(a), Some(b)) => Some(if b.0 > a.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// The state that reuses most of `prompt`, or `fresh` when nothing
    /// does. The source entry is moved out when the prompt extends it or
    /// leaves it only inside its last reply; otherwise its KV prefix is
    /// copied and it stays.
    pub fn restore(&mut self, prompt: &[u32], fresh: ModelState) -> Restored {
        self.clock += 1;
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.state.layers.len() == fresh.layers.len())
            .filter_map(|(i, e)| Self::best_resume(e, prompt).map(|(n, how)| (n, i, how)))
            .max_by_key(|&(n, i, _)| (n, self.entries[i].last_use));
        let Some((reused, idx, how)) = best else {
            return Restored {
                state: fresh,
                checkpoints: Vec::new(),
                resident: None,
            };
        };
        let dead_branch = reused >= self.entries[idx].prompt_end;
        if how == Resume::Whole || dead_branch {
            let mut entry = self.entries.swap_remove(idx);
            cut(&mut entry, reused, how);
            return Restored {
                state: entry.state,
                checkpoints: entry.checkpoints,
                resident: Some(entry.resident),
            };
        }
        let entry = &mut self.entries[idx];
        entry.last_use = self.clock;
        let state = copy_prefix(entry, reused, how);
        Restored {
            checkpoints: entry
                .checkpoints
                .iter()
                .filter(|c| c.position <= reused)
                .cloned()
                .collect(),
            resident: Some(entry.resident.clone()),
            state,
        }
    }

    /// Keeps `state` (a conversation after a request: its tokens are the
    /// prompt of `prompt_len` tokens and the reply) with its checkpoints.
    /// Entries it extends are dropped (their checkpoints are merged in);
    /// then entries are evicted until the cache fits its bound.
    pub fn insert(
        &mut self,
        state: ModelState,
        mut checkpoints: Vec<Arc<Checkpoint>>,
        prompt_len: usize,
        resident: Vec<Vec<u32>>,
    ) {
        if state.tokens.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.entries.len() {
            let e = &self.entries[i];
            if state.tokens.starts_with(&e.state.tokens) {
                let old = self.entries.swap_remove(i);
                checkpoints.extend(old.checkpoints);
            } else {
                i += 1;
            }
        }
        checkpoints.sort_by_key(|c| c.position);
        checkpoints.dedup_by_key(|c| c.position);
        checkpoints.retain(|c| c.position <= state.tokens.len());
        self.entries.push(Entry {
            state,
            checkpoints,
            prompt_end: prompt_len,
            resident,
            last_use: self.clock,
        });
        self.evict();
    }

    /// Evicts until the cache fits, keeping at least one entry (the most
    /// valuable), as the server's one kept state did before this cache.
    fn evict(&mut self) {
        while self.entries.len() > 1 && self.stats().bytes > self.max_bytes {
            let clock = self.clock;
            let score = |e: &Entry| {
                e.state.tokens.len() as f64 / (1 + clock - e.last_use.min(clock)) as f64
            };
            let worst = (0..self.entries.len())
                .min_by(|&a, &b| score(&self.entries[a]).total_cmp(&score(&self.entries[b])));
            match worst {
                Some(i) => {
                    self.entries.remove(i);
                }
                None => break,
            }
        }
    }
}

/// Cuts `entry` in place to `position` (`how` says where the linear state
/// comes from).
fn cut(entry: &mut Entry, position: usize, how: Resume) {
    if how == Resume::Whole {
        return;
    }
    let state = &mut entry.state;
    for (layer, l) in state.layers.iter_mut().enumerate() {
        match l {
            LayerState::Attn(a) => {
                a.k.truncate(position * a.kv_dim);
                a.v.truncate(position * a.kv_dim);
            }
            LayerState::Linear(s) => {
                if let Resume::Checkpoint(i) = how {
                    if let Some(saved) = &entry.checkpoints[i].linear[layer] {
                        *s = saved.clone();
                    }
                }
            }
        }
    }
    state.tokens.truncate(position);
    state.last_logits = match how {
        Resume::Checkpoint(i) => entry.checkpoints[i].last_logits.clone(),
        _ => Vec::new(),
    };
    entry.checkpoints.retain(|c| c.position <= position);
}

/// A new state holding `entry`'s first `position` tokens.
fn copy_prefix(entry: &Entry, position: usize, how: Resume) -> ModelState {
    let checkpoint = match how {
        Resume::Checkpoint(i) => Some(&entry.checkpoints[i]),
        _ => None,
    };
    let layers = entry
        .state
        .layers
        .iter()
        .enumerate()
        .map(|(layer, l)| match l {
            LayerState::Attn(a) => LayerState::Attn(AttnState {
                k: a.k[..position * a.kv_dim].to_vec(),
                v: a.v[..position * a.kv_dim].to_vec(),
                kv_dim: a.kv_dim,
            }),
            LayerState::Linear(s) => LayerState::Linear(
                checkpoint
                    .and_then(|c| c.linear[layer].clone())
                    .unwrap_or_else(|| s.clone()),
            ),
        })
        .collect();
    ModelState {
        layers,
        tokens: entry.state.tokens[..position].to_vec(),
        last_logits: checkpoint
            .map(|c| c.last_logits.clone())
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests;
