//! Sampling settings of a request, each resolved in order: the request's
//! own value, else the server's flag (`serve --temperature` ...), else the
//! checkpoint's `generation_config.json` (recorded in the manifest at
//! repack), else the API's default (OpenAI: temperature 1, top-p 1;
//! Anthropic: the same; no top-k, min-p or penalties).

use serde::Deserialize;
use slipstream_engine::{GenerationDefaults, Penalties, SamplingParams};

use crate::error::{ApiError, Flavor};

/// The sampling fields a request set (`None`: not sent). The OpenAI
/// requests take all of them by these names (flattened into the request).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RequestSampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Hugging Face's (vLLM's extension to OpenAI).
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
}

/// The API's default when neither the request, the flags nor the
/// checkpoint set a value.
const DEFAULT_TEMPERATURE: f32 = 1.0;

/// Resolves `req` over `flags` over `model` over the API's defaults and
/// checks each value's range; a bad value is a 400 naming the request's
/// field (a bad flag or checkpoint value names where it came from).
pub fn resolve(
    flavor: Flavor,
    req: &RequestSampling,
    flags: &GenerationDefaults,
    model: &GenerationDefaults,
) -> Result<SamplingParams, ApiError> {
    // Which source gave a value, for the error's wording.
    fn pick<T: Copy>(r: Option<T>, f: Option<T>, m: Option<T>) -> Option<(T, &'static str)> {
        r.map(|v| (v, "request"))
            .or(f.map(|v| (v, "flag")))
            .or(m.map(|v| (v, "generation_config")))
    }
    let check = |field: &str,
                 v: Option<(f32, &'static str)>,
                 ok: fn(f32) -> bool,
                 range: &str|
     -> Result<Option<f32>, ApiError> {
        match v {
            None => Ok(None),
            Some((x, _)) if x.is_finite() && ok(x) => Ok(Some(x)),
            Some((x, from)) => {
                let whose = match from {
                    "request" => String::new(),
                    "flag" => " (from the server's flag)".into(),
                    _ => " (from the model's generation_config)".into(),
                };
                Err(ApiError::bad_request(
                    flavor,
                    format!("{field} must be {range}, got {x}{whose}"),
                )
                .param(field))
            }
        }
    };
    let temperature = check(
        "temperature",
        pick(req.temperature, flags.temperature, model.temperature),
        |x| (0.0..=2.0).contains(&x),
        "between 0 and 2",
    )?
    .unwrap_or(DEFAULT_TEMPERATURE);
    let top_p = check(
        "top_p",
        pick(req.top_p, flags.top_p, model.top_p),
        |x| x > 0.0 && x <= 1.0,
        "in (0, 1]",
    )?
    .unwrap_or(1.0);
    let min_p = check(
        "min_p",
        pick(req.min_p, flags.min_p, model.min_p),
        |x| (0.0..=1.0).contains(&x),
        "in [0, 1]",
    )?
    .unwrap_or(0.0);
    let presence = check(
        "presence_penalty",
        pick(
            req.presence_penalty,
            flags.presence_penalty,
            model.presence_penalty,
        ),
        |x| (-2.0..=2.0).contains(&x),
        "between -2 and 2",
    )?
    .unwrap_or(0.0);
    let frequency = check(
        "frequency_penalty",
        pick(
            req.frequency_penalty,
            flags.frequency_penalty,
            model.frequency_penalty,
        ),
        |x| (-2.0..=2.0).contains(&x),
        "between -2 and 2",
    )?
    .unwrap_or(0.0);
    let repetition = check(
        "repetition_penalty",
        pick(
            req.repetition_penalty,
            flags.repetition_penalty,
            model.repetition_penalty,
        ),
        |x| x > 0.0 && x <= 10.0,
        "in (0, 10]",
    )?
    .unwrap_or(1.0);
    let top_k = req.top_k.or(flags.top_k).or(model.top_k).unwrap_or(0);
    let seed = match req.seed {
        Some(s) => s as u64,
        None => {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(crate::openai::now());
            h.finish()
        }
    };
    Ok(SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        penalties: Penalties {
            presence,
            frequency,
            repetition,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults(t: Option<f32>, rep: Option<f32>, top_k: Option<usize>) -> GenerationDefaults {
        GenerationDefaults {
            temperature: t,
            repetition_penalty: rep,
            top_k,
            ..Default::default()
        }
    }

    #[test]
    fn request_over_flag_over_checkpoint_over_api_default() {
        let model = GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            min_p: Some(0.0),
            presence_penalty: Some(1.5),
            ..Default::default()
        };
        let flags = defaults(Some(0.3), Some(1.1), None);
        let req = RequestSampling {
            temperature: Some(0.9),
            seed: Some(4),
            ..Default::default()
        };
        let p = resolve(Flavor::OpenAi, &req, &flags, &model).unwrap();
        assert_eq!(p.temperature, 0.9, "request wins");
        assert_eq!(p.penalties.repetition, 1.1, "flag over nothing");
        assert_eq!(p.top_k, 20, "checkpoint");
        assert_eq!(p.top_p, 0.95);
        assert_eq!(p.penalties.presence, 1.5);
        assert_eq!(p.seed, 4);
        let p = resolve(Flavor::OpenAi, &RequestSampling::default(), &flags, &model).unwrap();
        assert_eq!(p.temperature, 0.3, "flag over checkpoint");
        let none = GenerationDefaults::default();
        let p = resolve(Flavor::OpenAi, &RequestSampling::default(), &none, &none).unwrap();
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p),
            (1.0, 1.0, 0, 0.0)
        );
        assert_eq!(p.penalties, Penalties::default());
    }

    #[test]
    fn out_of_range_values_are_refused_by_name() {
        let none = GenerationDefaults::default();
        for (req, field) in [
            (
                RequestSampling {
                    temperature: Some(3.0),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                RequestSampling {
                    presence_penalty: Some(2.5),
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                RequestSampling {
                    frequency_penalty: Some(f32::NAN),
                    ..Default::default()
                },
                "frequency_penalty",
            ),
            (
                RequestSampling {
                    repetition_penalty: Some(0.0),
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                RequestSampling {
                    top_p: Some(0.0),
                    ..Default::default()
                },
                "top_p",
            ),
        ] {
            let e = resolve(Flavor::OpenAi, &req, &none, &none).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{req:?}");
        }
        // A bad checkpoint value says where it came from.
        let model = defaults(Some(5.0), None, None);
        let e = resolve(Flavor::OpenAi, &RequestSampling::default(), &none, &model).unwrap_err();
        assert!(e.message.contains("generation_config"), "{}", e.message);
    }
}
