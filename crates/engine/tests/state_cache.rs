//! The state cache through the engine: an agent-shaped conversation (turns
//! whose earlier replies the template re-renders, side requests in between)
//! reuses what it shares, and every output equals a fresh run of the same
//! prompt bit for bit, at checkpoints inside prefill chunks and on their
//! boundaries, on a hybrid (Gated DeltaNet) and a pure-attention model.

use std::path::Path;

use slipstream_engine::{Engine, GenerateRequest, Generation, StateCache};
use slipstream_repack::QuantChoice;
use slipstream_testkit::{open, prompt, repacked, same_bits, sampled, streaming};

fn engine(model: &Path, chunk: usize) -> Engine {
    open(model, streaming(4), chunk)
}

/// The sampled request every run here makes.
fn request(prompt: Vec<u32>) -> GenerateRequest {
    sampled(prompt, 6, 11)
}

/// Runs `prompt` through the cache and checks it against a fresh run:
/// same tokens, same logits rows from the first prefilled token on.
fn turn(e: &mut Engine, cache: &mut StateCache, model: &Path, prompt: &[u32]) -> Generation {
    let restored = cache.restore(prompt, e.new_state());
    let g = e
        .generate_cached(cache, restored, &request(prompt.to_vec()), &mut |_| true)
        .unwrap();
    let fresh = engine(model, 4096)
        .generate(&request(prompt.to_vec()), &mut |_| true)
        .unwrap();
    let vocab = e.model_config().vocab_size;
    assert_eq!(
        g.tokens, fresh.tokens,
        "tokens after reusing {}",
        g.stats.reused_prompt_tokens
    );
    assert!(
        same_bits(
            &g.logits,
            &fresh.logits[g.stats.reused_prompt_tokens * vocab..]
        ),
        "logits after reusing {}",
        g.stats.reused_prompt_tokens
    );
    g
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 11 + salt * 101) % 500)
        .collect()
}

#[test]
fn an_agent_conversation_reuses_what_it_shares_and_matches_fresh_runs() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, quant, hybrid) in [
        ("qwen3_5_moe_fused", QuantChoice::Q4, true),
        ("qwen3_moe", QuantChoice::F32, false),
    ] {
        let model = repacked(name, quant, tmp.path());
        // Chunks of 5, checkpoints every 4 (inside chunks) and every 5 (on
        // chunk boundaries).
        for interval in [4, 5] {
            let mut e = engine(&model, 5);
            let mut cache = StateCache::new(1 << 30, interval);
            let turn1 = prompt();
            let g1 = turn(&mut e, &mut cache, &model, &turn1);
            assert_eq!(g1.stats.reused_prompt_tokens, 0);

            // A side request sharing the first 11 tokens (a title request).
            let mut side = turn1[..11].to_vec();
            side.extend(tokens(6, 1));
            let g = turn(&mut e, &mut cache, &model, &side);
            let want = if hybrid { 11 / interval * interval } else { 11 };
            assert_eq!(
                g.stats.reused_prompt_tokens, want,
                "{name} side, every {interval}"
            );

            // Turn 2: the template re-renders turn 1's reply differently
            // (drops its reasoning): the prompt diverges where the reply
            // began, so the checkpoint at the end of turn 1's prompt serves.
            let mut turn2 = turn1.clone();
            turn2.extend(tokens(3, 2));
            turn2.extend(tokens(7, 3));
            let g2 = turn(&mut e, &mut cache, &model, &turn2);
            assert_eq!(
                g2.stats.reused_prompt_tokens, 23,
                "{name} turn 2, every {interval}"
            );

            // Turn 3 repeats turn 2's reply exactly: all of turn 2 is reused.
            let mut turn3 = turn2.clone();
            turn3.extend(&g2.tokens);
            turn3.extend(tokens(4, 4));
            let g3 = turn(&mut e, &mut cache, &model, &turn3);
            assert_eq!(
                g3.stats.reused_prompt_tokens,
                turn2.len() + g2.tokens.len() - 1,
                "{name} turn 3, every {interval}"
            );
            // The side request's entry is still there for its next turn.
            let mut side2 = side.clone();
            side2.push(7);
            let restored = cache.restore(&side2, e.new_state());
            assert!(restored.state.tokens.len() >= side.len() - 1, "{name}");
        }
    }
}

/// A checkpoint where the request asks (`checkpoint_at`: the end of the
/// conversation before the template's opening of the reply): the next
/// prompt, which re-renders that opening differently (as Qwen3.x
/// templates do to an earlier reply's reasoning), resumes there instead
/// of at the last interval multiple before it, and still matches a fresh
/// run bit for bit.
#[test]
fn a_checkpoint_before_the_reply_opening_is_where_the_next_turn_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let history = tokens(23, 2);
    let opening = [1u32, 7, 9];
    let mut turn1 = history.clone();
    turn1.extend(opening);
    // The next prompt: the same history, the earlier reply rendered
    // without the opening's last tokens, then a new message.
    let mut turn2 = history.clone();
    turn2.extend([1u32, 8]);
    turn2.extend(tokens(5, 3));
    for (at, want) in [(None, 20), (Some(history.len()), history.len())] {
        let mut e = engine(&model, 6);
        let mut cache = StateCache::new(1 << 30, 10);
        let restored = cache.restore(&turn1, e.new_state());
        let req = GenerateRequest {
            checkpoint_at: at,
            ..request(turn1.clone())
        };
        e.generate_cached(&mut cache, restored, &req, &mut |_| true)
            .unwrap();
        let g = turn(&mut e, &mut cache, &model, &turn2);
        assert_eq!(
            g.stats.reused_prompt_tokens, want,
            "checkpoint_at {at:?}: resumed at the wrong place"
        );
    }
}
