//! [`CudaTuning`]: every tuning switch of the CUDA backend in one value,
//! built by the caller (the CLI reads them from `SLIPSTREAM_CUDA_*`
//! environment variables through [`CudaTuning::from_vars`]) and passed
//! down; nothing in this crate reads the environment. The defaults are
//! the measured best; the others exist for measuring and for the device
//! test's bit-identity checks (scripts/cuda_device_test.sh).

use crate::MOE_MIN_BLOCKS;

/// The most tokens of a pass with device routing (prefill); the scratch
/// buffers are sized for it.
pub const PASS_TOKENS: usize = 256;

/// The tokens of a prefill pass by default (`SLIPSTREAM_CUDA_PASS_TOKENS`
/// picks 1..=[`PASS_TOKENS`]).
pub const DEFAULT_PASS_TOKENS: usize = 256;

/// Tuning of the CUDA backend. Each field names the variable
/// [`CudaTuning::from_vars`] reads it from; [`Default`] is what no
/// variable gives.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CudaTuning {
    /// Register cap of the routed experts' wide kernels, in blocks of 256
    /// threads per SM (`SLIPSTREAM_CUDA_MOE_MINB`, default
    /// [`MOE_MIN_BLOCKS`]; the kernels clamp it to 1..=8).
    pub moe_min_blocks: u32,
    /// The warp-pair down kernel and half-height gate/up blocks
    /// (`A4V_SPLIT` in the kernels; `SLIPSTREAM_CUDA_A4V_SPLIT=0` off).
    pub a4v_split: bool,
    /// [`crate::Gpu::moe_experts`] may take the fused experts kernel
    /// (`SLIPSTREAM_CUDA_FUSED=1`; off by default: it measured slower than
    /// the two launches on the H200, see docs/BENCHMARKS.md).
    pub fused_experts: bool,
    /// [`crate::Gpu::tensor_cores`] as a [`crate::Gpu`] opens
    /// (`SLIPSTREAM_CUDA_TC` exactly `1`): the kernel tests' and the
    /// bench's setting; [`crate::CudaModel`] sets it per pass from
    /// [`CudaTuning::tensor_core_passes`].
    pub gpu_tensor_cores: bool,
    /// Which of [`crate::CudaModel`]'s passes run the tensor-core 4-bit
    /// kernels (`SLIPSTREAM_CUDA_TC`: `0`, `prompt`, `1`; the same variable
    /// as [`CudaTuning::gpu_tensor_cores`], read as [`TensorCoreUse::parse`]).
    pub tensor_core_passes: TensorCoreUse,
    /// Programmatic dependent launch where the GPU has it (sm_90+;
    /// `SLIPSTREAM_CUDA_PDL=0` off). The same bits either way.
    pub pdl: bool,
    /// Tokens per mma of the tensor-core prefill forms (`TC_TPM` in the
    /// kernels): 2, or 1 with `SLIPSTREAM_CUDA_TC_TPM=1` (the one-token
    /// kernels' B layout).
    pub tc_tokens_per_mma: usize,
    /// Whether the prompt's attention may run on tensor cores
    /// ([`crate::Gpu::attention_prompt`]; `SLIPSTREAM_CUDA_TC_ATTN=0` off,
    /// for measuring: the prompt's attention then runs the decode kernels).
    pub prompt_attn_tc: bool,
    /// The Gated DeltaNet recurrence kernel for heads up to 128 x 128
    /// (`SLIPSTREAM_CUDA_GDN`, [`GdnForm::parse`]).
    pub gdn_form: GdnForm,
    /// The router kernel publishes the routing decision into mapped host
    /// memory that the host polls (`SLIPSTREAM_CUDA_ROUTE_MAPPED=0`: a copy
    /// and an event instead).
    pub route_mapped: bool,
    /// With every expert in VRAM, routing stays on the device
    /// (`SLIPSTREAM_CUDA_DEVICE_ROUTING=0` keeps the host round trip).
    pub device_routing: bool,
    /// With device routing, each pass's layers run as one CUDA graph
    /// (`SLIPSTREAM_CUDA_GRAPH=0` off).
    pub graphs: bool,
    /// The most tokens of a prefill pass with device routing
    /// (`SLIPSTREAM_CUDA_PASS_TOKENS`, 1..=[`PASS_TOKENS`], default
    /// [`DEFAULT_PASS_TOKENS`]).
    pub pass_tokens: usize,
    /// The arithmetic of the prompt's 4-bit products on tensor cores (the
    /// CLI's `--prompt-precision`; no variable).
    pub prompt_precision: PromptPrecision,
}

impl Default for CudaTuning {
    fn default() -> CudaTuning {
        CudaTuning {
            moe_min_blocks: MOE_MIN_BLOCKS,
            a4v_split: true,
            fused_experts: false,
            gpu_tensor_cores: false,
            tensor_core_passes: TensorCoreUse::Prompt,
            pdl: true,
            tc_tokens_per_mma: 2,
            prompt_attn_tc: true,
            gdn_form: GdnForm::Warp,
            route_mapped: true,
            device_routing: true,
            graphs: true,
            pass_tokens: DEFAULT_PASS_TOKENS,
            prompt_precision: PromptPrecision::Exact,
        }
    }
}

