//! Model configs from untrusted metadata: a Hugging Face `config.json` (input starting with
//! `{`) or a GGUF header. Nothing may panic or allocate absurdly; an accepted config passes
//! its own validation and its dimensions stay within the documented limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_model::config::limits;
use sluice_model::ModelConfig;

fn check(cfg: &ModelConfig) {
    cfg.validate().expect("an accepted config validates");
    assert!(cfg.hidden <= limits::HIDDEN && cfg.n_layer <= limits::LAYERS && cfg.vocab_size <= limits::VOCAB);
    assert!(cfg.head_dim > 0 && cfg.head_dim <= limits::HEAD_DIM);
    assert_eq!(cfg.sparse_layer.len(), cfg.n_layer);
    let _ = cfg.q_dim().checked_mul(cfg.kv_dim()).expect("bounded dims do not overflow");
}

fuzz_target!(|data: &[u8]| {
    if data.first() == Some(&b'{') {
        let Ok(text) = std::str::from_utf8(data) else { return };
        let Ok(c) = sluice_formats::JsonConfig::parse(std::path::Path::new("config.json"), text) else { return };
        if let Ok(cfg) = sluice_model::families::from_hf_config(&c) {
            check(&cfg);
        }
    } else if let Ok(f) = sluice_formats::gguf::parse_bytes(data) {
        if let Ok(cfg) = sluice_model::gguf::config_from_gguf(&f) {
            check(&cfg);
        }
    }
});
