use super::*;

/// A state of one attention layer (kv_dim 2) and one linear layer, whose
/// values encode the tokens so a wrong cut or copy shows.
fn state_of(tokens: &[u32]) -> ModelState {
    let mut attn = AttnState::new(2);
    for &t in tokens {
        attn.append(&[t as f32, 0.5], &[t as f32, -0.5], 1);
    }
    let sum: f32 = tokens.iter().map(|&t| t as f32).sum();
    ModelState {
        layers: vec![
            LayerState::Attn(attn),
            LayerState::Linear(LinearState {
                conv: vec![sum; 3],
                recurrent: vec![tokens.len() as f32; 4],
            }),
        ],
        tokens: tokens.to_vec(),
        last_logits: vec![sum, 1.0],
    }
}

/// A state before any token.
fn fresh() -> ModelState {
    let mut s = state_of(&[]);
    s.last_logits.clear();
    s
}

/// Checkpoints of `tokens` at each of `at`, as a prefill would take them.
fn checkpoints(tokens: &[u32], at: &[usize]) -> Vec<Arc<Checkpoint>> {
    at.iter()
        .map(|&p| Arc::new(Checkpoint::of(&state_of(&tokens[..p])).unwrap()))
        .collect()
}

fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

#[test]
fn a_prompt_extending_the_entry_takes_its_state_whole() {
    let mut c = StateCache::new(1 << 20, 4);
    let conv = toks(0..10);
    c.insert(state_of(&conv), checkpoints(&conv, &[4, 8]), 8, vec![]);
    let mut prompt = conv.clone();
    prompt.extend([50, 51]);
    let r = c.restore(&prompt, fresh());
    assert_eq!(r.state, state_of(&conv));
    assert_eq!(r.checkpoints.len(), 2);
    assert_eq!(c.stats().entries, 0, "moved out, not copied");
}

#[test]
fn divergence_in_the_last_reply_resumes_at_the_prompt_end_in_place() {
    let mut c = StateCache::new(1 << 20, 4);
    // Prompt 0..7, reply 7..10 (the template will drop part of it).
    let conv = toks(0..10);
    c.insert(
        state_of(&conv),
        checkpoints(&conv, &[4, 7]),
        7,
        vec![vec![3]],
    );
    let mut prompt = toks(0..8);
    prompt.extend([99, 98]);
    let r = c.restore(&prompt, fresh());
    assert_eq!(r.state, state_of(&conv[..7]));
    assert_eq!(r.resident, Some(vec![vec![3]]));
    assert_eq!(c.stats().entries, 0, "a dead branch is cut in place");
}

#[test]
fn a_side_request_copies_the_shared_prefix_and_leaves_the_entry() {
    let mut c = StateCache::new(1 << 20, 4);
    let conv = toks(0..20);
    c.insert(
        state_of(&conv),
        checkpoints(&conv, &[4, 8, 12, 16]),
        16,
        vec![],
    );
    let mut side = toks(0..10);
    side.push(77);
    let r = c.restore(&side, fresh());
    assert_eq!(r.state, state_of(&conv[..8]));
    assert_eq!(
        r.checkpoints.iter().map(|c| c.position).collect::<Vec<_>>(),
        vec![4, 8]
    );
    assert_eq!(c.stats().entries, 1);
    // The main conversation is still there, whole.
    let mut next = conv.clone();
    next.push(5);
    assert_eq!(c.restore(&next, fresh()).state, state_of(&conv));
}

#[test]
fn nothing_shared_gives_the_fresh_state() {
    let mut c = StateCache::new(1 << 20, 4);
    let conv = toks(0..10);
    c.insert(state_of(&conv), checkpoints(&conv, &[4, 8]), 8, vec![]);
    let r = c.restore(&[3, 2, 1], fresh());
    assert!(r.state.tokens.is_empty() && r.checkpoints.is_empty());
    // Shared, but before the first checkpoint: nothing to resume from.
    let r = c.restore(&[0, 1, 2, 9], fresh());
    assert!(r.state.tokens.is_empty());
}

#[test]
fn an_extending_insert_replaces_its_prefix_entry_and_keeps_its_checkpoints() {
    let mut c = StateCache::new(1 << 20, 4);
    let a = toks(0..10);
    c.insert(state_of(&a), checkpoints(&a, &[4, 8]), 8, vec![]);
    let b = toks(0..16);
    c.insert(state_of(&b), checkpoints(&b, &[12]), 14, vec![]);
    let s = c.stats();
    assert_eq!((s.entries, s.checkpoints), (1, 3));
}

#[test]
fn shared_checkpoints_are_counted_once_and_eviction_spares_the_main_conversation() {
    let main = toks(0..400);
    let cps = checkpoints(&main, &[100, 200, 300]);
    let mut c = StateCache::new(usize::MAX, 100);
    c.insert(state_of(&main), cps.clone(), 300, vec![]);
    let one = c.stats().bytes;
    // A side request shares the first 100 tokens (and that checkpoint).
    let mut side = toks(0..150);
    side.push(1000);
    let r = c.restore(&side, fresh());
    assert_eq!(r.state.tokens.len(), 100);
    let mut side_state = state_of(&side);
    side_state.tokens = side.clone();
    c.insert(side_state, r.checkpoints, side.len(), vec![]);
    let two = c.stats();
    assert_eq!(two.entries, 2);
    assert_eq!(two.checkpoints, 3, "the shared checkpoint counts once");
    assert!(two.bytes > one);
    // Room for one: the small, recent side request goes first.
    c.max_bytes = one + 1;
    c.evict();
    let mut next = main.clone();
    next.push(1);
    assert_eq!(c.restore(&next, fresh()).state.tokens.len(), 400);
}

#[test]
fn interval_rule_is_bounded() {
    assert_eq!(default_checkpoint_interval(1000, 4000), 256);
    // 35B-shaped: ~62 MB of linear state + 1 MB logits, 40 KB KV per token.
    assert_eq!(default_checkpoint_interval(63_000_000, 40_960), 1792);
    assert_eq!(default_checkpoint_interval(usize::MAX / 2, 1), 8192);
    assert_eq!(default_checkpoint_interval(1000, 0), 1024);
}
