//! Per-sequence decode state.

/// Keys and values of one full-attention layer, post-norm and post-RoPE.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnState {
    /// `[tokens, kv_heads * head_dim]`
    pub k: Vec<f32>,
    /// `[tokens, kv_heads * head_dim]`
    pub v: Vec<f32>,
    pub kv_dim: usize,
}

impl AttnState {
    pub fn new(kv_dim: usize) -> Self {
        AttnState {
            k: Vec::new(),
            v: Vec::new(),
            kv_dim,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.k.len() / self.kv_dim
    }

    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }

    /// Appends `n` tokens' keys and values (`[n, kv_dim]` each).
    pub fn append(&mut self, k: &[f32], v: &[f32], n: usize) {
        debug_assert_eq!(k.len(), n * self.kv_dim);
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
    }
}

/// Conv and recurrent state of one Gated DeltaNet layer; fixed size.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearState {
    /// Last `kernel - 1` pre-conv qkv rows, oldest first: `[kernel-1, conv_dim]`.
    pub conv: Vec<f32>,
    /// `[value_heads, key_dim, value_dim]`
    pub recurrent: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LayerState {
    Attn(AttnState),
    Linear(LinearState),
}

/// Everything a model carries from one token to the next.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelState {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far; the next token's position is `tokens.len()`.
    pub tokens: Vec<u32>,
    /// Logits after the last consumed token (`[vocab]`), empty before any.
    pub last_logits: Vec<f32>,
}

impl ModelState {
    pub fn position(&self) -> usize {
        self.tokens.len()
    }

    /// Bytes of state held (KV grows with tokens; linear state is fixed).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attn(a) => (a.k.len() + a.v.len()) * 4,
                LayerState::Linear(s) => (s.conv.len() + s.recurrent.len()) * 4,
            })
            .sum::<usize>()
            + (self.tokens.len() + self.last_logits.len()) * 4
    }
}
