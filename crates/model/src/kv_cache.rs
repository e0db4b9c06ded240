//! The KV cache: per layer, the rotated keys and the values of every position seen so far.
//! Stored in f32 so that prefill and decode read back exactly what they wrote.

pub struct KvCache {
    kv_dim: usize,
    /// `[layer] -> (keys, values)`, each `len × kv_dim`.
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    len: usize,
    max_len: usize,
}

impl KvCache {
    pub fn new(n_layer: usize, kv_dim: usize, max_len: usize) -> KvCache {
        KvCache { kv_dim, layers: (0..n_layer).map(|_| (Vec::new(), Vec::new())).collect(), len: 0, max_len }
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Forgets every position from `len` on (a new prompt, or a rejected speculation).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        for (k, v) in &mut self.layers {
            k.truncate(self.len * self.kv_dim);
            v.truncate(self.len * self.kv_dim);
        }
    }

    /// Appends `n` positions of keys and values to `layer` (rows `k` and `v`, `n × kv_dim`).
    /// Every layer must be appended the same `n` before `commit(n)`.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let (kk, vv) = &mut self.layers[layer];
        debug_assert_eq!(kk.len(), self.len * self.kv_dim, "layer {layer} appended twice");
        kk.extend_from_slice(k);
        vv.extend_from_slice(v);
    }

    /// Marks `n` appended positions as part of the cache.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keys and values of `layer`, including positions appended but not yet committed.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| (k.capacity() + v.capacity()) * 4).sum()
    }
}
