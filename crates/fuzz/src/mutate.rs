//! A small deterministic mutator: the input is a committed fixture (or one
//! written from it), changed by a few of the edits that break readers:
//! bit flips, boundary bytes and integers, truncation, deleted, repeated
//! and spliced runs, and for text, boundary numbers and broken tokens.

/// The engine's SplitMix64 generator (the same sequence for the same seed)
/// with the draws the mutator needs.
#[derive(Debug, Clone)]
pub struct Rng(slipstream_engine::sampler::Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(slipstream_engine::sampler::Rng::new(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

/// Integers at the edges of what readers count with.
const BOUNDARY_INTS: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 40,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
];

/// Numbers and tokens at the edges of what JSON readers accept.
const BOUNDARY_TEXT: [&str; 14] = [
    "0",
    "-1",
    "1e309",
    "-1e309",
    "NaN",
    "18446744073709551615",
    "18446744073709551616",
    "1099511627776",
    "4294967296",
    "0.0",
    "null",
    "\"\"",
    "[]",
    "{}",
];

/// Where an edit lands: mostly in the first `focus` bytes (headers and
/// metadata, where the parsing happens), sometimes anywhere.
fn position(rng: &mut Rng, len: usize, focus: usize) -> usize {
    if len == 0 {
        return 0;
    }
    if rng.chance(4) {
        rng.below(len)
    } else {
        rng.below(len.min(focus.max(1)))
    }
}

/// Applies 1 to 4 edits to `input`; `other` is another seed to splice from.
pub fn mutate(rng: &mut Rng, input: &mut Vec<u8>, other: &[u8], text: bool, focus: usize) {
    let edits = 1 + rng.below(4);
    for _ in 0..edits {
        let len = input.len();
        let at = position(rng, len, focus);
        match rng.below(if text { 11 } else { 9 }) {
            0 if len > 0 => input[at.min(len - 1)] ^= 1 << rng.below(8),
            1 if len > 0 => {
                input[at.min(len - 1)] = [0u8, 0xff, 0x7f, 0x80, b'"', b'\\'][rng.below(6)]
            }
            2 => {
                // A boundary integer, little-endian, 4 or 8 bytes.
                let v = BOUNDARY_INTS[rng.below(BOUNDARY_INTS.len())];
                let width = if rng.chance(2) { 4 } else { 8 };
                let bytes = &v.to_le_bytes()[..width];
                let end = (at + width).min(len);
                input[at.min(end)..end].copy_from_slice(&bytes[..end - at.min(end)]);
            }
            3 => input.truncate(at),
            4 if len > 0 => {
                let n = 1 + rng.below(64.min(len - at.min(len - 1)));
                let at = at.min(len - 1);
                input.drain(at..(at + n).min(len));
            }
            5 if len > 0 => {
                // Repeat a run (grows counts, lists, nesting).
                let at = at.min(len - 1);
                let n = 1 + rng.below(32.min(len - at));
                let run = input[at..at + n].to_vec();
                for _ in 0..1 + rng.below(8) {
                    input.splice(at..at, run.iter().copied());
                }
            }
            6 if !other.is_empty() => {
                let from = rng.below(other.len());
                let n = 1 + rng.below(256.min(other.len() - from));
                let end = (at + n).min(len);
                input.splice(at..end, other[from..from + n].iter().copied());
            }
            7 => {
                let n = 1 + rng.below(16);
                let junk: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                input.splice(at..at, junk);
            }
            8 if len > 0 => {
                // Swap two bytes.
                let b = rng.below(len);
                input.swap(at.min(len - 1), b);
            }
            9 => {
                // Replace a number (or the token at `at`) with a boundary one.
                let s = BOUNDARY_TEXT[rng.below(BOUNDARY_TEXT.len())].as_bytes();
                let start = (0..=at.min(len))
                    .rev()
                    .take(24)
                    .find(|&i| i == 0 || !is_token_byte(input[i - 1]))
                    .unwrap_or(at.min(len));
                let end = (start..len)
                    .find(|&i| !is_token_byte(input[i]))
                    .unwrap_or(len);
                input.splice(start..end, s.iter().copied());
            }
            10 => {
                // Deep nesting.
                let open = if rng.chance(2) { b'[' } else { b'{' };
                let n = 1 + rng.below(2000);
                input.splice(at..at, std::iter::repeat_n(open, n));
            }
            _ => {}
        }
    }
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+' | b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_mutants() {
        let seed = b"{\"layers\": 40, \"name\": \"x\"}".to_vec();
        let run = |s: u64| {
            let mut rng = Rng::new(s);
            (0..200)
                .map(|_| {
                    let mut m = seed.clone();
                    mutate(&mut rng, &mut m, b"other bytes", true, 64);
                    m
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        // Mutants differ from the seed most of the time.
        assert!(run(7).iter().filter(|m| **m != seed).count() > 150);
    }
}
