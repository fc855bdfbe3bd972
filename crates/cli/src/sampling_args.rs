//! Sampling flags shared by `serve` and `run`. Each flag overrides the
//! checkpoint's `generation_config.json` (recorded at repack); for `serve`
//! a request's own value overrides the flag.

use clap::Args;
use slipstream_engine::{GenerationDefaults, Penalties, SamplingParams};

#[derive(Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy. Default: the model's
    /// generation_config.json, else 1 for `serve` (OpenAI's) and 0 for `run`.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens (0: off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Drop tokens below min-p times the most likely one's probability (0: off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// OpenAI's presence penalty, -2 to 2 (0: off).
    #[arg(long, allow_hyphen_values = true)]
    pub presence_penalty: Option<f32>,
    /// OpenAI's frequency penalty, -2 to 2 (0: off).
    #[arg(long, allow_hyphen_values = true)]
    pub frequency_penalty: Option<f32>,
    /// Hugging Face's repetition penalty over the prompt and the reply
    /// (1: off; above 1 discourages repeats).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
}

impl SamplingArgs {
    /// The flags given, as settings over the checkpoint's.
    pub fn overrides(&self) -> GenerationDefaults {
        GenerationDefaults {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        }
    }

    /// `run`'s settings: each flag, else the checkpoint's value, else
    /// greedy with nothing cut or penalised. Checked.
    pub fn resolve_for_run(
        &self,
        model: &GenerationDefaults,
        seed: u64,
    ) -> Result<SamplingParams, String> {
        let p = SamplingParams {
            temperature: self.temperature.or(model.temperature).unwrap_or(0.0),
            top_k: self.top_k.or(model.top_k).unwrap_or(0),
            top_p: self.top_p.or(model.top_p).unwrap_or(1.0),
            min_p: self.min_p.or(model.min_p).unwrap_or(0.0),
            seed,
            penalties: Penalties {
                presence: self
                    .presence_penalty
                    .or(model.presence_penalty)
                    .unwrap_or(0.0),
                frequency: self
                    .frequency_penalty
                    .or(model.frequency_penalty)
                    .unwrap_or(0.0),
                repetition: self
                    .repetition_penalty
                    .or(model.repetition_penalty)
                    .unwrap_or(1.0),
            },
        };
        p.check()?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_over_checkpoint_over_greedy() {
        let model = GenerationDefaults {
            temperature: Some(0.6),
            top_k: Some(20),
            repetition_penalty: Some(1.05),
            ..Default::default()
        };
        let args = SamplingArgs {
            temperature: Some(0.2),
            presence_penalty: Some(-0.5),
            ..Default::default()
        };
        let p = args.resolve_for_run(&model, 3).unwrap();
        assert_eq!(p.temperature, 0.2);
        assert_eq!(p.top_k, 20);
        assert_eq!(p.penalties.repetition, 1.05);
        assert_eq!(p.penalties.presence, -0.5);
        let p = SamplingArgs::default()
            .resolve_for_run(&GenerationDefaults::default(), 0)
            .unwrap();
        assert_eq!(p, SamplingParams::default());
        let bad = SamplingArgs {
            repetition_penalty: Some(0.0),
            ..Default::default()
        };
        assert!(bad.resolve_for_run(&model, 0).is_err());
    }
}
