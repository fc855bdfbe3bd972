//! CUDA graphs of a pass's layers (device routing): capture, replay and
//! the position the captured kernels read from device memory.

use super::*;

/// How the current pass's layers reach the device (device routing only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PassMode {
    /// Each kernel launched on its own.
    Plain,
    /// Launches recorded into a CUDA graph, launched at the last layer.
    Capture,
    /// The recorded graph launched once; the layers launch nothing.
    Replay,
}

/// A pass's body (embedding to the last layer's experts) captured as one
/// CUDA graph: ~17 launches per layer become one, and the GPU runs them
/// without the per-launch gaps. Its kernels take the position from device
/// memory, so it replays at every position whose keys fit the KV caches it
/// captured.
pub(super) struct PassGraph {
    pub(super) exec: cudarc::driver::CudaGraph,
    /// Smallest KV capacity over the attention layers at capture (rows).
    pub(super) kv_cap: usize,
}

impl CudaModel {
    /// The position of the current pass in device memory (written with the
    /// token id in `embed`), for an attention layer whose KV cache holds
    /// `cap` rows.
    pub(super) fn device_pos(&self, cap: usize) -> Position {
        Position::Device {
            ptr: self.scratch.ids.ptr.add_bytes(4),
            cap,
        }
    }

    /// Decides how this pass's body runs (see [`PassMode`]); before a
    /// capture, grows every KV cache for `position` (growing allocates and
    /// synchronises, which a capture may not).
    pub(super) fn choose_mode(&mut self, position: usize) -> Result<()> {
        self.mode = PassMode::Plain;
        if !(self.device_routing && self.graphs) {
            return Ok(());
        }
        if self.graph.as_ref().is_some_and(|g| position < g.kv_cap) {
            self.mode = PassMode::Replay;
            return Ok(());
        }
        for l in 0..self.layers.len() {
            self.ensure_kv(l, position + 1)?;
        }
        self.graph = None;
        self.mode = PassMode::Capture;
        Ok(())
    }

    /// Ends a capture that failed midway, so the stream takes work again.
    pub(super) fn abort_capture(&mut self) {
        if self.mode == PassMode::Capture {
            // The graph (if any) is dropped: it is incomplete.
            let _ = self
                .gpu
                .stream
                .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            self.mode = PassMode::Plain;
        }
    }

    /// Ends the capture of the pass's body and launches it.
    pub(super) fn finish_capture(&mut self) -> Result<()> {
        let kv_cap = self
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                DMixer::Attn(a) => Some(a.cap),
                DMixer::Gdn(_) => None,
            })
            .min()
            .unwrap_or(usize::MAX);
        self.mode = PassMode::Plain;
        let exec = self
            .gpu
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))?
            .ok_or_else(|| CudaError::Invalid("the pass's graph capture came back empty".into()))?;
        exec.launch()?;
        self.graph = Some(PassGraph { exec, kv_cap });
        self.stats.graph_captures += 1;
        Ok(())
    }

    /// Whether each pass's layers run as one replayed CUDA graph (device
    /// routing, unless [`CudaTuning::graphs`] is off).
    pub fn pass_graphs(&self) -> bool {
        self.device_routing && self.graphs
    }
}