impl CudaTuning {
    /// Reads each setting from `var(name)` (`None`: unset), names and
    /// meanings as documented on the fields: a switch that is on by default
    /// goes off only at exactly `0`, one that is off goes on only at exactly
    /// `1`; a number that does not parse keeps the default.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> CudaTuning {
        let is = |name: &str, v: &str| var(name).is_some_and(|x| x == v);
        let d = CudaTuning::default();
        let tc = var("SLIPSTREAM_CUDA_TC");
        CudaTuning {
            moe_min_blocks: var("SLIPSTREAM_CUDA_MOE_MINB")
                .and_then(|v| v.parse().ok())
                .unwrap_or(d.moe_min_blocks),
            a4v_split: !is("SLIPSTREAM_CUDA_A4V_SPLIT", "0"),
            fused_experts: is("SLIPSTREAM_CUDA_FUSED", "1"),
            gpu_tensor_cores: tc.as_deref() == Some("1"),
            tensor_core_passes: TensorCoreUse::parse(tc.as_deref()),
            pdl: !is("SLIPSTREAM_CUDA_PDL", "0"),
            tc_tokens_per_mma: if is("SLIPSTREAM_CUDA_TC_TPM", "1") {
                1
            } else {
                2
            },
            prompt_attn_tc: !is("SLIPSTREAM_CUDA_TC_ATTN", "0"),
            gdn_form: GdnForm::parse(var("SLIPSTREAM_CUDA_GDN").as_deref()),
            route_mapped: !is("SLIPSTREAM_CUDA_ROUTE_MAPPED", "0"),
            device_routing: !is("SLIPSTREAM_CUDA_DEVICE_ROUTING", "0"),
            graphs: !is("SLIPSTREAM_CUDA_GRAPH", "0"),
            pass_tokens: var("SLIPSTREAM_CUDA_PASS_TOKENS")
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(d.pass_tokens)
                .clamp(1, PASS_TOKENS),
            prompt_precision: d.prompt_precision,
        }
    }
}

/// How the prompt's passes compute their affine 4-bit products where they
/// run on tensor cores ([`TensorCoreUse`]). Generated tokens always take
/// the exact kernels; either way a token's bits follow only from whether
/// it is a prompt token, so every pass length and slot count gives the
/// same logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptPrecision {
    /// Each input row quantized to int8 per group of 64 (scale: the
    /// group's largest |x| / 127) into int8 mma with the 4-bit codes as
    /// stored, as llama.cpp's MMQ path does. The prompt's logits differ
    /// from the exact forms' by the rounding of x (the device test states
    /// the bound). Opt-in until it has run on a GPU (docs/CUDA.md).
    Int8,
    /// x split into three bf16 parts (f32 to its last bit) against the
    /// codes in bf16 mma: logits within f32 rounding of the CUDA-core
    /// kernels (the default).
    Exact,
}

impl PromptPrecision {
    /// The name the CLI takes and the stats report: `int8` or `exact`.
    pub fn name(self) -> &'static str {
        match self {
            PromptPrecision::Int8 => "int8",
            PromptPrecision::Exact => "exact",
        }
    }
}

/// Which passes run the tensor-core 4-bit kernels where they apply
/// (`SLIPSTREAM_CUDA_TC`: `0`, `prompt`, `1`). A token's arithmetic follows
/// only from whether it is a prompt token or a generated one, never from
/// the cache size or the pass length, so every slot count still gives the
/// same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorCoreUse {
    /// Every pass on the CUDA-core (a4v) kernels (`0`).
    Never,
    /// Prompt passes on the tensor cores (their multi-token forms take a
    /// pass's tokens two per mma), generated tokens on the a4v kernels,
    /// which are faster one token at a time (`prompt`, the default).
    Prompt,
    /// Every pass on the tensor cores (`1`).
    Always,
}

impl TensorCoreUse {
    /// From a `SLIPSTREAM_CUDA_TC` value: `0`, `1`, anything else (or none)
    /// the default.
    pub fn parse(v: Option<&str>) -> TensorCoreUse {
        match v.map(str::trim) {
            Some("0") => TensorCoreUse::Never,
            Some("1") => TensorCoreUse::Always,
            _ => TensorCoreUse::Prompt,
        }
    }
}

/// Which Gated DeltaNet recurrence kernel runs for heads up to 128 x 128
/// (`SLIPSTREAM_CUDA_GDN`), for every pass alike (so a token's bits do not
/// depend on the pass length or the cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GdnForm {
    /// `gdn_step_w` (the default).
    Warp,
    /// `gdn_step_r` (`rows`, for measuring).
    Rows,
}

