//! A `StepHook` sees every step's logits after the penalties and before
//! the draw, its mask decides the token, and it learns each chosen token;
//! penalties change a greedy generation.

use std::sync::{Arc, Mutex};

use slipstream_engine::{GenerateRequest, Penalties, SamplingParams, StepHook, StoreChoice};
use slipstream_repack::QuantChoice;
use slipstream_testkit::{open, prompt, repacked};

/// Forbids the most likely token at every step; records what it saw.
struct ForbidTop {
    seen: Arc<Mutex<Vec<(u32, u32)>>>,
    forbidden: Option<u32>,
}

impl StepHook for ForbidTop {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let top = slipstream_engine::sampler::argmax(logits);
        logits[top as usize] = f32::NEG_INFINITY;
        self.forbidden = Some(top);
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        let f = self.forbidden.take().ok_or("accept without mask")?;
        self.seen.lock().unwrap().push((f, token));
        Ok(())
    }
}

struct Fails;

impl StepHook for Fails {
    fn mask(&mut self, _: &mut [f32]) -> Result<(), String> {
        Err("no way on".into())
    }

    fn accept(&mut self, _: u32) -> Result<(), String> {
        Ok(())
    }
}

fn request(penalties: Penalties) -> GenerateRequest {
    GenerateRequest::new(prompt(), 10)
        .with_sampling(SamplingParams {
            penalties,
            ..Default::default()
        })
        .keeping_logits()
}

#[test]
fn the_hook_masks_each_step_and_learns_the_token() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    let mut engine = open(&model, StoreChoice::Resident, 8);
    let greedy = engine
        .generate(&request(Penalties::default()), &mut |_| true)
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    engine.set_step_hook(Some(Box::new(ForbidTop {
        seen: seen.clone(),
        forbidden: None,
    })));
    let hooked = engine
        .generate(&request(Penalties::default()), &mut |_| true)
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), hooked.tokens.len());
    for ((forbidden, chosen), &t) in seen.iter().zip(&hooked.tokens) {
        assert_eq!(*chosen, t);
        assert_ne!(forbidden, chosen);
    }
    // The first step's top token is greedy's first token: forbidden.
    assert_eq!(seen[0].0, greedy.tokens[0]);
    assert_ne!(hooked.tokens[0], greedy.tokens[0]);
    // The model's own logits are kept unmasked.
    let vocab = engine.model_config().vocab_size;
    let first_step = &hooked.logits[(prompt().len() - 1) * vocab..prompt().len() * vocab];
    assert!(first_step.iter().all(|v| v.is_finite()));

    engine.set_step_hook(Some(Box::new(Fails)));
    let e = engine
        .generate(&request(Penalties::default()), &mut |_| true)
        .unwrap_err();
    assert!(e.to_string().contains("no way on"), "{e}");
    engine.set_step_hook(None);
    let again = engine
        .generate(&request(Penalties::default()), &mut |_| true)
        .unwrap();
    assert_eq!(again.tokens, greedy.tokens);

    let penalised = engine
        .generate(
            &request(Penalties {
                repetition: 5.0,
                presence: 2.0,
                frequency: 2.0,
            }),
            &mut |_| true,
        )
        .unwrap();
    assert_ne!(penalised.tokens, greedy.tokens);
    // Presence/frequency penalties this strong never repeat a token here.
    let mut distinct = penalised.tokens.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() >= penalised.tokens.len() - 1,
        "{:?}",
        penalised.tokens
    );
}
