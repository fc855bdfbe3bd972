//! Library side of the `slipstream` command: pieces the binary and its
//! integration tests share.

pub mod demo;
pub mod hwbench_cmd;
pub mod replay_cmd;
pub mod serve_cmd;
pub mod synth_cmd;
