//! Speculative decoding on the CPU backend: drafters (the model's MTP
//! head, prompt lookup, or one the caller installs), the settings, the
//! governor that turns speculation off where it does not pay, and the
//! counters reported with a generation. The verify step itself is in
//! [`crate::generate`]; the verify pass and the rollback are
//! [`slipstream_models::Transformer::forward_verify`] and
//! [`slipstream_models::ModelState::rollback`]. See docs/SPECULATIVE.md.

use std::time::Duration;

use slipstream_core::ExpertSource;
use slipstream_models::{Logits, MtpState, Transformer};

use crate::sampler::argmax;

/// Which drafter proposes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SpeculateMode {
    /// Plain decoding.
    #[default]
    Off,
    /// The model's multi-token-prediction head, chained greedily.
    Mtp,
    /// Prompt lookup: what followed the latest earlier occurrence of the
    /// last n-gram of the prompt and the text so far.
    Lookup,
    /// Prompt lookup where an n-gram of at least 2 tokens matches, the MTP
    /// head otherwise.
    Both,
    /// The drafter installed with [`crate::Engine::set_drafter`].
    Custom,
}

impl SpeculateMode {
    pub fn name(&self) -> &'static str {
        match self {
            SpeculateMode::Off => "off",
            SpeculateMode::Mtp => "mtp",
            SpeculateMode::Lookup => "lookup",
            SpeculateMode::Both => "both",
            SpeculateMode::Custom => "custom",
        }
    }

    fn uses_mtp(&self) -> bool {
        matches!(self, SpeculateMode::Mtp | SpeculateMode::Both)
    }
}

impl std::str::FromStr for SpeculateMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(SpeculateMode::Off),
            "mtp" => Ok(SpeculateMode::Mtp),
            "lookup" => Ok(SpeculateMode::Lookup),
            "both" => Ok(SpeculateMode::Both),
            _ => Err(format!(
                "unknown speculation mode {s:?}: expected off, mtp, lookup or both"
            )),
        }
    }
}

/// Draft tokens per verify pass when none is given (measured on the demo
/// model with prompt lookup; see docs/BENCHMARKS.md).
pub const DEFAULT_DRAFT_TOKENS: usize = 4;

