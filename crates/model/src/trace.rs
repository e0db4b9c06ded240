//! Observation hooks: named intermediates (for dumps and diffs) and routing decisions (for
//! routing traces and cache simulation). The forward pass calls them only when an observer
//! is attached, so an unobserved run pays one branch per call site.

pub trait Observer {
    /// An intermediate activation, `n_tokens × width` row-major, e.g. `("attn_out", Some(3))`.
    fn tensor(&mut self, _name: &'static str, _layer: Option<usize>, _data: &[f32], _n_tokens: usize) {}

    /// The router's choice for the token at absolute position `pos` of `layer`: expert ids in
    /// rank order and their weights.
    fn routing(&mut self, _layer: usize, _pos: usize, _experts: &[u32], _weights: &[f32]) {}
}

/// Records every named intermediate (tests and debugging).
#[derive(Default)]
pub struct Recorder {
    pub tensors: Vec<(String, Option<usize>, Vec<f32>)>,
    pub routes: Vec<(usize, usize, Vec<u32>)>,
}

impl Observer for Recorder {
    fn tensor(&mut self, name: &'static str, layer: Option<usize>, data: &[f32], _n: usize) {
        self.tensors.push((name.to_string(), layer, data.to_vec()));
    }

    fn routing(&mut self, layer: usize, pos: usize, experts: &[u32], _w: &[f32]) {
        self.routes.push((layer, pos, experts.to_vec()));
    }
}
