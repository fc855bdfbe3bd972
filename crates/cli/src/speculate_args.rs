//! The speculative-decoding flags `run` and `serve` share.

use clap::Args;
use slipstream_engine::{SpeculateMode, Speculation, DEFAULT_DRAFT_TOKENS};

#[derive(Args, Debug, Clone, Default)]
pub struct SpeculateArgs {
    /// Speculative decoding (CPU and CUDA backends): off, mtp (the model's MTP
    /// head), lookup (n-grams of the prompt and the text so far) or both.
    /// The output is the same as without it. Default off.
    #[arg(long, value_name = "MODE", value_parser = |s: &str| s.parse::<SpeculateMode>())]
    pub speculate: Option<SpeculateMode>,
    /// Draft tokens per verify pass with --speculate (default 4, from
    /// docs/BENCHMARKS.md).
    #[arg(long, value_name = "K")]
    pub draft_tokens: Option<usize>,
    /// Keep speculating where it does not pay (by default it turns itself
    /// off on low acceptance or when slower than plain decoding).
    #[arg(long)]
    pub speculate_always: bool,
}

impl SpeculateArgs {
    /// The settings these flags ask for (off without `--speculate`).
    pub fn settings(&self) -> Speculation {
        match self.speculate {
            None => Speculation::default(),
            Some(mode) => Speculation {
                mode,
                draft_tokens: self.draft_tokens.unwrap_or(DEFAULT_DRAFT_TOKENS),
                auto_off: !self.speculate_always,
            },
        }
    }
}
