//! Library side of the `slipstream` command: pieces the binary and its
//! integration tests share.

pub mod demo;
pub mod replay_cmd;
pub mod synth_cmd;