/// Most draft tokens per verify pass.
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Speculative decoding settings of an engine ([`crate::Engine::set_speculation`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Speculation {
    pub mode: SpeculateMode,
    /// Drafts per verify pass (`1..=MAX_DRAFT_TOKENS`).
    pub draft_tokens: usize,
    /// Let the [`Governor`] turn speculation off where it does not pay.
    pub auto_off: bool,
}

impl Default for Speculation {
    fn default() -> Self {
        Speculation {
            mode: SpeculateMode::Off,
            draft_tokens: DEFAULT_DRAFT_TOKENS,
            auto_off: true,
        }
    }
}

impl Speculation {
    /// Checks the settings against a model with `mtp_layers` MTP layers.
    pub fn check(&self, mtp_layers: usize) -> Result<(), String> {
        if self.mode == SpeculateMode::Off {
            return Ok(());
        }
        if self.draft_tokens == 0 || self.draft_tokens > MAX_DRAFT_TOKENS {
            return Err(format!(
                "draft tokens must be 1 to {MAX_DRAFT_TOKENS}, not {}",
                self.draft_tokens
            ));
        }
        if self.mode.uses_mtp() && mtp_layers == 0 {
            return Err(format!(
                "speculation mode {} needs an MTP head; this model has none (use lookup)",
                self.mode.name()
            ));
        }
        Ok(())
    }
}

/// A source of draft tokens installed by the caller
/// ([`SpeculateMode::Custom`]).
pub trait Drafter: Send {
    /// Up to `k` tokens expected after `history` (the prompt and every
    /// token generated so far; the last of them is not yet run).
    fn draft(&mut self, history: &[u32], k: usize) -> Vec<u32>;
}

/// Longest n-gram prompt lookup tries.
pub const LOOKUP_MAX_NGRAM: usize = 3;

/// Up to `k` tokens that followed the latest earlier occurrence of the
/// last `n` tokens of `history`, trying `n` from `max_ngram` down to
/// `min_ngram`; empty when none matches.
pub fn lookup_draft(history: &[u32], k: usize, min_ngram: usize, max_ngram: usize) -> Vec<u32> {
    let len = history.len();
    for n in (min_ngram.max(1)..=max_ngram).rev() {
        if len <= n {
            continue;
        }
        let pattern = &history[len - n..];
        // Latest first: recent text predicts best.
        if let Some(i) = (0..len - n).rev().find(|&i| &history[i..i + n] == pattern) {
            let from = i + n;
            return history[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// Rows of the MTP cache kept at most; older hidden rows are dropped
/// (the head's attention then starts later: drafts only, no output
/// depends on it).
const MTP_WINDOW: usize = 8192;

/// The MTP head's drafting state: its KV cache over the main positions
/// before `pending_start`, and the main model's final-normed hidden rows
/// not yet run through it (positions `pending_start..`).
pub(crate) struct MtpDrafter {
    state: MtpState,
    /// `[rows, hidden]` for positions `pending_start..`.
    pending: Vec<f32>,
    pending_start: usize,
    hidden: usize,
}

impl MtpDrafter {
    pub(crate) fn new(model: &Transformer) -> Option<Self> {
        Some(MtpDrafter {
            state: model.new_mtp_state()?,
            pending: Vec::new(),
            pending_start: 0,
            hidden: model.config.hidden_size,
        })
    }

    fn cached(&self) -> usize {
        self.state.position(0)
    }

    fn pending_rows(&self) -> usize {
        self.pending.len() / self.hidden
    }

    /// Takes the hidden rows of main positions `start..` (`[rows, hidden]`).
    /// A gap (rows not seen) starts the cache over at `start`.
    pub(crate) fn push_hidden(&mut self, start: usize, rows: &[f32]) {
        if start != self.pending_start + self.pending_rows() {
            self.state.truncate(0);
            self.pending.clear();
            self.pending_start = start;
        }
        self.pending.extend_from_slice(rows);
        if self.cached() + self.pending_rows() > MTP_WINDOW {
            // Start over on the newest window: the head's attention sees
            // relative positions only.
            self.state.truncate(0);
            let drop = self.pending_rows().saturating_sub(MTP_WINDOW);
            self.pending.drain(..drop * self.hidden);
            self.pending_start += drop;
        }
    }

    /// Up to `k` greedy drafts after `history` (whose last token sits at
    /// the main state's next position, `history.len() - 1`): the pending
    /// rows run through the head (filling its cache), then each draft
    /// feeds the next step; the cache is cut back to the real rows after.
    pub(crate) fn draft(
        &mut self,
        model: &Transformer,
        experts: &mut dyn ExpertSource,
        history: &[u32],
        k: usize,
    ) -> Result<Vec<u32>, slipstream_models::ModelError> {
        let next_position = history.len() - 1;
        let rows = self.pending_rows();
        if k == 0 || rows == 0 || self.pending_start + rows != next_position {
            return Ok(Vec::new());
        }
        let tokens = &history[self.pending_start + 1..=next_position];
        let out = model.mtp_forward(
            0,
            &mut self.state,
            &self.pending,
            tokens,
            experts,
            Logits::Last,
        )?;
        self.pending.clear();
        self.pending_start = next_position;
        let real = self.cached();
        let mut drafts = vec![argmax(&out.logits)];
        let mut h = out.hidden[(rows - 1) * self.hidden..].to_vec();
        while drafts.len() < k {
            let last = *drafts.last().unwrap_or(&0);
            let step = model.mtp_forward(0, &mut self.state, &h, &[last], experts, Logits::Last)?;
            drafts.push(argmax(&step.logits));
            h = step.hidden;
        }
        self.state.truncate(real);
        Ok(drafts)
    }
}

/// Counters of speculative decoding over one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SpeculationStats {
    pub mode: SpeculateMode,
    pub draft_tokens: usize,
    /// Verify passes run.
    pub verify_passes: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// `accepted / drafted`.
    pub acceptance_rate: f64,
    /// Mean time of a one-token decode pass (ms), as the governor measured.
    pub plain_ms_per_token: f64,
    /// Mean time per token emitted by a verify step, drafting included (ms).
    pub speculative_ms_per_token: f64,
    /// Why the governor turned speculation off (the latest time), if it did.
    pub turned_off: Option<String>,
    /// Whether speculation was off when the generation ended.
    pub off_at_end: bool,
}

impl SpeculationStats {
    /// The stats line of `slipstream run`.
    pub fn line(&self) -> String {
        let mut s = format!(
            "[speculate] mode {} k {} | drafted {} accepted {} ({:.1} % acceptance) in {} verify passes | {:.2} ms/token speculating vs {:.2} ms/token plain",
            self.mode.name(),
            self.draft_tokens,
            self.drafted,
            self.accepted,
            100.0 * self.acceptance_rate,
            self.verify_passes,
            self.speculative_ms_per_token,
            self.plain_ms_per_token,
        );
        match (&self.turned_off, self.off_at_end) {
            (Some(why), true) => s.push_str(&format!(" | turned off: {why}")),
            (Some(why), false) => {
                s.push_str(&format!(" | was turned off ({why}), back on after a probe"))
            }
            (None, _) => s.push_str(" | stayed on"),
        }
        s
    }
}

/// Verify steps per governor decision.
const WINDOW: u64 = 8;
/// Verify steps after which a window already decides when no draft was
/// accepted or a token costs more than `EARLY_SLOWDOWN` times a plain
/// step (a verify pass that reads many more experts than it saves should
/// not run a whole window).
const EARLY: u64 = 2;
const EARLY_SLOWDOWN: f64 = 2.0;
/// Acceptance under which speculation stops (after a window).
const MIN_ACCEPTANCE: f64 = 0.1;
/// Plain steps before speculation is tried again after it stopped (doubles
/// after each failed probe, up to `MAX_PROBE_AFTER`).
const PROBE_AFTER: u64 = 32;
const MAX_PROBE_AFTER: u64 = 1024;
/// Plain steps timed at the start, before the first verify step.
const PLAIN_WARMUP: u64 = 2;

/// Decides, from measured times and acceptance, whether speculation runs.
pub(crate) struct Governor {
    auto_off: bool,
    pub(crate) stats: SpeculationStats,
    on: bool,
    plain_steps: u64,
    plain_s: f64,
    spec_s: f64,
    spec_emitted: u64,
    window_steps: u64,
    window_drafted: u64,
    window_accepted: u64,
    window_s: f64,
    window_emitted: u64,
    off_for: u64,
    probe_after: u64,
}

impl Governor {
    pub(crate) fn new(settings: &Speculation) -> Self {
        Governor {
            auto_off: settings.auto_off,
            stats: SpeculationStats {
                mode: settings.mode,
                draft_tokens: settings.draft_tokens,
                ..Default::default()
            },
            on: true,
            plain_steps: 0,
            plain_s: 0.0,
            spec_s: 0.0,
            spec_emitted: 0,
            window_steps: 0,
            window_drafted: 0,
            window_accepted: 0,
            window_s: 0.0,
            window_emitted: 0,
            off_for: 0,
            probe_after: PROBE_AFTER,
        }
    }

    /// Whether the next step may speculate.
    pub(crate) fn wants_drafts(&self) -> bool {
        self.on && (!self.auto_off || self.plain_steps >= PLAIN_WARMUP)
    }

    fn plain_mean(&self) -> f64 {
        if self.plain_steps > 0 {
            self.plain_s / self.plain_steps as f64
        } else {
            0.0
        }
    }

    /// A one-token decode pass took `took`.
    pub(crate) fn plain_step(&mut self, took: Duration) {
        self.plain_steps += 1;
        self.plain_s += took.as_secs_f64();
        if !self.on {
            self.off_for += 1;
            if self.off_for >= self.probe_after {
                self.on = true;
                self.off_for = 0;
                self.probe_after = (self.probe_after * 2).min(MAX_PROBE_AFTER);
            }
        }
    }

    /// A verify step of `drafted` drafts, `accepted` of them taken, that
    /// emitted `emitted` tokens in `took` (drafting included).
    pub(crate) fn verify_step(
        &mut self,
        drafted: usize,
        accepted: usize,
        emitted: usize,
        took: Duration,
    ) {
        let s = took.as_secs_f64();
        self.stats.verify_passes += 1;
        self.stats.drafted += drafted as u64;
        self.stats.accepted += accepted as u64;
        self.spec_s += s;
        self.spec_emitted += emitted as u64;
        self.window_steps += 1;
        self.window_drafted += drafted as u64;
        self.window_accepted += accepted as u64;
        self.window_s += s;
        self.window_emitted += emitted as u64;
        let acceptance = self.window_accepted as f64 / self.window_drafted.max(1) as f64;
        let per_token = self.window_s / self.window_emitted.max(1) as f64;
        let plain = self.plain_mean();
        let early = self.window_steps >= EARLY
            && (self.window_accepted == 0 || (plain > 0.0 && per_token > EARLY_SLOWDOWN * plain));
        if self.window_steps < WINDOW && !early {
            return;
        }
        let steps = self.window_steps;
        let why = if acceptance < MIN_ACCEPTANCE {
            Some(format!(
                "acceptance {:.1} % under {:.0} % over the last {steps} verify passes",
                100.0 * acceptance,
                100.0 * MIN_ACCEPTANCE
            ))
        } else if plain > 0.0 && per_token > plain {
            Some(format!(
                "{:.2} ms per token speculating against {:.2} ms plain over the last {steps} verify passes",
                per_token * 1e3,
                plain * 1e3
            ))
        } else {
            None
        };
        self.window_steps = 0;
        self.window_drafted = 0;
        self.window_accepted = 0;
        self.window_s = 0.0;
        self.window_emitted = 0;
        if let (Some(why), true) = (why, self.auto_off) {
            self.on = false;
            self.off_for = 0;
            self.stats.turned_off = Some(why);
        } else {
            // A probe that paid: the next stop waits the base interval.
            self.probe_after = PROBE_AFTER;
        }
    }

    /// The stats at the end of the generation.
    pub(crate) fn finish(mut self) -> SpeculationStats {
        let plain = self.plain_mean();
        let s = &mut self.stats;
        s.acceptance_rate = if s.drafted > 0 {
            s.accepted as f64 / s.drafted as f64
        } else {
            0.0
        };
        s.plain_ms_per_token = plain * 1e3;
        s.speculative_ms_per_token = if self.spec_emitted > 0 {
            self.spec_s / self.spec_emitted as f64 * 1e3
        } else {
            0.0
        };
        s.off_at_end = !self.on;
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_copies_what_followed_the_latest_match() {
        // "1 2 3 9 | 1 2 3 7 8 | 1 2 3" -> the latest "1 2 3" is followed by 7 8.
        let h = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(lookup_draft(&h, 2, 1, 3), vec![7, 8]);
        assert_eq!(lookup_draft(&h, 5, 1, 3), vec![7, 8, 1, 2, 3]);
        // Only a 1-gram matches: "5" followed by 6.
        assert_eq!(lookup_draft(&[5, 6, 4, 5], 3, 1, 3), vec![6, 4, 5]);
        assert!(lookup_draft(&[5, 6, 4, 5], 3, 2, 3).is_empty());
        assert!(lookup_draft(&[1, 2, 3], 3, 1, 3).is_empty());
        assert!(lookup_draft(&[], 3, 1, 3).is_empty());
    }

    /// A governor (turning off on its own) for `k` drafts of `mode`, past
    /// its warm-up of plain steps of 10 ms.
    fn warmed_up(mode: SpeculateMode, k: usize) -> Governor {
        let mut g = Governor::new(&Speculation {
            mode,
            draft_tokens: k,
            auto_off: true,
        });
        assert!(!g.wants_drafts(), "plain steps are timed first");
        for _ in 0..PLAIN_WARMUP {
            g.plain_step(Duration::from_millis(10));
        }
        assert!(g.wants_drafts());
        g
    }

    #[test]
    fn governor_turns_off_on_low_acceptance_and_probes_again() {
        let mut g = warmed_up(SpeculateMode::Lookup, 4);
        for _ in 0..WINDOW {
            g.verify_step(4, 0, 1, Duration::from_millis(12));
        }
        assert!(!g.wants_drafts());
        assert!(g
            .stats
            .turned_off
            .as_deref()
            .unwrap()
            .contains("acceptance"));
        for _ in 0..PROBE_AFTER {
            g.plain_step(Duration::from_millis(10));
        }
        assert!(g.wants_drafts(), "probes again");
        // Accepting everything but slower per token than plain: off again.
        for _ in 0..WINDOW {
            g.verify_step(4, 4, 5, Duration::from_millis(60));
        }
        assert!(!g.wants_drafts());
        assert!(g.stats.turned_off.as_deref().unwrap().contains("plain"));
        let s = g.finish();
        assert!(s.off_at_end);
        assert_eq!(s.drafted, 8 * WINDOW);
        assert_eq!(s.accepted, 4 * WINDOW);
    }

    #[test]
    fn governor_stops_early_when_a_verify_step_costs_far_more() {
        let mut g = warmed_up(SpeculateMode::Mtp, 2);
        g.verify_step(2, 2, 3, Duration::from_millis(90));
        assert!(g.wants_drafts(), "one step does not decide");
        g.verify_step(2, 2, 3, Duration::from_millis(90));
        assert!(!g.wants_drafts());
        let why = g.finish().turned_off.unwrap();
        assert!(why.contains("over the last 2 verify passes"), "{why}");
    }

    #[test]
    fn governor_keeps_speculation_that_pays() {
        let mut g = warmed_up(SpeculateMode::Lookup, 4);
        for _ in 0..3 * WINDOW {
            g.verify_step(4, 3, 4, Duration::from_millis(20));
        }
        assert!(g.wants_drafts());
        let s = g.finish();
        assert!(s.turned_off.is_none() && !s.off_at_end);
        assert!((s.acceptance_rate - 0.75).abs() < 1e-12);
    }
}