impl GdnForm {
    /// From a `SLIPSTREAM_CUDA_GDN` value: `rows`, anything else (or none)
    /// the default.
    pub fn parse(v: Option<&str>) -> GdnForm {
        match v.map(str::trim) {
            Some("rows") => GdnForm::Rows,
            _ => GdnForm::Warp,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> CudaTuning {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        CudaTuning::from_vars(|name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn no_variable_gives_the_defaults() {
        assert_eq!(vars(&[]), CudaTuning::default());
        let d = CudaTuning::default();
        assert_eq!(d.moe_min_blocks, MOE_MIN_BLOCKS);
        assert!(d.a4v_split && d.pdl && d.prompt_attn_tc && d.route_mapped);
        assert!(d.device_routing && d.graphs && !d.fused_experts && !d.gpu_tensor_cores);
        assert_eq!(d.tensor_core_passes, TensorCoreUse::Prompt);
        assert_eq!(
            (d.tc_tokens_per_mma, d.pass_tokens),
            (2, DEFAULT_PASS_TOKENS)
        );
    }

    #[test]
    fn each_variable_sets_its_field() {
        let t = vars(&[
            ("SLIPSTREAM_CUDA_MOE_MINB", "2"),
            ("SLIPSTREAM_CUDA_A4V_SPLIT", "0"),
            ("SLIPSTREAM_CUDA_FUSED", "1"),
            ("SLIPSTREAM_CUDA_TC", "1"),
            ("SLIPSTREAM_CUDA_PDL", "0"),
            ("SLIPSTREAM_CUDA_TC_TPM", "1"),
            ("SLIPSTREAM_CUDA_TC_ATTN", "0"),
            ("SLIPSTREAM_CUDA_GDN", "rows"),
            ("SLIPSTREAM_CUDA_ROUTE_MAPPED", "0"),
            ("SLIPSTREAM_CUDA_DEVICE_ROUTING", "0"),
            ("SLIPSTREAM_CUDA_GRAPH", "0"),
            ("SLIPSTREAM_CUDA_PASS_TOKENS", "64"),
        ]);
        assert_eq!(
            t,
            CudaTuning {
                moe_min_blocks: 2,
                a4v_split: false,
                fused_experts: true,
                gpu_tensor_cores: true,
                tensor_core_passes: TensorCoreUse::Always,
                pdl: false,
                tc_tokens_per_mma: 1,
                prompt_attn_tc: false,
                gdn_form: GdnForm::Rows,
                route_mapped: false,
                device_routing: false,
                graphs: false,
                pass_tokens: 64,
                prompt_precision: PromptPrecision::Exact,
            }
        );
    }

    #[test]
    fn tc_has_two_readings_and_odd_values_keep_defaults() {
        // `prompt` and a padded `1` reach the model's pass choice only; the
        // device default needs exactly `1`.
        let t = vars(&[("SLIPSTREAM_CUDA_TC", " 1 ")]);
        assert_eq!(t.tensor_core_passes, TensorCoreUse::Always);
        assert!(!t.gpu_tensor_cores);
        let t = vars(&[("SLIPSTREAM_CUDA_TC", "0")]);
        assert_eq!(t.tensor_core_passes, TensorCoreUse::Never);
        assert!(!t.gpu_tensor_cores);
        let t = vars(&[
            ("SLIPSTREAM_CUDA_PASS_TOKENS", "100000"),
            ("SLIPSTREAM_CUDA_MOE_MINB", "x"),
            ("SLIPSTREAM_CUDA_PDL", "1"),
            ("SLIPSTREAM_CUDA_FUSED", "yes"),
        ]);
        assert_eq!(t.pass_tokens, PASS_TOKENS);
        assert_eq!(t.moe_min_blocks, MOE_MIN_BLOCKS);
        assert!(t.pdl && !t.fused_experts);
        assert_eq!(vars(&[("SLIPSTREAM_CUDA_PASS_TOKENS", "0")]).pass_tokens, 1);
    }

    #[test]
    fn gdn_form_parses_its_values_and_defaults_to_warp() {
        assert_eq!(GdnForm::parse(Some("rows")), GdnForm::Rows);
        assert_eq!(GdnForm::parse(Some(" rows ")), GdnForm::Rows);
        assert_eq!(GdnForm::parse(Some("warp")), GdnForm::Warp);
        assert_eq!(GdnForm::parse(None), GdnForm::Warp);
    }

    #[test]
    fn tensor_core_use_parses_its_values_and_defaults_to_prompt() {
        assert_eq!(TensorCoreUse::parse(Some("0")), TensorCoreUse::Never);
        assert_eq!(TensorCoreUse::parse(Some("1")), TensorCoreUse::Always);
        assert_eq!(TensorCoreUse::parse(Some(" 1 ")), TensorCoreUse::Always);
        for v in [None, Some("prompt"), Some(""), Some("yes")] {
            assert_eq!(TensorCoreUse::parse(v), TensorCoreUse::Prompt, "{v:?}");
        }
    }
}
